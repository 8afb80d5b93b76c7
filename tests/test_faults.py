"""Fault matrix (issue: reliability): SIGKILL / SIGSTOP of decode, prefill and router while requests
are in flight, and a KV proxy that stalls or drops the stream, with migration off (`--migration-limit 0`:
the behaviour a request has once its migrations are spent; tests/test_migration.py covers the requests
that survive by moving). In every case the client gets an error (UNAVAILABLE) instead of a hang, the
decode pool's blocks and leases return to baseline, and a restarted (or resumed) instance serves again.

Every wait is bounded and fails on a hang; the time to error is recorded and printed (run with -s),
never asserted: how fast the system reacts is a measurement, not a test.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from router.cluster import Cluster
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.transfer.tcp import split_endpoint
from tests.helpers import child_processes, wait_for
from tests.kv_proxy import KVProxy

TIME_TO_ERROR: dict[str, float] = {}
LONG = generation_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(served_model, tmp_path_factory):
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path_factory.mktemp("fault-logs"),
                 extra_decode=["--lease-seconds", "10"], extra_router=["--migration-limit", "0"]) as c:
        yield c
    print("\ntime to error per fault (s):", {k: round(v, 2) for k, v in TIME_TO_ERROR.items()})


def _load(c: Cluster) -> internal_pb2.LoadReport:
    with c.channel(c.decode_addrs[0]) as ch:
        return internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5)


def _baseline(c: Cluster) -> None:
    """Every block free and no lease: nothing leaked (bounded wait for cleanup to land)."""
    def clean() -> bool:
        load = _load(c)
        return load.free_blocks == load.total_blocks and load.active_leases == 0 and load.running == 0

    assert wait_for(clean, timeout=40), f"decode pool not back to baseline: {_load(c)}"


def _works(c: Cluster) -> None:
    """The cluster serves again: a restarted instance is found once the router's reconnect back-off
    (at most 2 s) has passed, so the first tries may still be refused (a bounded wait)."""
    def once() -> bool:
        try:
            with c.channel(c.address) as ch:
                msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], sampling_params=generation_pb2.SamplingParams(
                        max_tokens=3, temperature=0.0, ignore_eos=True)), timeout=60))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return False
        return sum(len(m.token_ids) for m in msgs) == 3

    assert wait_for(once, timeout=30), "the cluster did not serve again"


def _fault_mid_stream(c: Cluster, fault) -> tuple[grpc.RpcError, float, int]:
    """Stream a long request; after a few tokens apply `fault()`; return the error, the seconds from
    the fault to the error, and the tokens received."""
    with c.channel(c.address) as ch:
        stream = generation_pb2_grpc.GenerationStub(ch).Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=[9, 8, 7, 6], sampling_params=LONG), timeout=60)
        n, t_fault = 0, None
        with pytest.raises(grpc.RpcError) as err:
            for msg in stream:
                n += len(msg.token_ids)
                if n >= 5 and t_fault is None:
                    fault()
                    t_fault = time.monotonic()
        assert t_fault is not None, f"failed before the fault after {n} tokens: {err.value}"
        return err.value, time.monotonic() - t_fault, n


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_decode_dies_or_freezes_mid_stream(cluster, sig):
    _baseline(cluster)
    decode = cluster.process(cluster.decode_addrs[0])
    err, seconds, n = _fault_mid_stream(cluster, lambda: os.kill(decode.pid, getattr(signal, sig)))
    TIME_TO_ERROR[f"decode {sig} mid-stream"] = seconds
    assert err.code() == grpc.StatusCode.UNAVAILABLE and 5 <= n < 400
    if sig == "SIGSTOP":  # resumed: it learns the stream is gone and frees what it held
        os.kill(decode.pid, signal.SIGCONT)
    else:
        cluster.restart(cluster.decode_addrs[0])
    _baseline(cluster)
    _works(cluster)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_prefill_dies_or_freezes_with_a_request_in_flight(cluster, sig):
    _baseline(cluster)
    prefill = cluster.process(cluster.prefill_addrs[0])
    os.kill(prefill.pid, getattr(signal, sig))
    t0 = time.monotonic()
    with cluster.channel(cluster.address) as ch, pytest.raises(grpc.RpcError) as err:
        list(generation_pb2_grpc.GenerationStub(ch).Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=list(range(3, 100)), sampling_params=LONG), timeout=60))
    TIME_TO_ERROR[f"prefill {sig} in flight"] = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    _baseline(cluster)  # the router released the reservation
    if sig == "SIGSTOP":
        os.kill(prefill.pid, signal.SIGCONT)
    else:
        cluster.restart(cluster.prefill_addrs[0])
    _works(cluster)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_router_dies_or_freezes_mid_stream(cluster, sig):
    """The client sees the router go (its own keepalive); decode frees the orphaned stream."""
    _baseline(cluster)
    router = cluster.process(cluster.address)
    err, seconds, _ = _fault_mid_stream(cluster, lambda: os.kill(router.pid, getattr(signal, sig)))
    TIME_TO_ERROR[f"router {sig} mid-stream (client)"] = seconds
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    t0 = time.monotonic()
    _baseline(cluster)
    TIME_TO_ERROR[f"router {sig}: decode freed the stream"] = time.monotonic() - t0
    if sig == "SIGSTOP":
        os.kill(router.pid, signal.SIGCONT)
    else:
        cluster.restart(cluster.address)
    _works(cluster)


def test_kv_proxy_stalls_or_drops_the_push(served_model, tmp_path):
    """Decode advertises its KV port on 127.0.0.2 (a loopback alias), where the proxy sits."""
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs",
                 extra_decode=["--advertise-host", "127.0.0.2", "--lease-seconds", "10"]) as c:
        _proxy_cases(c)


def _proxy_cases(cluster: Cluster) -> None:
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)
        dest = stub.Reserve(internal_pb2.ReserveRequest(request_id="probe", num_prompt_tokens=4, max_tokens=4),
                            timeout=10).destination
        stub.Release(internal_pb2.ReleaseRequest(lease_id=dest.lease_id), timeout=10)
    host, port = split_endpoint(dest.endpoint)
    assert host == "127.0.0.2"  # --advertise-host is what prefill is told
    proxy = KVProxy(port)
    try:
        _works(cluster)  # forwarding: the push goes through the proxy
        for mode in ("stall", "drop"):
            proxy.mode = mode
            t0 = time.monotonic()
            with cluster.channel(cluster.address) as ch, pytest.raises(grpc.RpcError) as err:
                list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=list(range(3, 100)), sampling_params=LONG), timeout=60))
            TIME_TO_ERROR[f"KV proxy {mode}s the push"] = time.monotonic() - t0
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, mode
            assert "KV" in err.value.details()
            _baseline(cluster)
        proxy.mode = "forward"
        _works(cluster)
    finally:
        proxy.close()


def _engine_core_pid(front_pid: int) -> int:
    """The engine-core child of a service's front process (one rank: its only child)."""
    children = child_processes(front_pid)
    assert len(children) == 1, f"{front_pid} has children {children}, not one engine core"
    return children[0]


@pytest.mark.parametrize("service", ["prefill_service", "decode_service"])
def test_engine_core_process_death_takes_the_instance_down(served_model, tmp_path, service):
    """The engine loop runs in its own process; if it dies the front reports NOT_SERVING and exits
    non-zero (70), so the orchestrator restarts the instance instead of it accepting work it cannot do."""
    import subprocess
    import sys

    from router.cluster import wait_port_file, wait_serving

    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", service, "--model", str(served_model), "--dtype", "float32",
                                 "--port", "0", "--port-file", str(tmp_path / "port"), "--insecure"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        port = wait_port_file(tmp_path / "port", 120, proc)
        wait_serving(f"127.0.0.1:{port}", timeout=60, proc=proc)
        os.kill(_engine_core_pid(proc.pid), signal.SIGKILL)
        t0 = time.monotonic()
        assert proc.wait(30) == 70
        TIME_TO_ERROR[f"{service} engine core killed → exit"] = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "engine core" in (tmp_path / "log").read_text()
