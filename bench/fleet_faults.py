"""The fleet's fault matrix through what users run: `pdserve up --num-prefill 2 --num-decode 2 --http-port 0` as a
subprocess, 24 concurrent streams (half over the OpenAI HTTP API with the official `openai` SDK, half over gRPC;
greedy and seeded sampling), and one fault per round while they stream:

  decode SIGKILL | decode SIGTERM (its process group) | prefill SIGKILL (frozen with its share of the prompts in
  flight, killed a second later) | router SIGTERM | router SIGKILL

A stream is *whole* when it ends normally with exactly the tokens (gRPC) / text (HTTP) of the same request in an
unfaulted round. A killed router cannot finish what it held: there each stream must end with a *clean error*
(an exception, never a silently short stream) and new requests must succeed once `pdserve up` has restarted it.
After each round the victim is back (restarted by `pdserve up`) and the survivors hold no KV block or lease.

    python bench/fleet_faults.py [--model models/demo-v32] [--tokens 64] [--faults decode-kill,router-term]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402

from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

FAULTS = ("decode-kill", "decode-term", "prefill-kill", "router-term", "router-kill")
STREAMS = 24
TOKENS = 256  # per stream: long enough that every stream is under way together, even on a loaded machine
EACH_TOKENS = 4  # a mid-stream fault strikes once every stream has this many tokens


@dataclass
class Line:
    at: float
    text: str


@dataclass
class UpProcess:
    """`pdserve up ARGS` in its own process group, its output collected line by line."""

    args: list[str]
    log_dir: Path
    proc: subprocess.Popen | None = None
    lines: list[Line] = field(default_factory=list)
    grpc_address: str = ""
    http_url: str = ""
    kserve_address: str = ""  # with --kserve-port
    epp_address: str = ""  # with --epp-port
    model: str = ""
    metrics: dict[str, str] = field(default_factory=dict)  # service name → its /metrics URL
    pools: dict[str, list[str]] = field(default_factory=dict)  # prefill / decode → addresses
    supervisor_metrics: str = ""  # pdserve up's own /metrics (restarts)

    def start(self, timeout: float = 300.0) -> UpProcess:
        exe = Path(sys.executable).with_name("pdserve")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "router.cli"]
        self.proc = subprocess.Popen([*cmd, "up", *self.args, "--log-dir", str(self.log_dir)], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_line(r"Ctrl-C to stop", timeout=timeout)
        for line in list(self.lines):
            if m := re.search(r"router at (\S+); prefill \[(.*)\]; decode \[(.*)\]", line.text):
                self.grpc_address = m.group(1)
                self.pools = {k: re.findall(r"'([^']+)'", m.group(i)) for i, k in ((2, "prefill"), (3, "decode"))}
            if m := re.search(r"HTTP API at (\S+) \(model (.+)\)", line.text):
                self.http_url, self.model = m.group(1), m.group(2)
            if m := re.search(r"KServe v2 gRPC \(Open Inference Protocol\) at (\S+)", line.text):
                self.kserve_address = m.group(1)
            if m := re.search(r"endpoint picker \(Envoy ext_proc\) at (\S+)", line.text):
                self.epp_address = m.group(1)
            if m := re.search(r"restarts counted at (\S+/metrics)", line.text):
                self.supervisor_metrics = m.group(1)
            if line.text.startswith("metrics: "):
                self.metrics = dict(re.findall(r"(\w+) (http://\S+/metrics)", line.text))
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for text in self.proc.stdout:
            self.lines.append(Line(time.monotonic(), text.rstrip()))

    def wait_line(self, pattern: str, since: float = 0.0, timeout: float = 120.0) -> re.Match:
        """The first output line at or after `since` (monotonic) matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.at >= since and (m := re.search(pattern, line.text)):
                    return m
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited ({self.proc.returncode}):\n" + self.output())
            time.sleep(0.05)
        raise TimeoutError(f"no line matching {pattern!r} within {timeout} s:\n" + self.output())

    def output(self) -> str:
        return "\n".join(line.text for line in self.lines[-40:])

    def service_pid(self, name: str) -> int:
        """The pid of service `name` (router, prefill0, decode1, ...), as `ps` shows it: the child of pdserve up (or
        of its fork server) whose port file (where it reports its port, restarted or not) is named after it. One
        pass over /proc: a fault strikes at its moment."""
        assert self.proc is not None
        seen: list[tuple[int, int, list[bytes]]] = []  # pid, parent, argv (a forked service's title: one string)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                argv = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").split()
            except (OSError, ValueError, IndexError):
                continue
            seen.append((int(stat.parent.name), ppid, argv))
        parents = {self.proc.pid} | {pid for pid, ppid, argv in seen
                                     if ppid == self.proc.pid and b"shared.parallel.fork_services" in argv}
        for pid, ppid, argv in seen:
            if ppid in parents and b"--port-file" in argv and \
                    argv[argv.index(b"--port-file") + 1].endswith(f"/{name}".encode()):
                return pid
        raise LookupError(f"no process of pdserve up serves {name}")

    def metric(self, service: str, prefix: str) -> float:
        """The sum of `service`'s /metrics samples whose line starts with `prefix` (service "up": pdserve up's)."""
        url = self.supervisor_metrics if service == "up" else self.metrics[service]
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(prefix))

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)


