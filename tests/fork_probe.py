"""Run by tests/test_fork_server.py as `python -m tests.fork_probe OUT`: writes what a started process sees
(argv, working directory, session, parent, one environment variable, its title) to OUT as JSON, prints a
line to its log, and exits with code 7 (with --wait: waits for a signal first)."""

import json
import os
import signal
import sys
from pathlib import Path

from shared.rpc.service import die_with_launcher

die_with_launcher()  # as a service does
print("probe started", flush=True)
Path(sys.argv[1]).write_text(json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "leads_session": os.getsid(0) == os.getpid(), "ppid": os.getppid(),
    "mark": os.environ.get("PDSERVE_PROBE_MARK"), "main": __name__,
    "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()}))
if "--wait" in sys.argv:
    signal.pause()
sys.exit(7)
