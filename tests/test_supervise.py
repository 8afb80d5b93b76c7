"""`pdserve up`'s supervisor (router/supervise.py) on real processes, without a model: a service that exits is
started again at once, one that keeps exiting waits longer each time (up to --restart-backoff-max), one that stayed
up past --restart-stable-after is restarted at once again, every restart is counted, and a service drained away by
the autoscaler is not brought back. The whole cluster under faults: tests/test_migration.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from router.supervise import Supervisor, SupervisorConfig, describe_exit
from tests.helpers import wait_for


class Processes:
    """What the supervisor uses of router.cli.Cluster, over plain processes that exit with `code` after
    `life` seconds (a respawned one reports its port file at once)."""

    host = "127.0.0.1"

    def __init__(self, tmp: Path, life: float = 0.0, code: int = 3):
        self.tmp, self.life, self.code = tmp, life, code
        self.address, self.prefill_addrs, self.decode_addrs = "router:1", ["prefill:1"], ["decode:1"]
        self.metrics_ports: dict[str, int] = {}
        self.spawned: list[str] = []
        self.count = 0
        self.procs = {a: self._start(a) for a in (self.address, *self.prefill_addrs, *self.decode_addrs)}
        self.spawned.clear()

    def _start(self, address: str) -> subprocess.Popen:
        self.spawned.append(address)
        self.count += 1
        port_file = self.tmp / str(self.count) / "port"
        port_file.parent.mkdir()
        proc = subprocess.Popen([sys.executable, "-c", f"import pathlib, sys, time; pathlib.Path({str(port_file)!r})"
                                 f".write_text('1'); time.sleep({self.life}); sys.exit({self.code})"])
        proc.pdserve_port_file = port_file
        return proc

    def process(self, address: str) -> subprocess.Popen:
        return self.procs[address]

    def service_name(self, address: str) -> str:
        return address.split(":")[0] + "0" * (address != self.address)

    def respawn(self, address: str) -> subprocess.Popen:
        self.procs[address] = self._start(address)
        return self.procs[address]

    def listening_again(self, address: str, port_file: Path) -> None:
        self.metrics_ports[address] = 1


def wait_exits(c: Processes) -> None:
    for proc in c.procs.values():
        proc.wait(30)


def test_a_crash_loop_backs_off_then_a_stable_service_restarts_at_once(tmp_path, capsys):
    c = Processes(tmp_path)
    sup = Supervisor(c, SupervisorConfig(restart_backoff_max=4.0, restart_stable_after=60.0))
    wait_exits(c)
    sup.poll(now=0.0)  # every service exited: all restarted at once (their first exit)
    assert sorted(c.spawned) == ["decode:1", "prefill:1", "router:1"]
    waits = []
    for t in (10.0, 20.0, 30.0, 40.0, 50.0):  # the decode instance keeps exiting soon after each start
        wait_exits(c)
        c.spawned.clear()
        sup.poll(now=t)
        w = sup.watched["decode:1"]
        waits.append(w.restart_at - t)
        sup.poll(now=w.restart_at)
        assert "decode:1" in c.spawned
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
    wait_exits(c)
    c.spawned.clear()
    sup.poll(now=50.0 + 4.0 + 61.0)  # up longer than restart_stable_after: healthy again, restarted at once
    assert "decode:1" in c.spawned and sup.watched["decode:1"].quick_exits == 1
    assert sup.registry.get_sample_value("pdserve_up_restarts_total", {"service": "decode0", "pool": "decode"}) == 7
    err = capsys.readouterr().err
    assert "decode0 (decode:1) exited with code 3; restarting in 4 s" in err


def test_a_listening_service_is_noticed_and_a_drained_one_left_alone(tmp_path, capsys):
    c = Processes(tmp_path, life=30.0)
    sup = Supervisor(c)
    c.decode_addrs.clear()  # drained away by the autoscaler: no longer the cluster's
    c.procs["decode:1"].kill()
    c.procs["router:1"].kill()
    c.procs["router:1"].wait(10)
    sup.poll(now=0.0)
    assert c.spawned == ["router:1"]
    assert "router (router:1) killed by SIGKILL; restarting" in capsys.readouterr().err
    port_file = c.procs["router:1"].pdserve_port_file
    assert wait_for(port_file.exists, timeout=30)
    sup.poll(now=0.1)  # its port file is there: it listens again
    assert c.metrics_ports == {"router:1": 1} and sup.watched["router:1"].port_file is None
    assert sup.registry.get_sample_value("pdserve_up_service_running", {"service": "router", "pool": "router"}) == 1
    for proc in c.procs.values():
        proc.kill()


def test_exit_descriptions():
    assert describe_exit(-15) == "killed by SIGTERM" and describe_exit(0) == "exited with code 0"


def test_a_bad_restart_flag_is_refused_before_anything_starts():
    """Hostile input through the command: one line naming the flag, exit 2, no service started."""
    done = subprocess.run([sys.executable, "-m", "router.cli", "up", "--restart-backoff-max", "-1"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2 and "--restart-backoff-max: expected at least 0.0, got -1.0" in done.stderr
    assert "starting" not in done.stdout
