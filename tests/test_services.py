"""Disaggregated serving end to end: router, prefill and decode as real subprocesses on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.cluster import Cluster, free_port, wait_port_file
from shared.engine import LLM, SamplingParams
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.helpers import TRANSPORTS, concurrent_greedy, load_reference, random_prompts, reference_greedy, wait_for

LEASE_SECONDS = 6.0  # long enough for 32 concurrent prompts to queue at prefill on a loaded machine
# The services compare with transformers here: fp32 and transformers' indexer numerics (both are flags).
REFERENCE_NUMERICS = dict(dtype="float32", indexer_numerics="transformers")


@pytest.fixture(scope="module")
def model_dir(served_model):
    return served_model


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request, model_dir, tmp_path_factory):
    c = Cluster(str(model_dir), kv_transport=request.param, **REFERENCE_NUMERICS,
                log_dir=tmp_path_factory.mktemp(f"logs-{request.param}"),
                extra_decode=["--lease-seconds", str(LEASE_SECONDS), "--block-size", "4"],
                extra_prefill=["--block-size", "4", "--max-prefill-tokens", "16"])
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def local_llm(model_dir):
    return LLM(str(model_dir), block_size=4, **REFERENCE_NUMERICS)


def generate(address: str, timeout: float = 60, **kwargs) -> list[generation_pb2.GenerateResponse]:
    params = kwargs.pop("sampling_params", None)
    req = generation_pb2.GenerateRequest(sampling_params=params, **kwargs)
    with grpc.insecure_channel(address) as ch:
        return list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout))


def greedy(max_tokens: int = 12) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def decode_load(cluster) -> internal_pb2.LoadReport:
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        return internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5)


def test_greedy_equals_in_process_and_reference(cluster, local_llm, model_dir):
    ref = load_reference(model_dir)
    prompts = random_prompts(8, [3, 9, 17, 30, 5, 12, 22, 40], 512, seed=30)
    local = local_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, local):
        msgs = generate(cluster.address, prompt_token_ids=prompt, sampling_params=greedy())
        assert tokens(msgs) == out.token_ids == reference_greedy(ref, prompt, 12)
        last = msgs[-1]
        assert last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 12)


def test_repeated_system_prompt_hits_prefill_prefix_cache(cluster, local_llm):
    """The prefill instance reuses the cached blocks of a shared prefix (pushed to decode with the
    rest); usage reports them; tokens equal the in-process engine."""
    system = random_prompts(1, [41], 512, seed=31)[0]
    for i, question in enumerate(random_prompts(2, [6, 3], 512, seed=32)):
        prompt = system + question
        msgs = generate(cluster.address, prompt_token_ids=prompt, sampling_params=greedy(8))
        local = local_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert tokens(msgs) == local.token_ids
        assert msgs[-1].usage.cached_prompt_tokens == (0 if i == 0 else 40)  # 10 full blocks of 4


def test_follow_up_turn_reuses_decode_cache(cluster, local_llm):
    """Decode keeps the prompt blocks prefill pushed: a follow-up turn's reservation starts on them (only the
    blocks after them travel), its tokens equal the in-process engine's; another tenant's salt reuses nothing;
    a prompt that disagrees with num_prompt_tokens is INVALID_ARGUMENT naming the field."""
    first = random_prompts(1, [30], 512, seed=41)[0]
    answer = tokens(generate(cluster.address, prompt_token_ids=first, sampling_params=greedy(6)))
    follow = first + answer + random_prompts(1, [9], 512, seed=42)[0]
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)

        def reserve(**kw) -> internal_pb2.ReserveResponse:
            reply = stub.Reserve(internal_pb2.ReserveRequest(request_id="probe", num_prompt_tokens=len(follow),
                                                             max_tokens=4, prompt_token_ids=follow, **kw), timeout=5)
            assert stub.Release(internal_pb2.ReleaseRequest(lease_id=reply.destination.lease_id), timeout=5).released
            return reply

        assert reserve().destination.reused_blocks == 30 // 4  # the first prompt's full blocks (not the answer's)
        assert reserve(cache_salt="tenant-b").destination.reused_blocks == 0
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(internal_pb2.ReserveRequest(request_id="bad", num_prompt_tokens=len(follow) + 1,
                                                     max_tokens=4, prompt_token_ids=follow), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.value.details()
    msgs = generate(cluster.address, prompt_token_ids=follow, sampling_params=greedy(8))
    local = local_llm.generate([follow], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert tokens(msgs) == local.token_ids


def test_text_prompt_streams_text(cluster, local_llm):
    msgs = generate(cluster.address, prompt="Hello world", sampling_params=greedy(8))
    local = local_llm.generate("Hello world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert tokens(msgs) == local.token_ids
    assert "".join(m.text for m in msgs) == local.text
    assert all(len(m.token_ids) == 1 for m in msgs)  # one message per step


def test_seeded_sampling_matches_in_process(cluster, local_llm):
    sp = generation_pb2.SamplingParams(max_tokens=10, temperature=1.3, top_p=0.95, seed=11, ignore_eos=True)
    prompt = random_prompts(1, [15], 512, seed=31)[0]
    local = local_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.3, top_p=0.95, seed=11,
                                                        ignore_eos=True))[0]
    assert tokens(generate(cluster.address, prompt_token_ids=prompt, sampling_params=sp)) == local.token_ids


def test_32_concurrent_streams(cluster, local_llm):
    prompts = random_prompts(32, [4, 11, 19, 27, 35], 512, seed=32)
    expected = [o.token_ids for o in local_llm.generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    assert concurrent_greedy(cluster.address, prompts, 10) == expected
    assert wait_for(lambda: decode_load(cluster).free_blocks == decode_load(cluster).total_blocks)


BAD_REQUESTS = [
    ("prompt", dict(prompt="", sampling_params=greedy())),
    ("both", dict(prompt="hi", prompt_token_ids=[3, 4], sampling_params=greedy())),
    ("prompt_token_ids", dict(prompt_token_ids=[3, 100000], sampling_params=greedy())),
    ("prompt_token_ids", dict(prompt_token_ids=[3, -1], sampling_params=greedy())),
    ("max_tokens", dict(prompt_token_ids=[3], sampling_params=generation_pb2.SamplingParams(max_tokens=0))),
    ("max_tokens", dict(prompt_token_ids=[3], sampling_params=generation_pb2.SamplingParams(max_tokens=-5))),
    ("max_tokens", dict(prompt_token_ids=[3] * 10, sampling_params=generation_pb2.SamplingParams(max_tokens=510))),
    ("temperature", dict(prompt_token_ids=[3], sampling_params=generation_pb2.SamplingParams(temperature=-0.5))),
    ("top_p", dict(prompt_token_ids=[3], sampling_params=generation_pb2.SamplingParams(top_p=0.0))),
    ("top_p", dict(prompt_token_ids=[3], sampling_params=generation_pb2.SamplingParams(top_p=1.5))),
    ("top_k", dict(prompt_token_ids=[3], sampling_params=generation_pb2.SamplingParams(top_k=-3))),
    ("messages", dict(messages=[generation_pb2.ChatMessage(role="robot", content="hi")], sampling_params=greedy())),
    ("messages", dict(messages=[generation_pb2.ChatMessage(role="user", content="hi")], prompt="hi",
                      sampling_params=greedy())),
]


@pytest.mark.parametrize("field,kwargs", BAD_REQUESTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_invalid_argument(cluster, field, kwargs):
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.address, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    # nothing crashed: a good request still works
    assert tokens(generate(cluster.address, prompt_token_ids=[5, 6], sampling_params=greedy(2)))


def test_cancel_frees_decode_blocks(cluster):
    initial = decode_load(cluster).total_blocks
    with grpc.insecure_channel(cluster.address) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7], sampling_params=greedy(505)), timeout=60)
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                assert decode_load(cluster).free_blocks < initial  # the request holds blocks
                call.cancel()
                break
    assert wait_for(lambda: decode_load(cluster).free_blocks == initial)
    assert decode_load(cluster).running == 0


def test_unused_reservation_expires(cluster):
    total = decode_load(cluster).total_blocks
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        reply = internal_pb2_grpc.DecodeStub(ch).Reserve(
            internal_pb2.ReserveRequest(request_id="never-used", num_prompt_tokens=20, max_tokens=20), timeout=5)
    assert len(reply.destination.block_ids) == 10  # 40 tokens / block size 4
    def reserved() -> bool:  # GetLoad shows the engine's last loop turn: the lease appears within a turn
        load = decode_load(cluster)
        return load.free_blocks == total - 10 and load.active_leases == 1

    assert wait_for(reserved, timeout=LEASE_SECONDS / 2)
    assert wait_for(lambda: decode_load(cluster).free_blocks == total, timeout=LEASE_SECONDS + 5)
    assert decode_load(cluster).active_leases == 0


def test_decode_refuses_incomplete_lease(cluster):
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)
        reply = stub.Reserve(internal_pb2.ReserveRequest(request_id="x", num_prompt_tokens=4, max_tokens=4), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(internal_pb2.DecodeRequest(lease_id=reply.destination.lease_id, prompt_token_ids=[1, 2],
                                                        first_token_id=3), timeout=5))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "incomplete" in err.value.details()
        assert stub.Release(internal_pb2.ReleaseRequest(lease_id=reply.destination.lease_id), timeout=5).released


def test_health_and_reflection(cluster):
    expected = {cluster.address: "pdserve.v1.Generation", cluster.prefill_addrs[0]: "pdserve.v1.Prefill",
                cluster.decode_addrs[0]: "pdserve.v1.Decode"}
    for address, service in expected.items():
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
            reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in reply.list_services_response.service}
            assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_dead_peer_is_unavailable_fast(model_dir, tmp_path):
    """A request to a dead pool fails after --instance-wait, not at its deadline (before: a client without one
    waited the 600 s request timeout). The calls here have no deadline; the test waits for them 30× the
    instance wait (a bound on a hang, not a speed check); the details say what is down."""
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there (a port taken meanwhile would still refuse gRPC)
    port_file = tmp_path / "router.port"
    proc = subprocess.Popen([sys.executable, "-m", "router", "--model", str(model_dir), "--prefill", dead,
                             "--decode", dead, "--port", "0", "--port-file", str(port_file), "--insecure",
                             "--instance-wait", "2", "--request-timeout", "600"])
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        port = wait_port_file(port_file, 120, proc)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = generation_pb2.GenerateRequest(prompt_token_ids=[5, 6], sampling_params=greedy(2))
        calls = [pool.submit(lambda: list(stub.Generate(request))) for _ in range(2)]  # neither's wait frees the other
        for call in calls:
            err = call.exception(timeout=60)
            assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert "decode up: 0 of 1" in err.details()
    finally:
        proc.kill()  # ends a call still waiting, so the pool's threads end too
        proc.wait()
        pool.shutdown()


def test_metrics_endpoint(model_dir):
    """Decode's /metrics: its pool, its tokens, and the prompt blocks a follow-up reused from its prefix cache
    (20 tokens: 5 blocks of 4 pushed; then 25 tokens: those 5 reused, 2 pushed, a follow-up; then 20 tokens
    sharing only the first block: 1 reused, 4 pushed, not a follow-up)."""
    with Cluster(str(model_dir), **REFERENCE_NUMERICS, extra_decode=["--metrics-port", "0", "--block-size", "4"],
                 extra_prefill=["--block-size", "4", "--metrics-port", "0"]) as c:
        def scrape(addr: str) -> str:
            url = f"http://127.0.0.1:{c.metrics_ports[addr]}/metrics"
            return urllib.request.urlopen(url, timeout=5).read().decode()

        def pushed_bytes() -> float:
            return sum(float(line.split()[-1]) for line in scrape(c.prefill_addrs[0]).splitlines()
                       if line.startswith("pdserve_kv_push_bytes_total{"))

        first = list(range(5, 25))
        generate(c.address, prompt_token_ids=first, sampling_params=greedy(3))
        once = pushed_bytes()
        generate(c.address, prompt_token_ids=first + [30, 31, 32, 33, 34], sampling_params=greedy(3))
        assert pushed_bytes() - once == pytest.approx(once * 2 / 5)  # 2 blocks of the follow-up's 7 travel
        generate(c.address, prompt_token_ids=first[:4] + list(range(40, 56)), sampling_params=greedy(3))
        body = scrape(c.decode_addrs[0])  # the third shares one block (a "system prompt"): reuse, no follow-up
    assert 'pdserve_kv_blocks_free{rank="0",service="decode"}' in body
    assert 'pdserve_tokens_total{kind="output",service="decode"} 9.0' in body
    assert 'pdserve_decode_kv_blocks_total{source="reused"} 6.0' in body
    assert 'pdserve_decode_kv_blocks_total{source="pushed"} 11.0' in body
    assert 'pdserve_decode_follow_up_kv_blocks_total{source="pushed"} 2.0' in body  # the follow-up's alone
    assert 'pdserve_decode_follow_up_kv_blocks_total{source="reused"} 5.0' in body
    assert 'pdserve_prefix_cache_hit_tokens_total{service="decode",tier="device"} 24.0' in body


def test_two_by_two_instances_and_failover(model_dir, local_llm, tmp_path):
    """M=2 prefill, N=2 decode: requests spread over both decode instances; with one prefill and one
    decode instance killed, the router fails over to the live ones."""
    prompts = random_prompts(8, [5, 14, 23], 512, seed=33)
    want = [o.token_ids for o in local_llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                                            ignore_eos=True))]
    with Cluster(str(model_dir), num_prefill=2, num_decode=2, **REFERENCE_NUMERICS, log_dir=tmp_path / "logs",
                 extra_decode=["--block-size", "4"], extra_prefill=["--block-size", "4"]) as c:
        assert concurrent_greedy(c.address, prompts, 6) == want
        admitted = []
        for addr in c.decode_addrs:
            with c.channel(addr) as ch:
                load = internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5)
            admitted.append(sum(r.admitted for r in load.ranks))
        assert all(n > 0 for n in admitted), admitted
        # kill prefill 0 and decode 0 (the router's instance order: decodes first, then prefills)
        for proc in (c.procs[0], c.procs[2]):
            proc.kill()
            proc.wait(10)
        for i in range(4):
            assert tokens(generate(c.address, prompt_token_ids=prompts[i], sampling_params=greedy(6))) == want[i]


def test_deadline_frees_decode_blocks(cluster):
    initial = decode_load(cluster).total_blocks
    with pytest.raises(grpc.RpcError) as err:
        # the most the 512-token context takes, still decoding at a 0.4 s deadline (480 tokens came to finish
        # inside the 1.5 s this test used to give)
        generate(cluster.address, timeout=0.4, prompt_token_ids=[5, 6, 7], sampling_params=greedy(505))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: decode_load(cluster).free_blocks == initial)
    assert decode_load(cluster).running == 0 and decode_load(cluster).active_leases == 0
