"""The seams of issue 45's engine part, without a model: a request is checked once per service by
`RequestLimits.check_request` (its front's), a finish reason travels as the enum inside a service and as
its wire word on the proto, a decode rank's report carries the one RankLoad type, a front reaches an
in-process core as it reaches a core process, and a core process (forked or spawned) sees its front leave."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

import shared.engine.process
from decode_service.worker import FINISH_CODES, DecodeRankReport
from shared.device import accelerator, process_start_method, rank_start_method
from shared.engine.process import CoreProcess, InProcessLink, Ready
from shared.parallel.launch import run_ranks
from shared.protocol.finish import FinishReason, wire
from shared.protocol.limits import RequestLimits
from shared.protocol.load import RankLoad
from shared.protocol.sampling import SamplingParams

LIMITS = RequestLimits(context_tokens=64, vocab_size=100, block_size=4, kv_blocks=8)


@pytest.mark.parametrize("prompt,params,resumed,field", [
    ([], SamplingParams(max_tokens=4), 0, "prompt_token_ids"),
    ([1, 100], SamplingParams(max_tokens=4), 0, "prompt_token_ids"),
    ([1, 2], SamplingParams(max_tokens=4), 2, "num_resumed"),
    ([1] * 30, SamplingParams(max_tokens=30), 0, "max_tokens"),  # 60 tokens: 15 blocks of a pool of 8
    ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[100]), 0, "stop_token_ids"),
    ([1, 2], SamplingParams(max_tokens=4, logit_bias={-1: 1.0}), 0, "logit_bias"),
])
def test_check_request_names_the_field(prompt, params, resumed, field):
    with pytest.raises(ValueError, match=field):
        LIMITS.check_request(prompt, params, resumed)


def test_a_speculative_engine_refuses_what_needs_an_exact_history():
    params = SamplingParams(max_tokens=4, logprobs=1)
    LIMITS.check_request([1, 2], params)
    with pytest.raises(ValueError, match="--speculative mtp"):
        RequestLimits(64, 100, 4, 8, speculative=True).check_request([1, 2], params)


def test_finish_reasons_travel_as_the_enum_and_leave_as_their_word():
    assert FINISH_CODES[0] is None and set(FINISH_CODES[1:]) == set(FinishReason)
    assert [wire(r) for r in FINISH_CODES] == ["", "stop", "length", "abort", "error"]
    assert all(FinishReason.from_wire(wire(r)) is r for r in FINISH_CODES)


def test_a_decode_rank_report_round_trips_its_row():
    report = DecodeRankReport(RankLoad(2, running=3, waiting=1, free_blocks=5, total_blocks=9, active_leases=1,
                                       tokens=40, admitted=7, queued_prompt_tokens=6),
                              has_work=1, applied_cid=12, kv_bytes_received=999,
                              spec_drafted=[4] + [0] * (len(DecodeRankReport(RankLoad(0)).spec_drafted) - 1))
    back = DecodeRankReport.from_row(report.to_row(), ["lease"])
    assert back.load == report.load and back.expired == ["lease"]
    assert (back.has_work, back.applied_cid, back.kv_bytes_received, back.spec_drafted) == (1, 12, 999,
                                                                                          report.spec_drafted)
    gauges = report.gauges()  # the names /metrics exports
    assert {"rank", "running", "tokens", "free_blocks", "total_blocks", "active_leases", "kv_bytes_received",
            "spec_drafted_0", "spec_accepted_0"} <= set(gauges)


class _Core:
    """A core as an in-process link sees it: typed commands in, a fatal handler."""

    def __init__(self):
        self.fatal, self.stopped = None, False

    def handle(self, command):
        if isinstance(command, int):
            return command + 1
        if isinstance(command, Future):
            return command
        raise ValueError(f"not a command: {command!r}")

    def set_fatal_handler(self, handler):
        self.fatal = handler

    def stop(self):
        self.stopped = True


def test_an_in_process_link_answers_as_a_core_process_does():
    core, seen = _Core(), []
    link = InProcessLink(core)
    link.listen(seen.append, on_lost=lambda reason: seen.append(f"lost: {reason}"))
    link.set_fatal_handler(lambda reason: seen.append(f"fatal: {reason}"))
    assert link.call(1).result(0) == 2
    pending: Future = Future()
    assert link.call(pending) is pending
    with pytest.raises(ValueError, match="not a command"):
        link.call("x").result(0)  # a refusal reaches the caller through its Future, as over a pipe
    link.notify("notice")
    core.fatal("loop died")  # the front fails what it holds, then goes NOT_SERVING
    assert seen == ["notice", "lost: loop died", "fatal: loop died"]
    link.stop()
    assert core.stopped


def test_a_steps_events_cross_the_process_link_whole():
    """EventsNotice pickles as columns (one object per event cost ~1.5 µs each way): every field of every kind of
    event comes back equal, logprobs, prompt logprobs and errors at their positions."""
    import pickle

    from decode_service.engine import EventsNotice
    from decode_service.worker import Event
    from shared.protocol.finish import FinishReason
    from shared.protocol.sampling import TokenLogprob

    lp = TokenLogprob(7, -0.25, [7, 3], [-0.25, -1.5])
    events = [Event("a", 5, False, None), Event("b", 9, True, FinishReason.LENGTH, logprob=lp),
              Event("c", -1, True, FinishReason.ERROR, "request fault: boom"),
              Event("d", 4, False, None, prompt_logprobs=[lp, TokenLogprob(1, -2.0)]),
              Event("e", 0, True, FinishReason.STOP)]
    for notice in (EventsNotice(events), EventsNotice([])):
        assert pickle.loads(pickle.dumps(notice, protocol=pickle.HIGHEST_PROTOCOL)) == notice


FRESH_PROCESS = """
import torch
from shared.device import accelerator, process_start_method as method
before = method()
torch.set_num_threads(2)
torch.randn(256, 256) @ torch.randn(256, 256)
print(before, method(), method(child_threads=1), accelerator() is None)
"""


def _core_until_eof(cfg: str, conn) -> None:
    """A core that reports ready, then reads its pipe until the front's end closes; writes `cfg` (a path) then."""
    conn.send(Ready(facts=os.getpid()))
    try:
        while True:
            conn.recv()
    except EOFError:
        Path(cfg).write_text("front gone")


