"""No request lost: through `pdserve up` with 2 prefill + 2 decode instances and 24 concurrent streams, a
decode instance SIGKILLed mid-stream, a decode instance SIGTERMed (it drains: its running requests move at
once), a prefill instance SIGKILLed mid-prefill: every stream completes whole and equal to the unfaulted
run (greedy and seeded sampling), and the survivors hold no KV block or lease afterwards. A router started
before its instances is not SERVING and holds requests until they come."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.cli import up_cluster
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.helpers import random_prompts, wait_for

DEMO = "models/demo-v32"
STREAMS, TOKENS = 24, 64
PROMPTS = random_prompts(STREAMS, [40, 70, 25], 4000, seed=3)


def requests() -> list[generation_pb2.GenerateRequest]:
    """20 greedy streams and 4 seeded sampled ones."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        sp = generation_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        if i % 6 == 5:
            sp = generation_pb2.SamplingParams(max_tokens=TOKENS, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
        out.append(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=sp))
    return out


def run(address: str, fault=None, after_tokens: int = 0) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Every request at once, one thread each; `fault()` once `after_tokens` tokens have streamed in all.
    → (tokens per whole stream, error per failed one)."""
    got, errors, streamed, lock = {}, {}, [0], threading.Lock()

    def one(i: int, req: generation_pb2.GenerateRequest) -> None:
        tokens: list[int] = []
        try:
            with grpc.insecure_channel(address) as ch:
                for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=240):
                    tokens += msg.token_ids
                    with lock:
                        streamed[0] += len(msg.token_ids)
            got[i] = tokens
        except grpc.RpcError as exc:
            errors[i] = f"{exc.code().name}: {exc.details()}"

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(requests())]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while streamed[0] < after_tokens and time.monotonic() < deadline:
            time.sleep(0.002)
        fault()
    for t in threads:
        t.join(300)
    return got, errors


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = up_cluster(["--model", DEMO, "--port", "0", "--num-prefill", "2", "--num-decode", "2"],
                   log_dir=tmp_path_factory.mktemp("migration-logs"))
    c.extra_router += ["--metrics-port", "0"]
    with c:
        yield c


@pytest.fixture(scope="module")
def unfaulted(cluster) -> dict[int, list[int]]:
    got, errors = run(cluster.address)
    assert not errors and len(got) == STREAMS and all(len(t) == TOKENS for t in got.values())
    return got


def load(cluster, address: str, kind: str):
    with cluster.channel(address) as ch:
        stub = (internal_pb2_grpc.DecodeStub if kind == "decode" else internal_pb2_grpc.PrefillStub)(ch)
        return stub.GetLoad(internal_pb2.LoadRequest(), timeout=5)


def assert_nothing_held(cluster, survivors: list[str]) -> None:
    """Every KV block back and no lease or request left on the instances that stayed up."""
    for address in survivors:
        kind = "decode" if address in cluster.decode_addrs else "prefill"
        assert wait_for(lambda a=address, k=kind: (lambda x: x.free_blocks == x.total_blocks and x.running == 0
                                                   and x.active_leases == 0)(load(cluster, a, k)), timeout=30), address


def router_metric(cluster, prefix: str) -> float:
    """The sum of the router's samples whose line starts with `prefix`."""
    port = cluster.metrics_ports[cluster.address]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def fault_case(cluster, unfaulted, victim: str, fault, after_tokens: int) -> None:
    """The fault hits while requests run on the victim; every stream is still whole and equal to the
    unfaulted run, the survivors hold nothing, and the victim, restarted, takes requests again."""
    pool = "decode" if victim in cluster.decode_addrs else "prefill"
    assert wait_for(lambda: router_metric(cluster, f'pdserve_router_instance_placeable{{instance="{victim}",'
                                                   f'pool="{pool}"}}') == 1, timeout=30)
    moved = router_metric(cluster, "pdserve_router_migrations_total") + router_metric(
        cluster, "pdserve_router_failovers_total")
    got, errors = run(cluster.address, fault, after_tokens)
    assert not errors, errors
    assert got == unfaulted  # whole, nothing repeated or missed, greedy and seeded sampling alike
    assert router_metric(cluster, "pdserve_router_migrations_total") + router_metric(
        cluster, "pdserve_router_failovers_total") > moved  # the fault did hit requests
    assert_nothing_held(cluster, [a for a in cluster.prefill_addrs + cluster.decode_addrs if a != victim])
    cluster.restart(victim)


def test_decode_killed_mid_stream(cluster, unfaulted):
    victim = cluster.decode_addrs[0]
    fault_case(cluster, unfaulted, victim, lambda: cluster.process(victim).kill(), STREAMS * TOKENS // 3)


def test_decode_sigterm_drains_at_once(cluster, unfaulted):
    """SIGTERM: the instance admits nothing more, hands its running requests back at once (they go on
    elsewhere) and exits long before its streams would have ended."""
    victim = cluster.decode_addrs[0]
    stopped: list[float] = []

    def term() -> None:  # once the victim runs streams: SIGTERM must hand them back (counted as "drain")
        wait_for(lambda: load(cluster, victim, "decode").running > 0, timeout=10)
        proc = cluster.process(victim)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        stopped.append(time.monotonic() - t)

    fault_case(cluster, unfaulted, victim, term, STREAMS * TOKENS // 3)
    assert stopped and stopped[0] < 15


def test_prefill_killed_mid_prefill(cluster, unfaulted):
    victim = cluster.prefill_addrs[0]
    fault_case(cluster, unfaulted, victim, lambda: cluster.process(victim).kill(), 1)


def test_migrations_are_counted_by_cause(cluster):
    port = cluster.metrics_ports[cluster.address]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counted = {line.split('cause="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("pdserve_router_migrations_total{") and not line.endswith(" 0.0")}
    assert "drain" in counted and counted & {"unavailable", "kv_transfer"}
    assert "pdserve_router_migration_pause_seconds_count" in text


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
            t = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7]), timeout=2.0))
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert time.monotonic() - t >= 1.0  # it waited for an instance
    finally:
        proc.kill()
        proc.wait(10)
