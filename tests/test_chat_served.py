"""The release-layout checkpoint served with the defaults a user gets (`pdserve up`: bf16, DeepSeek's
indexer numerics): chat messages through the router, `pdserve generate --chat` and `pdserve chat`."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from router.cluster import Cluster
from shared.engine import LLM, SamplingParams
from shared.protocol.chat import ChatMessage
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.official_layout import build_official_checkpoint


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return build_official_checkpoint(tmp_path_factory.mktemp("served-official") / "DeepSeek-V3.2-tiny")


@pytest.fixture(scope="module")
def cluster(official, tmp_path_factory):
    with Cluster(str(official), log_dir=tmp_path_factory.mktemp("logs")) as c:  # every flag at its default
        yield c


def _stream(address, req):
    with grpc.insecure_channel(address) as ch:
        return list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120))


def test_chat_messages_through_the_router_equal_in_process(official, cluster):
    convo = [ChatMessage("system", "Be brief."), ChatMessage("user", "hello"),
             ChatMessage("assistant", "Hi there.", reasoning_content="greeting"), ChatMessage("user", "2+2?")]
    sp = generation_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, skip_special_tokens=False)
    req = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role=m.role, content=m.content, reasoning_content=m.reasoning_content)
                  for m in convo], thinking=True, sampling_params=sp)
    msgs = _stream(cluster.address, req)
    local = LLM(str(official), dtype="bfloat16").chat(
        convo, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, skip_special_tokens=False), thinking=True)
    assert [t for m in msgs for t in m.token_ids] == local.token_ids
    assert msgs[-1].usage.prompt_tokens == len(local.prompt_token_ids)
    # thinking mode: the reply up to </think> arrives as reasoning_text, the answer as text
    reasoning, _, answer = local.text.partition("</think>")
    assert "".join(m.reasoning_text for m in msgs) == reasoning.replace("<think>", "")
    assert "".join(m.text for m in msgs) == answer.replace("<｜end▁of▁sentence｜>", "")


def test_pdserve_generate_chat_and_interactive_chat(cluster):
    gen = subprocess.run([sys.executable, "-m", "router.cli", "generate", "Hello", "--chat", "--max-tokens", "5",
                          "--ignore-eos", "--address", cluster.address], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert "completion_tokens=5" in gen.stdout
    chat = subprocess.run([sys.executable, "-m", "router.cli", "chat", "--system", "Be brief.", "--max-tokens", "4",
                           "--ignore-eos", "--thinking", "--address", cluster.address],
                          input="first question\nsecond question\n/exit\n", capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("assistant> ") == 2 and "error" not in chat.stderr.lower()
    # a value the request's field cannot hold is a usage error naming the flag (was the client's traceback)
    huge = subprocess.run([sys.executable, "-m", "router.cli", "generate", "Hello", "--max-tokens", "99999999999",
                           "--address", cluster.address], capture_output=True, text=True, timeout=120)
    assert huge.returncode == 2 and "Traceback" not in huge.stderr
    assert "--max-tokens: 99999999999 does not fit a 32-bit integer" in huge.stderr
