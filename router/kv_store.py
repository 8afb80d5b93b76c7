"""`pdserve up --kv-store-master auto`: a Mooncake Store master for this start (the services' second tiers
keep their records in the store it coordinates; shared.transfer.mooncake_store). On a cluster the master is
its own Deployment (the chart's `engine.kvStoreMaster` names it); here it is a child of `pdserve up`, on
free loopback ports, stopped with it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from router.cluster import free_port

AUTO = "auto"
START_TIMEOUT_S = 30.0


def master_binary() -> str:
    """The mooncake_master the Mooncake wheel installs beside this interpreter (else on PATH)."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.is_file() else shutil.which("mooncake_master")
    if not found:
        raise ValueError("--kv-store-master auto: mooncake_master not found (pip install "
                         "mooncake-transfer-engine-non-cuda; `make` installs it)")
    return found


@dataclass
class StoreMaster:
    """A running mooncake_master and the HOST:PORT its clients give as --kv-store-master."""

    proc: subprocess.Popen
    address: str

    @classmethod
    def start(cls, log_dir: Path | None = None) -> StoreMaster:
        port = free_port()  # mooncake_master takes its ports as flags: it cannot report one it chose
        argv = [master_binary(), f"-rpc_port={port}", f"-metrics_port={free_port()}", "-rpc_address=127.0.0.1",
                "-metrics_host=127.0.0.1"]
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
            with open(log_dir / "kv-store-master.log", "wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        master = cls(proc, f"127.0.0.1:{port}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ValueError(f"--kv-store-master auto: mooncake_master exited ({proc.returncode})")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return master
            except OSError:
                time.sleep(0.1)
        master.stop()
        raise ValueError(f"--kv-store-master auto: mooncake_master did not listen within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