@dataclass(frozen=True)
class StreamSpec:
    index: int
    api: str  # grpc | http
    prompt: tuple[int, ...]
    seed: int | None  # None: greedy


@dataclass
class Outcome:
    output: tuple  # token ids (gRPC) or text pieces (HTTP)
    finished: bool
    error: str | None = None


def workload(tokens: int, vocab: int, seed: int = 3) -> list[StreamSpec]:
    """24 streams: even ones over gRPC, odd ones over HTTP; every third one seeded sampling, the rest greedy;
    prompts of 120-350 tokens."""
    rng = random.Random(seed)
    return [StreamSpec(i, "grpc" if i % 2 == 0 else "http", tuple(rng.randrange(2, vocab) for _ in
                                                                   range((200, 350, 120)[i % 3])),
                       i if i % 3 == 2 else None) for i in range(STREAMS)]


def run_stream(up: UpProcess, spec: StreamSpec, tokens: int, counted: Callable[[int], None]) -> Outcome:
    temperature, top_p = (1.0, 0.9) if spec.seed is not None else (0.0, 1.0)
    got: list = []
    try:
        if spec.api == "grpc":
            sp = generation_pb2.SamplingParams(max_tokens=tokens, temperature=temperature, top_p=top_p,
                                               ignore_eos=True)
            if spec.seed is not None:
                sp.seed = spec.seed
            finished = False
            with grpc.insecure_channel(up.grpc_address) as ch:
                for msg in generation_pb2_grpc.GenerationStub(ch).Generate(
                        generation_pb2.GenerateRequest(prompt_token_ids=spec.prompt, sampling_params=sp), timeout=300):
                    got += msg.token_ids
                    counted(len(msg.token_ids))
                    finished = finished or bool(msg.finish_reason)
            return Outcome(tuple(got), finished)
        client = openai.OpenAI(base_url=up.http_url, api_key="none", timeout=300)
        finished = False
        for chunk in client.completions.create(model=up.model, prompt=list(spec.prompt), max_tokens=tokens,
                                               temperature=temperature, top_p=top_p, seed=spec.seed, stream=True,
                                               extra_body={"ignore_eos": True}):
            for choice in chunk.choices:
                got.append(choice.text)
                counted(1)
                finished = finished or choice.finish_reason is not None
        return Outcome(("".join(got),), finished)  # chunking may differ after a migration: the text may not
    except (grpc.RpcError, openai.OpenAIError, httpx.HTTPError) as exc:
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
        return Outcome(tuple(got), False, detail[:200])


