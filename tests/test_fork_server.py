"""The fork server (shared.rpc.forkserver): `pdserve up` forks its prefill and decode fronts from one process that
imported torch and the services once, instead of starting a new interpreter for each (and for each restart). A
forked front is what `python -m SERVICE` would have been: its argv, title, session, log and environment; a child
whose import-time environment differs starts anew; a server that dies takes its children with it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from bench.fleet_faults import UpProcess
from router.cli import up_cluster
from shared.rpc.forkserver import ForkedProcess, ForkServer
from shared.rpc.service import LAUNCHER_ENV
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _server(extra_preload: tuple[str, ...] = ()) -> ForkServer:
    return ForkServer(["json", *extra_preload], {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_ENV: str(os.getpid())},
                      cwd=str(ROOT))


@pytest.fixture(scope="module")
def server():
    s = _server()
    yield s
    s.close()


def test_a_forked_child_is_what_python_m_would_have_started(server, tmp_path):
    out, log = tmp_path / "probe.json", tmp_path / "probe.log"
    env = {**server.env, "PDSERVE_PROBE_MARK": "given at the spawn"}  # read at run time: the child gets it
    proc = server.spawn("tests.fork_probe", [str(out)], env, str(log))
    assert isinstance(proc, ForkedProcess)
    assert proc.wait(60) == 7 and proc.poll() == 7
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(out)] and seen["cwd"] == str(ROOT) and seen["main"] == "__main__"
    assert seen["leads_session"] and seen["mark"] == "given at the spawn"
    assert seen["ppid"] == server.pid != os.getpid()
    assert "-m tests.fork_probe" in seen["cmdline"]  # what `ps` shows: the service, not the server
    assert "probe started" in log.read_text()


def test_an_import_time_environment_or_another_directory_starts_anew(server):
    assert server.can_fork({**server.env, "PDSERVE_POISON": "1:decode"}, server.cwd)
    for name, value in (("OMP_NUM_THREADS", "7"), ("PYTHONHASHSEED", "1"), ("TORCH_SHOW_CPP_STACKTRACES", "1")):
        assert not server.can_fork({**server.env, name: value}, server.cwd), name
        assert server.spawn("tests.fork_probe", ["unused"], {**server.env, name: value}, None) is None
    assert not server.can_fork(server.env, "/")


def test_hostile_a_missing_module_exits_1_naming_it(server, tmp_path):
    log = tmp_path / "log"
    proc = server.spawn("no_such_module_at_all", [], server.env, str(log))
    assert proc is not None and proc.wait(30) == 1
    assert "No module named no_such_module_at_all" in log.read_text()
    proc = server.spawn("tests.fork_probe", [str(tmp_path / "ok.json")], server.env, None)  # the server still serves
    assert proc is not None and proc.wait(60) == 7


def test_a_killed_server_takes_its_children_and_later_starts_fall_back(tmp_path):
    s = _server()
    proc = s.spawn("tests.fork_probe", [str(tmp_path / "p.json"), "--wait"], s.env, None)
    assert proc is not None and wait_for(lambda: (tmp_path / "p.json").exists(), timeout=30)
    os.kill(s.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGTERM  # its parent-death signal
    assert wait_for(lambda: _gone(proc.pid), timeout=30)
    assert s.spawn("tests.fork_probe", ["unused"], s.env, None) is None  # the launcher starts interpreters again


def test_pdserve_up_forks_its_services_and_restarts_a_killed_decode_from_the_server(tmp_path):
    """Through the command, as a user runs it: both fronts are children of one fork server, a SIGKILLed decode
    comes back from it (the supervisor's restart) and serves the same greedy text; Ctrl-C leaves nothing."""
    up = UpProcess(["--model", "models/tiny-v32", "--port", "0", "--http-port", "0"], tmp_path).start()
    pids: list[int] = []
    try:
        client = openai.OpenAI(base_url=up.http_url, api_key="none", max_retries=0, timeout=60)

        def complete() -> str:
            return client.completions.create(model=up.model, prompt="In the beginning", max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        first = complete()
        decode, prefill = up.service_pid("decode0"), up.service_pid("prefill0")
        server = _parent(decode)
        assert server == _parent(prefill) != up.proc.pid and _parent(server) == up.proc.pid
        assert b"shared.parallel.fork_services" in Path(f"/proc/{server}/cmdline").read_bytes()
        assert b"-m decode_service" in Path(f"/proc/{decode}/cmdline").read_bytes().replace(b"\0", b" ")
        restarts = up.metric("up", "pdserve_up_restarts_total")
        os.kill(decode, signal.SIGKILL)
        assert wait_for(lambda: up.metric("up", "pdserve_up_restarts_total") == restarts + 1, timeout=60)
        again = _until_served(complete)
        assert again == first
        restarted = up.service_pid("decode0")
        assert restarted != decode and _parent(restarted) == server
        pids = [server, restarted, prefill]
    finally:
        assert up.stop() == 0, up.output()
    assert all(wait_for(lambda p=p: _gone(p), timeout=30) for p in pids)


def _until_served(call, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_no_fork_server_starts_every_front_anew():
    assert up_cluster([]).fork_services and not up_cluster(["--no-fork-server"]).fork_services
