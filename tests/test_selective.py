"""Selective disaggregation (`--local-prefill-tokens`): a short prompt may be prefilled by the decode instance
itself, within its token budget beside its running decodes, when the SLA model predicts a sooner first
token there. Served output is the disaggregated path's, the metrics count both paths, the policy decides
by the prediction, and a hostile local-prefill call fails alone and leaks nothing. A burst's overflow
(`--overflow-prefill-tokens`, on by default) takes the same path only while every prefill instance is saturated."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from bench.fleet_faults import UpProcess
from router.config import RouterConfig
from router.perf import PerfModel
from router.policy import DecodeView, PrefillView, RankView, Request, SlaPolicy
from shared.engine import LLM, SamplingParams
from shared.rpc.pdserve.v1 import generation_pb2, internal_pb2, internal_pb2_grpc
from tests.conftest import ROOT
from tests.helpers import Completion, concurrent_generate, prefill_paths, wait_for

DEMO = str(ROOT / "models" / "demo-v32")
SHORT = ["And God said,", "The LORD is my shepherd;", "In the beginning", "Blessed are the meek:"]
LONG = ["And it came to pass in those days, that there went out a decree from Caesar Augustus, that all the "
        "world should be taxed.", "Now the serpent was more subtil than any beast of the field which the LORD "
        "God had made. And he said unto the woman,"]
LIMIT = 12  # tokens: the short prompts (4-8 tokens) may go to decode, the long ones (24+) never


def _request(prompt: str, params: SamplingParams) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, sampling_params=generation_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, ignore_eos=params.ignore_eos,
        seed=params.seed))


def test_local_prefill_serves_the_disaggregated_answer_and_counts_both_paths(tmp_path):
    """On an attention-DP + EP decode instance: short prompts sent one at a time (the decode idle:
    prefilling there is predicted sooner, until the calibration of each path has seen it) and then all
    prompts at once (a mix of paths) give the in-process greedy and seeded-sampling answers; the router
    counts both paths, the decode counts the prompt tokens it prefilled, and every block comes back.
    (MTP drafting on locally prefilled prompts: tests/test_mtp_served.py, shape 1-rank.)"""
    from router.cli import up_cluster

    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    cases = [(p, greedy) for p in SHORT + LONG] + [(SHORT[0], sampled), (LONG[0], sampled)]
    llm = LLM(DEMO, dtype="bfloat16")
    for prompt, _ in cases:
        assert (len(llm.engine.tokenizer.encode(prompt)) <= LIMIT) == (prompt in SHORT)
    want = [Completion(o.token_ids, o.text, o.finish_reason)
            for o in (llm.generate([p], sp)[0] for p, sp in cases)]
    cluster = up_cluster(["--model", DEMO, "--port", "0", "--local-prefill-tokens", str(LIMIT), "--decode-dp", "2",
                          "--decode-ep", "2"], tmp_path / "logs")
    cluster.extra_router += ["--metrics-port", "0"]
    cluster.extra_decode += ["--metrics-port", "0"]
    with cluster:
        url = f"http://127.0.0.1:{cluster.metrics_ports[cluster.address]}/metrics"
        alone = [concurrent_generate(cluster.address, [_request(p, sp)])[0] for p, sp in cases[:len(SHORT)]]
        after_alone = prefill_paths(url)
        together = concurrent_generate(cluster.address, [_request(p, sp) for p, sp in cases])
        paths = prefill_paths(url)
        decode_metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{cluster.metrics_ports[cluster.decode_addrs[0]]}/metrics", timeout=5).read().decode()
        with cluster.channel(cluster.decode_addrs[0]) as ch:
            stub = internal_pb2_grpc.DecodeStub(ch)
            assert wait_for(lambda: (lambda r: r.free_blocks == r.total_blocks and r.running == 0)(
                stub.GetLoad(internal_pb2.LoadRequest(), timeout=5)), 15)
    print("prefill paths:", after_alone, "then", paths)
    assert alone == want[:len(SHORT)]
    assert together == want
    assert after_alone.get("local", 0) >= 1  # an idle decode prefills a short prompt sooner
    assert paths["local"] + paths["disaggregated"] == len(SHORT) + len(cases)
    assert paths["disaggregated"] >= len(LONG) + 1  # the long prompts (and the long sampled one) always
    local_prompt = re.search(r'pdserve_tokens_total\{kind="local_prompt",service="decode"\} (\S+)', decode_metrics)
    assert local_prompt and float(local_prompt.group(1)) >= paths["local"] * 4  # short prompts: 4+ tokens each


def test_a_hostile_local_prefill_call_fails_alone_and_frees_its_lease(tmp_path):
    """Straight to decode's internal API with the cluster's credentials: a local prefill naming token ids
    outside the vocabulary, or a prompt larger than its lease, is INVALID_ARGUMENT, the leases' blocks come
    back, and a good local prefill on the next lease still streams."""
    from router.cli import up_cluster

    with up_cluster(["--model", DEMO, "--port", "0"], tmp_path / "logs") as cluster:
        with cluster.channel(cluster.decode_addrs[0]) as ch:
            stub = internal_pb2_grpc.DecodeStub(ch)
            total = stub.GetLoad(internal_pb2.LoadRequest(), timeout=5).total_blocks

            def reserve() -> str:
                return stub.Reserve(internal_pb2.ReserveRequest(request_id="x", num_prompt_tokens=4, max_tokens=4),
                                    timeout=5).destination.lease_id

            sp = generation_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Decode(internal_pb2.DecodeRequest(request_id="bad", lease_id=reserve(), sampling_params=sp,
                                                            prompt_token_ids=[5, 1 << 30, 7], local_prefill=True),
                                 timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as err:  # a prompt larger than the blocks the lease holds
                list(stub.Decode(internal_pb2.DecodeRequest(request_id="big", lease_id=reserve(), sampling_params=sp,
                                                            prompt_token_ids=list(range(5, 200)), local_prefill=True),
                                 timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease" in err.value.details()
            assert wait_for(lambda: stub.GetLoad(internal_pb2.LoadRequest(), timeout=5).free_blocks == total, 10)
            got = [t for m in stub.Decode(internal_pb2.DecodeRequest(
                request_id="good", lease_id=reserve(), sampling_params=sp, prompt_token_ids=[5, 6, 7],
                local_prefill=True), timeout=30) for t in m.token_ids]
            want = LLM(DEMO, dtype="bfloat16").generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                                   ignore_eos=True))[0].token_ids
            assert got == want
            assert wait_for(lambda: stub.GetLoad(internal_pb2.LoadRequest(), timeout=5).free_blocks == total, 10)


def _views(queued: int, running: int) -> tuple[list[PrefillView], list[DecodeView]]:
    return [PrefillView("p", queued_tokens=queued)], [DecodeView("d", ranks=[RankView(running, running * 64)])]


@pytest.mark.parametrize(("queued", "running", "limit_ok", "local"), [
    (0, 0, True, True),  # idle everywhere: no RPC, no transfer
    (4096, 32, True, True),  # a prefill queue of long prompts: the short prompt skips it
    (0, 200, True, False),  # a full decode step, an idle prefill: the pair is sooner
    (4096, 32, False, False),  # longer than --local-prefill-tokens: never local
])
def test_the_policy_prefills_on_decode_only_where_it_predicts_a_sooner_first_token(queued, running, limit_ok, local):
    perf = PerfModel()
    policy = SlaPolicy(perf, seed=0)
    prefills, decodes = _views(queued, running)
    req = Request(16, 32, 0.0, 0.0, local_prefill_tokens=64 if limit_ok else 8)
    choice = policy.choose(req, prefills, decodes)[0]
    assert choice.local == local
    if local:
        assert choice.prefill == -1 and choice.ttft_s < policy.predict(req, prefills, decodes)[0].ttft_s


def test_a_follow_up_whose_context_decode_keeps_is_prefilled_there():
    """A 400-token follow-up is far over --local-prefill-tokens 64, but the decode instance keeps 384 of its
    tokens: it computes only 16 itself, so it is local there (and only there)."""
    policy = SlaPolicy(PerfModel(), seed=0)
    prefills, decodes = _views(0, 0)
    req = Request(400, 32, 0.0, 0.0, cached_by_decode=[384] + [0] * (len(decodes) - 1), local_prefill_tokens=64)
    choice = policy.choose(req, prefills, decodes)[0]
    assert choice.local and choice.decode == 0
    far = Request(400, 32, 0.0, 0.0, cached_by_decode=[0] * len(decodes), local_prefill_tokens=64)
    assert not far.local_prefill(far.local_limit(prefills))


@pytest.mark.parametrize(("queues", "prompt", "local"), [
    ((0,), 16, False),  # an idle prefill pool takes every prompt: disaggregation as configured
    ((4096,), 16, True),  # a burst queued at the prefill instance: the short prompt overflows to decode
    ((4096, 0), 16, False),  # another prefill instance is idle: it takes the prompt
    ((4096, 4096), 16, True),  # every prefill instance has a queue
    ((4096,), 600, False),  # longer than --overflow-prefill-tokens: it waits in the prefill queue
])
def test_a_burst_overflows_short_prompts_to_decode_only_while_every_prefill_instance_has_a_queue(queues, prompt, local):
    """--overflow-prefill-tokens (default 512) with --local-prefill-tokens 0: the decode instance prefills a short
    prompt itself only while each prefill instance has prompts queued (and the SLA model predicts a sooner first
    token there); otherwise the prompt goes to a prefill instance."""
    policy = SlaPolicy(PerfModel(), seed=0)
    prefills = [PrefillView(f"p{i}", queued_tokens=q) for i, q in enumerate(queues)]
    decodes = [DecodeView("d", ranks=[RankView(32, 32 * 64)])]
    req = Request(prompt, 32, 0.0, 0.0, overflow_prefill_tokens=RouterConfig.overflow_prefill_tokens)
    choice = policy.choose(req, prefills, decodes)[0]
    assert choice.local == local
    if not local:
        assert choice.prefill == next(i for i, q in enumerate(queues) if q == min(queues))
    down = [PrefillView("p0", queued_tokens=4096), PrefillView("p1", queued_tokens=0, up=False)]
    assert policy.choose(req, down, decodes)[0].local == (prompt <= 512)  # a down instance takes nothing


def test_a_burst_through_pdserve_up_overflows_short_prompts_to_decode(tmp_path):
    """`pdserve up` with its defaults (--overflow-prefill-tokens 512), driven by the official `openai` SDK: a prompt
    sent alone goes through the prefill instance; 32 prompts of 100 tokens sent at once (more than 512 queued at the
    prefill instance) partly overflow to the decode instance (the router counts both paths), each completion equal
    to its prompt's answer sent alone, and every KV block and lease comes back. A negative --overflow-prefill-tokens
    is refused, naming the field."""
    bad = subprocess.run([sys.executable, "-m", "router.cli", "up", "--overflow-prefill-tokens", "-1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "overflowPrefillTokens: expected at least 0" in bad.stderr, bad.stderr[-500:]
    up = UpProcess(["--model", DEMO, "--port", "0", "--http-port", "0"], tmp_path).start()
    try:
        client = openai.OpenAI(base_url=up.http_url, api_key="unused", max_retries=0)
        prompts = [[10 + (i * 37 + j * 11) % 900 for j in range(100)] for i in range(32)]  # 3,200 tokens at once

        def ask(prompt: list[int]) -> str:
            return client.completions.create(model=up.model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        alone = [ask(p) for p in prompts]  # one at a time: the prefill instance is idle, it takes each
        before = prefill_paths(up.metrics["router"])
        assert before.get("local", 0) == 0 and before["disaggregated"] == len(prompts), before
        with ThreadPoolExecutor(len(prompts)) as pool:
            burst = list(pool.map(ask, prompts))
        after = prefill_paths(up.metrics["router"])
        assert burst == alone
        assert after.get("local", 0) > 0 and after["disaggregated"] > len(prompts), after
        assert after["local"] + after["disaggregated"] == 2 * len(prompts)
        held = ("pdserve_kv_blocks_used", "pdserve_active_leases", "pdserve_running_requests")
        decodes = [n for n in up.metrics if n.startswith("decode")]
        assert wait_for(lambda: all(up.metric(n, m) == 0 for n in decodes for m in held))
    finally:
        assert up.stop() == 0, up.output()