def run_round(up: UpProcess, specs: list[StreamSpec], tokens: int, fault: Callable[[], None] | None = None,
              each_tokens: int = 0) -> list[Outcome]:
    """Every stream at once, one thread each; `fault()` once every stream has `each_tokens` tokens (all in
    flight, each under way: on a loaded machine the last may start long after the first), with 0 once the
    first token of any has arrived, with -1 at once (the fault waits for its own moment)."""
    out: list[Outcome | None] = [None] * len(specs)
    counts, lock = [0] * len(specs), threading.Lock()

    def counted(index: int, n: int) -> None:
        with lock:
            counts[index] += n

    def one(spec: StreamSpec) -> None:
        out[spec.index] = run_stream(up, spec, tokens, lambda n: counted(spec.index, n))

    threads = [threading.Thread(target=one, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while each_tokens >= 0 and (min(counts) < each_tokens if each_tokens else sum(counts) == 0) \
                and time.monotonic() < deadline:
            time.sleep(0.002)
        fault()
    for t in threads:
        t.join(400)
    return [o if o is not None else Outcome((), False, "hung") for o in out]


@dataclass
class RoundResult:
    fault: str
    whole: int  # ended normally and equal to the unfaulted round
    clean_errors: int  # ended with an error the client saw (expected only when the router is killed)
    wrong: int  # ended normally but differs (a silently short or altered stream): never acceptable
    served_after: bool  # new requests succeed once the victim is back
    recovery_s: float  # from the fault to the victim listening again
    notes: list[str] = field(default_factory=list)


def judge(fault: str, outcomes: list[Outcome], reference: list[Outcome]) -> RoundResult:
    whole = sum(o.error is None and o.finished and o.output == r.output for o, r in zip(outcomes, reference))
    errors = sum(o.error is not None for o in outcomes)
    notes = sorted({o.error for o in outcomes if o.error})[:3]
    return RoundResult(fault, whole, errors, len(outcomes) - whole - errors, False, 0.0, notes)


def probe_draining(up: UpProcess) -> list[str]:
    """What a new request meets while the router drains: HTTP 503 with Retry-After and gRPC UNAVAILABLE."""
    notes = []
    try:
        reply = httpx.post(f"{up.http_url}/completions", json={"model": up.model, "prompt": [5, 6, 7],
                                                               "max_tokens": 2}, timeout=10)
        notes.append(f"HTTP {reply.status_code} Retry-After={reply.headers.get('retry-after')}")
    except httpx.HTTPError as exc:
        notes.append(f"HTTP {type(exc).__name__}")
    try:
        with grpc.insecure_channel(up.grpc_address) as ch:
            list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                prompt_token_ids=[5, 6, 7], sampling_params=generation_pb2.SamplingParams(max_tokens=2)), timeout=10))
        notes.append("gRPC OK")
    except grpc.RpcError as exc:
        notes.append(f"gRPC {exc.code().name}")
    return notes


def busiest_decode(up: UpProcess, timeout: float = 10.0) -> str:
    """The decode instance running the most requests, once one runs any (within `timeout`): the router may keep
    every stream on one instance (where their prompts' blocks are cached from an earlier round), so a decode fault
    strikes there to hit requests."""
    decodes = sorted(n for n in up.metrics if n.startswith("decode"))
    deadline = time.monotonic() + timeout
    while True:
        running = {n: up.metric(n, "pdserve_running_requests") for n in decodes}
        if max(running.values()) > 0 or time.monotonic() > deadline:
            return max(decodes, key=lambda n: running[n])
        time.sleep(0.01)


@dataclass
class Fault:
    """One fault of the matrix: its victim service (a decode fault's is picked when it strikes, see
    busiest_decode) and the tokens each stream has before it strikes (-1: at once: a prefill instance is frozen
    as the requests arrive and killed a second later, with its share in flight)."""

    name: str
    up: UpProcess
    victim: str = ""
    notes: list[str] = field(default_factory=list)
    struck_at: float = 0.0  # monotonic: when the signal that kills or drains the victim went out

    def __post_init__(self) -> None:
        self.victim = {"decode": "decode0", "prefill": "prefill0", "router": "router"}[self.name.split("-")[0]]

    @property
    def each_tokens(self) -> int:
        return -1 if self.name == "prefill-kill" else EACH_TOKENS

    def strike(self) -> None:
        up, fault = self.up, self.name
        if fault.startswith("decode"):  # where streams run: a drain must hand them back, a kill must lose them
            self.victim = busiest_decode(up)
        pid = up.service_pid(self.victim)
        if fault == "decode-term":
            os.killpg(pid, signal.SIGTERM)
        elif fault == "prefill-kill":  # with its share of the prompts in flight: an instance computes its share
            os.kill(pid, signal.SIGSTOP)  # in one step, too short to catch from outside; frozen, they stay
            time.sleep(1.0)  # in flight (the router places every request within milliseconds)
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGTERM if fault == "router-term" else signal.SIGKILL)
        self.struck_at = time.monotonic()
        if fault == "router-term":
            time.sleep(0.3)
            self.notes.extend(probe_draining(up))


