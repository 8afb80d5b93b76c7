"""Parallel instances end to end: a CP prefill instance beside a DP/EP decode instance, torchrun-style ranks
forming one decode instance, TP prefill and decode instances (real processes, gloo, fp32)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc

from router.cluster import Cluster, free_port, wait_port_file, wait_serving
from shared.engine import LLM, SamplingParams
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from tests.helpers import concurrent_greedy, random_prompts, wait_for

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_cluster_cp2_prefill_dp2_ep2_decode(ckpt, tmp_path):
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(6, [3, 17, 40, 1, 26, 9], 512, seed=65)
    follow_ups = [p + [7] * 9 for p in prompts]  # next turns: decode starts them on the blocks it kept
    want = [o.token_ids for o in LLM(path, block_size=4).generate(prompts + follow_ups, GREEDY)]
    with Cluster(path, dtype="float32", log_dir=tmp_path / "logs",
                 extra_prefill=["--cp", "2", "--ep", "2", "--block-size", "4", "--max-prefill-tokens", "16"],
                 extra_decode=["--dp", "2", "--ep", "2", "--block-size", "4"]) as cluster:
        got = concurrent_greedy(cluster.address, prompts, 8)
        got += concurrent_greedy(cluster.address, follow_ups, 8)
        with cluster.channel(cluster.decode_addrs[0]) as ch:
            dec = internal_pb2_grpc.DecodeStub(ch)
            for follow in follow_ups[1:3]:  # placed on the DP rank that kept the turn, whichever it was
                probe = dec.Reserve(internal_pb2.ReserveRequest(request_id="probe", num_prompt_tokens=len(follow),
                                                                max_tokens=4, prompt_token_ids=follow), timeout=30)
                assert probe.destination.reused_blocks == (len(follow) - 1) // 4
                assert dec.Release(internal_pb2.ReleaseRequest(lease_id=probe.destination.lease_id),
                                   timeout=10).released

            def settled() -> internal_pb2.LoadReport | None:  # a release shows in the next turn's report
                load = dec.GetLoad(internal_pb2.LoadRequest(), timeout=10)
                return load if all(r.free_blocks == r.total_blocks for r in load.ranks) else None

            assert wait_for(settled, 10)
            load = settled()
    assert got == want
    assert len(load.ranks) == 2 and all(r.free_blocks == r.total_blocks for r in load.ranks)
    assert all(r.admitted > 0 for r in load.ranks)  # concurrent requests spread over both DP ranks


def test_torchrun_style_ranks_form_one_decode_instance(ckpt, tmp_path):
    """Ranks started separately with MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE (as on several
    nodes) form one dp=2 decode instance; rank 0 serves gRPC and reports both ranks; the follower
    serves a health endpoint for its pod's probes."""
    master = free_port()  # torch.distributed's rendezvous port: chosen by the launcher, as torchrun does
    procs = []
    try:
        for rank in (1, 0):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "RANK": str(rank),
                   "WORLD_SIZE": "2"}
            log = open(tmp_path / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "decode_service", "--model", str(ckpt("v32_sparse")), "--port", "0",
                 "--port-file", str(tmp_path / f"rank{rank}.port"), "--dp", "2", "--ep", "2", "--block-size", "4",
                 "--insecure"], env=env, stdout=log, stderr=subprocess.STDOUT))
        follower_port = wait_port_file(tmp_path / "rank1.port", 120, procs[0])
        port = wait_port_file(tmp_path / "rank0.port", 120, procs[1])
        wait_serving(f"127.0.0.1:{port}", timeout=120, proc=procs[1])
        wait_serving(f"127.0.0.1:{follower_port}", timeout=30, proc=procs[0])  # the follower pod's probe
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = internal_pb2_grpc.DecodeStub(ch)
            leases = [stub.Reserve(internal_pb2.ReserveRequest(request_id=f"r{i}", num_prompt_tokens=8, max_tokens=8),
                                   timeout=30) for i in range(2)]
            assert {r.dp_rank for r in leases} == {0, 1}  # the second reservation goes to the other rank
            load = stub.GetLoad(internal_pb2.LoadRequest(), timeout=10)
            assert [r.rank for r in load.ranks] == [0, 1]
            for r in leases:
                assert stub.Release(internal_pb2.ReleaseRequest(lease_id=r.destination.lease_id), timeout=30).released
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def test_cluster_tp2_prefill_and_decode(ckpt, tmp_path):
    """Local TP (o_proj / lm_head / embedding sharded over 2 ranks) in a prefill and a decode
    instance: same greedy tokens; the decode mirror ranks free every block, expiry included."""
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(4, [5, 33, 12, 20], 512, seed=66)
    follow_ups = [p + [7] * 9 for p in prompts]  # next turns: every mirror rank starts them on the blocks it kept
    want = [o.token_ids for o in LLM(path, block_size=4).generate(prompts + follow_ups, GREEDY)]
    with Cluster(path, dtype="float32", log_dir=tmp_path / "logs", extra_prefill=["--tp", "2", "--block-size", "4"],
                 extra_decode=["--tp", "2", "--block-size", "4", "--lease-seconds", "2"]) as cluster:
        got = concurrent_greedy(cluster.address, prompts, 8)
        got += concurrent_greedy(cluster.address, follow_ups, 8)
        with cluster.channel(cluster.decode_addrs[0]) as ch:
            dec = internal_pb2_grpc.DecodeStub(ch)
            probe = dec.Reserve(internal_pb2.ReserveRequest(request_id="probe", num_prompt_tokens=len(follow_ups[1]),
                                                            max_tokens=4, prompt_token_ids=follow_ups[1]), timeout=30)
            assert probe.destination.reused_blocks == (33 + 9 - 1) // 4  # the follow-up's blocks, kept (but its last)
            assert dec.Release(internal_pb2.ReleaseRequest(lease_id=probe.destination.lease_id), timeout=10).released
            dec.Reserve(internal_pb2.ReserveRequest(request_id="unused", num_prompt_tokens=8, max_tokens=8), timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                load = dec.GetLoad(internal_pb2.LoadRequest(), timeout=10)
                if load.active_leases == 0 and all(r.free_blocks == r.total_blocks for r in load.ranks):
                    break
                time.sleep(0.2)
    assert got == want
    assert len(load.ranks) == 2 and all(r.free_blocks == r.total_blocks for r in load.ranks)
    assert load.active_leases == 0
