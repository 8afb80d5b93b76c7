"""The fork server's process (the launcher's side and the protocol: shared.rpc.forkserver): it imports the modules it
is given (torch and the services) once, then forks a child per SpawnRequest, reports each child's pid and exit
status, and exits when the launcher closes its end or dies. A forked child returns out of `serve` and becomes
`python -m MODULE ARGS` in `become`, then leaves through the interpreter's normal exit."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import selectors
import signal
import sys
from dataclasses import asdict

import setproctitle

from shared.device import process_start_method
from shared.rpc.forkserver import Reply, ReplyKind, SpawnRequest
from shared.rpc.service import die_with_launcher


def _say(reply: Reply) -> None:
    os.write(1, (json.dumps(asdict(reply)) + "\n").encode())  # unbuffered: a child inherits no pending output


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(Reply(ReplyKind.EXITED, pid=pid, code=os.waitstatus_to_exitcode(status)))


def serve(preload: list[str]) -> SpawnRequest | None:
    """Import `preload`, then fork a child per request and report its exit. Returns in a child only (its request);
    None in the server once the launcher is gone or where forking is unsafe."""
    die_with_launcher()  # the launcher's keeper thread: this server dies with it, then its children with this
    for name in preload:
        importlib.import_module(name)
    if process_start_method() != "fork":
        _say(Reply(ReplyKind.REFUSED, reason="an accelerator is reachable or other threads run: services start anew"))
        return None
    _say(Reply(ReplyKind.READY))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                continue
            data = os.read(0, 1 << 16)
            if not data:  # the launcher closed its end
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = SpawnRequest(**json.loads(line))
                try:
                    pid = os.fork()
                except OSError as exc:
                    _say(Reply(ReplyKind.FAILED, reason=str(exc), ident=request.ident))
                    continue
                if pid == 0:
                    sel.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    return request
                _say(Reply(ReplyKind.SPAWNED, pid=pid, ident=request.ident))
        _reap()


def become(request: SpawnRequest) -> None:
    """In a forked child: what `python -m module args` started by the launcher would be, then run it."""
    # what `ps` shows; before the environment changes (the title takes over the environment's original space)
    setproctitle.setproctitle(" ".join([sys.executable, "-m", request.module, *request.args]))
    os.setsid()
    os.chdir(request.cwd)
    out = os.open(request.log or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(request.env)
    sys.argv = [request.module, *request.args]
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


def main(preload: list[str]) -> None:
    request = serve(preload)
    if request is not None:
        become(request)


if __name__ == "__main__":
    main(sys.argv[1:])