def recover(up: UpProcess, victim: str, since: float, timeout: float = 180.0) -> tuple[bool, float]:
    """Wait until `pdserve up` has restarted the victim, the router places on it again and new requests succeed
    over both APIs; (served, seconds from the fault until the victim listened again)."""
    m = up.wait_line(rf"{victim} \((\S+)\) listens again(?:; metrics at (\S+))?", since, timeout)
    listened = next(x.at for x in reversed(up.lines) if re.search(rf"{victim} \(\S+\) listens again", x.text))
    if m.group(2):
        up.metrics[victim] = m.group(2)
    deadline = time.monotonic() + timeout
    if victim != "router":
        pool = victim.rstrip("0123456789")
        placeable = f'pdserve_router_instance_placeable{{instance="{m.group(1)}",pool="{pool}"}}'
        while up.metric("router", placeable) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
    probe = [StreamSpec(0, "grpc", (5, 6, 7), None), StreamSpec(1, "http", (5, 6, 7), None)]
    while time.monotonic() < deadline:
        if all(run_stream(up, s, 2, lambda n: None).finished for s in probe):
            return True, listened - since
        time.sleep(0.5)
    return False, listened - since


def nothing_held(up: UpProcess, victim: str, timeout: float = 30.0) -> bool:
    """The instances that stayed up hold no KV block, lease or request (decode) and run nothing (prefill)."""
    deadline = time.monotonic() + timeout
    survivors = [n for n in up.metrics if n != "router" and n != victim]
    while time.monotonic() < deadline:
        if all(up.metric(n, "pdserve_running_requests") == 0 and (not n.startswith("decode") or (
                up.metric(n, "pdserve_kv_blocks_used") == 0 and up.metric(n, "pdserve_active_leases") == 0))
               for n in survivors):
            return True
        time.sleep(0.2)
    return False


def unfaulted(up: UpProcess, tokens: int, vocab: int) -> tuple[list[StreamSpec], list[Outcome]]:
    """The workload and its unfaulted round: what every faulted round must reproduce."""
    specs = workload(tokens, vocab)
    reference = run_round(up, specs, tokens)
    bad = [(s.index, o.error) for s, o in zip(specs, reference) if o.error or not o.finished]
    if bad:
        raise RuntimeError(f"the unfaulted round failed: {bad}")
    return specs, reference


def run_fault(up: UpProcess, fault: str, specs: list[StreamSpec], reference: list[Outcome],
              tokens: int) -> RoundResult:
    """One round with `fault` striking mid-stream, then the cluster whole again."""
    hit = Fault(fault, up)
    result = judge(fault, run_round(up, specs, tokens, hit.strike, hit.each_tokens), reference)
    result.served_after, result.recovery_s = recover(up, hit.victim, hit.struck_at)
    if not nothing_held(up, hit.victim):
        result.notes.append("survivors still hold KV blocks, leases or requests")
    result.notes = hit.notes + [f"victim {hit.victim}"] + result.notes
    return result


def run_matrix(up: UpProcess, faults: list[str], tokens: int, vocab: int,
               say: Callable[[str], None] = print) -> list[RoundResult]:
    """The unfaulted round, then one round per fault (each with the cluster whole again before it)."""
    specs, reference = unfaulted(up, tokens, vocab)
    results = []
    for fault in faults:
        result = run_fault(up, fault, specs, reference, tokens)
        say(f"{fault}: {result.whole}/{STREAMS} whole, {result.clean_errors} clean errors, {result.wrong} wrong; "
            f"served after: {result.served_after} ({result.recovery_s:.1f} s to restart) {result.notes}")
        results.append(result)
    return results


def main() -> None:
    from bench.common import bar_plot, table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "demo-v32"))
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens each stream generates")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--up-args", default="", help="more `pdserve up` flags, e.g. '--dtype float32'")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "fleet_faults.png"))
    args = p.parse_args()
    vocab = __import__("json").loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    log_dir = Path(args.out).parent / "fleet_faults_logs"
    up = UpProcess(["--model", args.model, "--num-prefill", "2", "--num-decode", "2", "--port", "0",
                    "--http-port", "0", *args.up_args.split()], log_dir)
    try:
        up.start()
        results = run_matrix(up, [f for f in args.faults.split(",") if f], args.tokens, vocab)
    finally:
        up.stop()
    print(table(["fault", "whole", "clean errors", "wrong", "new requests served after", "restart (s)", "notes"],
                [[r.fault, f"{r.whole}/{STREAMS}", r.clean_errors, r.wrong, r.served_after, f"{r.recovery_s:.1f}",
                  "; ".join(r.notes)] for r in results]))
    path = bar_plot(Path(args.out), f"pdserve up, 2P+2D: {STREAMS} streams per fault",
                    [r.fault for r in results], {"whole": [r.whole for r in results],
                                                 "clean error": [r.clean_errors for r in results],
                                                 "wrong": [r.wrong for r in results]}, "streams")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
