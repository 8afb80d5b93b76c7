"""No request lost, through the command users run: `pdserve up --num-prefill 2 --num-decode 2 --http-port 0` as a
subprocess (bench/fleet_faults.py drives it), 24 concurrent streams (half over the OpenAI HTTP API with the official
`openai` SDK, half over gRPC; greedy and seeded), and one fault per round while they stream: a decode instance
SIGKILLed, a decode instance's process group SIGTERMed (it drains: its running requests move at once), a prefill
instance SIGKILLed mid-prefill, the router SIGTERMed (it drains: new requests refused with 503 + Retry-After /
UNAVAILABLE, the streams in flight finish), the router SIGKILLed (its streams end with a clean error). Every stream
of the first four is whole and equal to the unfaulted round; `pdserve up` restarts each victim (counted on its own
/metrics), the router takes it back, new requests succeed, and the survivors hold no KV block or lease. A router
started before its instances is not SERVING (but alive) and holds requests until they come."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.fleet_faults import FAULTS, STREAMS, TOKENS, UpProcess, run_fault, unfaulted
from shared.config import EngineConfig, knob_default
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers import child_processes, wait_for

ROOT = Path(__file__).resolve().parents[1]
DEMO = "models/demo-v32"
MOVED_BY = {"decode-kill": ("unavailable", "kv_transfer", "cancelled"), "decode-term": ("drain",), "prefill-kill": ()}


def moved(up: UpProcess, causes: tuple[str, ...]) -> float:
    """Requests the router moved (migrations by these causes; failovers too when none is named)."""
    if not causes:
        return up.metric("router", "pdserve_router_migrations_total") + up.metric(
            "router", "pdserve_router_failovers_total")
    return sum(up.metric("router", f'pdserve_router_migrations_total{{cause="{c}"}}') for c in causes)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    proc = UpProcess(["--model", DEMO, "--port", "0", "--http-port", "0", "--num-prefill", "2", "--num-decode", "2"],
                     tmp_path_factory.mktemp("fleet-logs"))
    try:
        yield proc.start()
    finally:
        assert proc.stop() == 0, proc.output()  # pdserve up stops on its own SIGINT, cleanly


@pytest.fixture(scope="module")
def workload(up):
    return unfaulted(up, TOKENS, json.loads((ROOT / DEMO / "config.json").read_text())["vocab_size"])


def test_openai_contract_through_pdserve_up(up):
    """The HTTP API's contract as `pdserve up --http-port` serves it, with the official SDK (the whole contract:
    tests/test_openai_contract.py): completions default to 16 tokens, usage counts the prompt once for n=3,
    the developer role is a system prompt, OpenAI's error body on an unknown route and on an oversized body."""
    client = openai.OpenAI(base_url=up.http_url, api_key="none", max_retries=0)
    assert client.completions.create(model=up.model, prompt=[5, 6, 7, 8, 9], temperature=0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 16
    usage = client.completions.create(model=up.model, prompt=[5, 6, 7, 8, 9], n=3, max_tokens=2, seed=1).usage
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 6
    chat = client.chat.completions.create(model=up.model, max_tokens=4, messages=[
        {"role": "developer", "content": "Speak as a prophet."}, {"role": "user", "content": "Who made light?"}])
    assert chat.choices[0].finish_reason in ("length", "stop")
    base = up.http_url.removesuffix("/v1")
    missing = httpx.get(f"{base}/v1/nope", timeout=10)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    huge = httpx.post(f"{up.http_url}/completions", content=b"x" * (33 << 20), timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == 413


def test_cache_salt_through_pdserve_up(up):
    """Tenants apart, through the command: a prompt computed under salt A is served from the prefix cache to
    salt A again (once the router's prefix summaries have it, whichever prefill instance it picks), never to
    salt B or to no salt; a 257-character salt is HTTP 400 naming the field."""
    client = openai.OpenAI(base_url=up.http_url, api_key="none", max_retries=0)
    prompt = [7 + i % 50 for i in range(100)]

    def cached(salt: str) -> int:
        usage = client.completions.create(model=up.model, prompt=prompt, max_tokens=2, temperature=0,
                                          extra_body={"cache_salt": salt} if salt else {}).usage
        return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0

    assert cached("tenant-a") == 0
    hits = []
    for _ in range(3):  # both prefill instances may compute it once before the summaries agree
        time.sleep(1.0)
        hits.append(cached("tenant-a"))
    block = knob_default(EngineConfig, "block_size")  # what `pdserve up` runs with
    assert max(hits) >= len(prompt) // block * block > 0, hits  # the whole blocks of the 100-token prompt
    assert cached("tenant-b") == 0 and cached("") == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("x" * 257)


def test_follow_up_turns_reuse_decode_cache_through_pdserve_up(up):
    """Multi-turn through the command with the official SDK: each follow-up's reservation starts on the blocks a
    decode instance kept of the turn before, so prefill pushes only the new blocks, and its greedy tokens equal the
    same prompt under a fresh cache_salt (nothing reused anywhere)."""
    client = openai.OpenAI(base_url=up.http_url, api_key="none", max_retries=0)
    decodes = [name for name in up.metrics if name.startswith("decode")]

    def blocks(source: str) -> float:
        return sum(up.metric(d, f'pdserve_decode_kv_blocks_total{{source="{source}"}}') for d in decodes)

    def complete(prompt: list[int], salt: str = "") -> str:
        return client.completions.create(model=up.model, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "cache_salt": salt}).choices[0].text

    conversation = [11 + i % 40 for i in range(300)]  # several of the default 64-token blocks
    complete(conversation)
    reused, pushed = blocks("reused"), blocks("pushed")
    turns = []
    for turn in range(3):
        conversation = conversation + [60 + turn] * 40
        turns.append((list(conversation), complete(conversation)))
    assert blocks("reused") - reused > 0  # the router placed follow-ups where their context was
    assert (blocks("pushed") - pushed) * 3 < blocks("reused") - reused + blocks("pushed") - pushed
    for i, (prompt, text) in enumerate(turns):
        assert complete(prompt, salt=f"fresh-{i}") == text


STREAM_TOKENS = 160


def test_streams_ride_one_token_bus_per_decode_instance_through_pdserve_up(up):
    """With the command's defaults the router takes each decode instance's messages for all its requests on one
    token bus: once every instance holds the router's, 8 concurrent SDK streams' tokens all come as bus messages,
    several streams' in a batch."""
    client = openai.OpenAI(base_url=up.http_url, api_key="none", max_retries=0)
    decodes = [name for name in up.metrics if name.startswith("decode")]

    def total(name: str) -> float:
        return sum(up.metric(d, name) for d in decodes)

    def complete(i: int, n: int = 4) -> int:
        return client.completions.create(model=up.model, prompt=[11 + i, 12, 13], max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert wait_for(lambda: sum(pool.map(complete, range(8))) and total("pdserve_decode_token_buses ") == 2, 60)
        sent, batches = (total(f"pdserve_decode_token_bus_{k}_total") for k in ("messages", "batches"))
        streamed = sum(pool.map(complete, range(8), [STREAM_TOKENS] * 8))
    sent = total("pdserve_decode_token_bus_messages_total") - sent
    assert streamed == 8 * STREAM_TOKENS and sent == streamed
    # ~4 streams an instance share its steps, less where their starts and ends are staggered (a loaded host
    # staggers them more: with 64 tokens a stream 1.35-1.7 messages a batch were seen in full suite runs, 1.9-3.5
    # alone; the longer the streams, the less their staggered ends weigh)
    assert total("pdserve_decode_token_bus_batches_total") - batches < sent * 2 / 3


def test_serving_processes_freeze_their_startup_heap(up):
    """The router and every front froze what they held when they began serving (gc.freeze): a full collection in
    the middle of a stream walks only what came after (the engine cores freeze before they report ready)."""
    for name in up.metrics:
        assert up.metric(name, "pdserve_process_frozen_objects") > 10_000, name


def _ignores(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` ignores `sig` (its SigIgn mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask >> (sig - 1) & 1)


def test_engine_cores_leave_stop_signals_to_their_front(up):
    """A stop signal to an instance's whole process group (what the decode-term fault sends, and Ctrl-C) is its
    front's to act on: the front drains, then stops its engine core. A core that died of the signal first failed
    the running requests as a dead engine, so they moved as `unavailable`, not `drain` (seen on a loaded host);
    every prefill and decode front's core ignores SIGTERM and SIGINT, and the front itself does not."""
    for name in (n for n in up.metrics if n.startswith(("prefill", "decode"))):
        front = up.service_pid(name)
        cores = child_processes(front)
        assert cores, f"{name} runs no engine core process"
        assert not _ignores(front, signal.SIGTERM), name
        for pid in cores:
            assert _ignores(pid, signal.SIGTERM) and _ignores(pid, signal.SIGINT), (name, pid)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_through_pdserve_up(up, workload, fault):
    specs, reference = workload
    restarts = up.metric("up", "pdserve_up_restarts_total")
    before = moved(up, MOVED_BY.get(fault, ()))
    result = run_fault(up, fault, specs, reference, TOKENS)
    assert result.wrong == 0, result  # never a silently short or altered stream
    if fault == "router-kill":  # what it held is lost, but every client hears so
        assert result.whole + result.clean_errors == STREAMS and result.clean_errors > 0, result
    else:
        assert result.whole == STREAMS, result
    if fault == "router-term":
        assert "HTTP 503 Retry-After=1" in result.notes and "gRPC UNAVAILABLE" in result.notes, result
    elif fault in MOVED_BY:  # the fault did hit requests, and they moved for the reason it gave
        assert moved(up, MOVED_BY[fault]) > before
    assert result.served_after, result
    assert "survivors still hold KV blocks, leases or requests" not in result.notes, result
    assert up.metric("up", "pdserve_up_restarts_total") == restarts + 1
    assert "stopping the rest" not in up.output()


def test_a_router_before_its_instances_is_not_serving_and_holds_requests(tmp_path):
    """No instance reachable: health NOT_SERVING, and a request waits (within its deadline) instead of
    failing at once."""
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "router", "--model", DEMO, "--port", "0", "--port-file",
                             str(port_file), "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9", "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(port_file.exists, timeout=60)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                            == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
            # not ready, but alive: the chart's liveness probe asks pdserve.liveness and leaves it running
            assert health.Check(health_pb2.HealthCheckRequest(service="pdserve.liveness"), timeout=5).status \
                == health_pb2.HealthCheckResponse.SERVING
            t = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7]), timeout=2.0))
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert time.monotonic() - t >= 1.0  # it waited for an instance
    finally:
        proc.kill()
        proc.wait(10)