def test_a_core_process_starts_from_the_fronts_imports_and_sees_the_front_leave(tmp_path, monkeypatch):
    """On a host without an accelerator a front running one thread forks its core (no second torch import);
    with another thread or an OpenMP pool running it spawns it (a lock that thread holds, or the pool, would not
    survive a fork). A forked core
    closes its copy of the front's end of the pipe, so it reads EOF when the front's end closes (otherwise a front
    that left would leave its core waiting)."""
    fresh = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=60,
                           check=True, cwd=Path(__file__).parents[1])
    # an OpenMP pool once started: spawn, unless the child runs one thread
    assert fresh.stdout.split() in (["fork", "spawn", "fork", "True"], ["spawn", "spawn", "spawn", "False"])
    monkeypatch.setattr(shared.engine.process, "process_start_method", lambda: "fork")
    marker = tmp_path / "eof"
    core = CoreProcess(_core_until_eof, str(marker), "test core", start_timeout=60)
    assert core.facts == core.proc.pid
    core._conn.close()  # the front's end, as when the front process exits
    core.proc.join(30)
    assert core.proc.exitcode == 0 and marker.read_text() == "front gone"
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert process_start_method() == "spawn"
    finally:
        stop.set()
        other.join()


def _parent(rank: int, world: int) -> tuple[int, int, str | None]:
    return rank, os.getppid(), os.environ.get("PDSERVE_TEST_RANK_MARK")


@pytest.mark.skipif(accelerator() is not None, reason="ranks are spawned where an accelerator is reachable")
def test_ranks_of_a_process_with_other_threads_fork_from_a_clean_server(monkeypatch):
    """A test process that ran a server or a gRPC poller has other threads, so its gloo ranks cannot fork from it;
    they fork from multiprocessing's fork server instead (it imported torch and the engine once), never spawned
    (each importing torch again): the ranks' parent is that server, not this process. They run in this process's
    environment as it is at the call, not as it was when the server started."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert process_start_method(child_threads=1) == "spawn" and rank_start_method(1) == "forkserver"
        monkeypatch.setenv("PDSERVE_TEST_RANK_MARK", "first")
        first = run_ranks(_parent, 2, timeout=120)
        monkeypatch.setenv("PDSERVE_TEST_RANK_MARK", "second")
        second = run_ranks(_parent, 2, timeout=120)
    finally:
        stop.set()
        other.join()
    assert [rank for rank, _, _ in first + second] == [0, 1, 0, 1]
    parents = {parent for _, parent, _ in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # all forked by the one server, not spawned here
    assert [mark for _, _, mark in first + second] == ["first", "first", "second", "second"]
