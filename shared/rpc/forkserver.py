"""A fork server for service processes: one process imports torch and the services once, then forks every
prefill and decode front a launcher (`pdserve up`) starts, instead of each new interpreter importing them
again (~2.5 s of CPU a start on a 2-core host). A restarted or added instance serves that much sooner.

A forked child becomes what `python -m MODULE ARGS` would have been: its own session, the launcher's
environment for it, stdout and stderr to its log, and `MODULE` run as `__main__`; it leaves through the
interpreter's normal exit (threads joined, exit handlers run), not from inside the server's loop.

This module is the launcher's side (`ForkServer`, `ForkedProcess`) and the protocol: no torch, the router uses
it. The server (`python -m shared.parallel.fork_services MODULE...`) serves only where a fork is safe
(shared.device: no accelerator, one thread); otherwise it says so and the launcher starts interpreters as before.
Protocol: one JSON line per message both ways (SpawnRequest in, Reply out)."""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field

from shared.rpc.service import LAUNCHER_ENV

SERVER_MODULE = "shared.parallel.fork_services"  # the server's process: it imports torch, this module does not

# Environment read when a module is imported or the interpreter starts (torch, OpenMP, MKL, Python itself,
# locale, accelerators): a child whose environment differs here from the server's is started as a new
# interpreter. Everything else a service reads at run time, so a forked child gets it as given.
IMPORT_TIME_ENV_PREFIXES = ("PYTHON", "TORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS", "LD_", "MALLOC",
                            "LC_", "LANG", "CUDA", "NCCL", "ASCEND", "NPU", "HCCL")


@dataclass
class SpawnRequest:
    """Start `python -m module *args` with this environment, working directory and log (None: /dev/null)."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    log: str | None = None
    ident: int = 0  # echoed in the Reply that answers it


class ReplyKind(str, enum.Enum):
    READY = "ready"  # the server imported its modules and may fork
    REFUSED = "refused"  # forking is unsafe here (`reason`): the launcher starts interpreters
    SPAWNED = "spawned"  # the request's child started (`pid`)
    FAILED = "failed"  # fork() failed (`reason`)
    EXITED = "exited"  # a child ended (`pid`, `code` as Popen.returncode has it: negative for a signal)


@dataclass
class Reply:
    """The server's message (see ReplyKind)."""

    kind: ReplyKind
    pid: int = 0
    code: int = 0
    reason: str = ""
    ident: int = 0  # the SpawnRequest a SPAWNED or FAILED reply answers

    def __post_init__(self) -> None:
        self.kind = ReplyKind(self.kind)  # from JSON: its value


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}


# --- the launcher's side --------------------------------------------------------------------------------------

class ForkedProcess:
    """A forked service, with the part of subprocess.Popen's interface a launcher uses (pid, args, returncode,
    poll, wait, send_signal, terminate, kill). Its exit status comes from the fork server, its parent."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class ForkServer:
    """The launcher's handle on one fork server, started on first use by a thread of its own: the server dies
    with that thread (parent-death signal), i.e. with the launcher, and its children with it (die_with_launcher)."""

    preload: list[str]
    env: dict[str, str]  # the environment the server starts with (its import-time part decides what may fork)
    cwd: str = field(default_factory=os.getcwd)
    _proc: subprocess.Popen | None = None
    _refused: str = ""
    _live: dict[int, ForkedProcess] = field(default_factory=dict)
    _pending: list[str] = field(default_factory=list)  # the argv of the request in flight
    _ident: int = 0  # its number
    _answer: ForkedProcess | bool | None = None  # its answer: the child, or False where the fork failed
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _spawn_lock: threading.Lock = field(default_factory=threading.Lock)
    _ready: threading.Event = field(default_factory=threading.Event)  # it imported its modules, or refused
    _keeper: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The server's pid once started (the parent of every child it forks)."""
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Stop serving: the server exits, and the children it forked get their parent-death signal."""
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()
            self._proc.wait(30)

    def can_fork(self, env: dict[str, str], cwd: str) -> bool:
        """Whether a child with this environment and working directory may be forked rather than started anew."""
        return not self._refused and cwd == self.cwd and import_time_env(env) == import_time_env(self.env)

    def spawn(self, module: str, args: list[str], env: dict[str, str], log: str | None,
              timeout: float = 120.0) -> ForkedProcess | None:
        """Fork `python -m module *args`; None where this server cannot (refused, died, other environment)."""
        if not self.can_fork(env, os.getcwd()):
            return None
        with self._spawn_lock:  # one request in flight: the next "spawned" reply is its answer
            if not self._started():
                return None
            with self._cond:
                self._pending, self._ident, self._answer = [sys.executable, "-m", module, *args], self._ident + 1, None
            if LAUNCHER_ENV in env:  # the child dies with its parent: this server
                env = {**env, LAUNCHER_ENV: str(self._proc.pid)}  # type: ignore[union-attr]
            try:
                line = json.dumps(asdict(SpawnRequest(module, args, env, self.cwd, log, self._ident)))
                self._proc.stdin.write(line + "\n")  # type: ignore[union-attr]
                self._proc.stdin.flush()  # type: ignore[union-attr]
            except (BrokenPipeError, ValueError, OSError):
                return None
            with self._cond:
                self._cond.wait_for(lambda: self._answer is not None or bool(self._refused), timeout)
                answer, self._ident = self._answer, self._ident + 1  # a late answer to this request is nobody's
                return answer or None

    def start(self) -> ForkServer:
        """Start the server without waiting for it (its imports overlap the launcher's own start)."""
        with self._cond:
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._run, name="pdserve-fork-server", daemon=True)
                self._keeper.start()
        return self

    def _started(self) -> bool:
        self.start()._ready.wait()
        return self._proc is not None and not self._refused

    def _run(self) -> None:
        """The server's keeper: starts it (so it dies with this thread) and reads its replies until it ends."""
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, *self.preload], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=self.env, cwd=self.cwd,
                                          start_new_session=True)
            for line in self._proc.stdout:  # type: ignore[union-attr]
                self._take(Reply(**json.loads(line)))
        except (OSError, ValueError, TypeError) as exc:
            self._refused = self._refused or f"fork server: {exc}"
        with self._cond:  # its children got their parent-death signal (SIGTERM): they are on their way out
            self._refused = self._refused or "the fork server exited"
            for proc in self._live.values():
                proc._exited(-signal.SIGTERM)
            self._live.clear()
            self._cond.notify_all()
        self._ready.set()

    def _take(self, reply: Reply) -> None:
        with self._cond:
            if reply.kind is ReplyKind.READY:
                self._ready.set()
            elif reply.kind is ReplyKind.REFUSED:
                self._refused = reply.reason or "refused"
                self._ready.set()
            elif reply.kind is ReplyKind.SPAWNED and reply.ident != self._ident:  # its launcher gave up on it
                os.kill(reply.pid, signal.SIGKILL)
            elif reply.kind is ReplyKind.SPAWNED:  # registered before any later line (its exit) is read
                self._answer = self._live[reply.pid] = ForkedProcess(reply.pid, self._pending)
            elif reply.kind is ReplyKind.FAILED and reply.ident == self._ident:
                self._answer = False
            elif reply.kind is ReplyKind.EXITED and reply.pid in self._live:
                self._live.pop(reply.pid)._exited(reply.code)
            self._cond.notify_all()
