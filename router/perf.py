"""The performance model the router and the planner share: how long a prefill, a decode step and a
KV transfer take, fitted offline (`pdserve profile` → profile.json) and calibrated online from the
TTFT / TPOT the router observes.

    prefill(tokens)            = a + b·tokens + c·tokens²            (attention makes long prompts superlinear)
    decode_step(batch, ctx)    = a + b·batch + c·ctx_tokens           (per DP rank; the instance steps at
                                                                       the pace of its busiest rank)
    transfer(tokens)           = tokens · kv_bytes_per_token / bandwidth

DistServe's simulator (OSDI '24) and NVIDIA Dynamo's planner use the same shapes; the README's "Routing
under SLA targets, and planning M/N" compares the model's predictions with measurements.

Where instances share cores (one host running prefill and decode, as a laptop or CI does), an engine
that computes slows the others, and not symmetrically (measured here: a busy decode stretches a prefill
far more than a busy prefill stretches a decode step). A prefill takes `1 + prefill_interference ·
(other busy engines)` times its curve, a decode step `1 + decode_interference · (other busy engines)`.
Both are 0 on dedicated hardware (the default); `pdserve profile --router` measures them. Without it the model can only
learn load-dependent error from calibration, and calibration learned under a burst keeps an idle system
refusing everything (it observes nothing while it refuses).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import grpc

from shared.config import EngineConfig, knob_default
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc

DEFAULT_DTYPE = knob_default(EngineConfig, "dtype")  # declared on EngineConfig
CALIBRATION_LIMITS = (0.1, 10.0)  # observed / predicted factors are clamped: one outlier must not rule
TTFT_BANDS = (0, 1, 256, 1024)  # queued prefill tokens ahead: idle, some, busy, saturated
BUSY_BANDS = 3  # TTFT factors also per engines computing beside the prefill (0, 1, 2+): on shared cores
TPOT_BANDS = (0, 3, 9, 33)  # decode batch (busiest rank): lower bounds of each band


def band(edges: tuple[int, ...], value: float) -> int:
    return max(i for i, edge in enumerate(edges) if value >= edge)


def ttft_band(queued_tokens: float, others_busy: float) -> int:
    """Index of a TTFT calibration factor: the queue's band, then the busy engines beside (0, 1, 2+)."""
    return band(TTFT_BANDS, queued_tokens) * BUSY_BANDS + min(BUSY_BANDS - 1, max(0, round(others_busy)))


@dataclass
class PerfModel:
    prefill_base_s: float = 0.01
    prefill_per_token_s: float = 2e-4
    prefill_per_token2_s: float = 0.0
    decode_base_s: float = 0.02
    decode_per_seq_s: float = 5e-4
    decode_per_context_token_s: float = 2e-6
    kv_bytes_per_token: float = 1152.0  # MLA latent + rope (576 bf16) per layer summed, plus indexer keys
    transfer_bytes_per_s: float = 1e9
    # slowdown per other busy engine on the same cores, of a prefill and of a decode step (0: dedicated hardware)
    prefill_interference: float = 0.0
    decode_interference: float = 0.0
    # Online calibration, per load band, of observed / predicted: where services share cores (or a
    # model misses a cost that grows with load) the error depends on load, and one global factor would
    # inflate the idle predictions by the loaded error. TTFT's bands are (queue ahead, engines busy
    # beside the prefill): where instances share cores, a prompt computed next to busy decodes can take
    # several times its curve even with an empty queue (measured: 200-550 ms for a 60 ms prompt), far
    # more than the linear interference term says. Each factor tracks the `calibration_quantile`
    # of that ratio, not its mean: the SLA is met per request, so a prediction calibrated to the mean
    # would let about half of the requests admitted at the edge of a target miss it, one calibrated to
    # the q-quantile about 1 − q. The default 0.95 sits above the 0.9 attainment the planner plans for,
    # so the noise of a control loop that learns from late observations stays above it.
    ttft_factors: list[float] = field(default_factory=lambda: [1.0] * (len(TTFT_BANDS) * BUSY_BANDS))
    # the same for prompts the decode instance prefills itself, per decode batch band (as TPOT's)
    local_ttft_factors: list[float] = field(default_factory=lambda: [1.0] * len(TPOT_BANDS))
    tpot_factors: list[float] = field(default_factory=lambda: [1.0] * len(TPOT_BANDS))
    smoothing: float = 0.1  # the calibration's step (log scale)
    calibration_quantile: float = 0.95

    @property
    def colocated(self) -> bool:
        """Whether the instances share cores (either interference term set)."""
        return bool(self.prefill_interference or self.decode_interference)

    def prefill_slowdown(self, others_busy: float) -> float:
        """How much longer a prefill takes while `others_busy` other engines compute on the same cores."""
        return 1.0 + self.prefill_interference * max(0.0, others_busy)

    def decode_slowdown(self, others_busy: float) -> float:
        return 1.0 + self.decode_interference * max(0.0, others_busy)

    def scaled(self, prefill: float, decode: float) -> PerfModel:
        """This model with prefill and decode times stretched by the given factors (and no interference
        of its own): the planner's stage A applies its expected slowdowns this way."""
        out = PerfModel(**{f.name: getattr(self, f.name) for f in fields(self)})
        out.prefill_interference = out.decode_interference = 0.0
        out.prefill_base_s, out.prefill_per_token_s, out.prefill_per_token2_s = (
            x * prefill for x in (self.prefill_base_s, self.prefill_per_token_s, self.prefill_per_token2_s))
        out.decode_base_s, out.decode_per_seq_s, out.decode_per_context_token_s = (
            x * decode for x in (self.decode_base_s, self.decode_per_seq_s, self.decode_per_context_token_s))
        return out

    def prefill_seconds(self, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        return self.prefill_base_s + self.prefill_per_token_s * tokens + self.prefill_per_token2_s * tokens * tokens

    def prefill_queue_seconds(self, queued_tokens: float) -> float:
        """Time until an instance has computed `queued_tokens` waiting ahead of a new prompt."""
        return self.prefill_per_token_s * queued_tokens + (self.prefill_base_s if queued_tokens > 0 else 0.0)

    def decode_step_seconds(self, batch: float, context_tokens: float) -> float:
        if batch <= 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_context_token_s * context_tokens

    def transfer_seconds(self, tokens: float) -> float:
        """(A served profile folds the transfer into its measured TTFT: bandwidth inf.)"""
        return tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def ttft_raw(self, queued_tokens: float, prompt_tokens: float, cached_tokens: float = 0.0,
                 others_busy: float = 0.0, reused_tokens: float = 0.0) -> float:
        """Time to first token by the fitted curves: the queue ahead and the prompt prefill has not cached
        (slowed by the other busy engines sharing the cores), the transfer of what decode has not cached."""
        compute = self.prefill_queue_seconds(queued_tokens) + self.prefill_seconds(prompt_tokens - cached_tokens)
        return compute * self.prefill_slowdown(others_busy) + self.transfer_seconds(prompt_tokens - reused_tokens)

    def ttft(self, queued_tokens: float, prompt_tokens: float, cached_tokens: float = 0.0,
             others_busy: float = 0.0, reused_tokens: float = 0.0) -> float:
        """Predicted time to first token, calibrated for its load band (queue ahead, engines busy beside)."""
        factor = self.ttft_factors[ttft_band(queued_tokens, others_busy)]
        return self.ttft_raw(queued_tokens, prompt_tokens, cached_tokens, others_busy, reused_tokens) * factor

    def local_ttft_raw(self, batch: float, context_tokens: float, prompt_tokens: float,
                       others_busy: float = 0.0) -> float:
        """Time to first token when the decode instance prefills prompts itself (selective disaggregation):
        one step carries `prompt_tokens` beside `batch` running decodes (a step's cost plus the prompts');
        no prefill queue, RPC or KV transfer. Both paths first wait for the decode engine's next turn
        (admission), so that wait is left out of both predictions (ttft_raw has none)."""
        step = self.decode_step_seconds(batch, context_tokens)
        return (step + self.prefill_seconds(prompt_tokens)) * self.decode_slowdown(others_busy)

    def local_ttft_factor(self, batch: float) -> float:
        """The calibration of local_ttft_raw at a decode batch of `batch`."""
        return self.local_ttft_factors[band(TPOT_BANDS, batch)]

    def observe_local_ttft(self, batch: float, raw_predicted: float, observed: float) -> None:
        b = band(TPOT_BANDS, batch)
        self.local_ttft_factors[b] = self._smooth(self.local_ttft_factors[b], raw_predicted, observed)

    def tpot_raw(self, batch: float, context_tokens: float, others_busy: float = 0.0) -> float:
        return self.decode_step_seconds(batch, context_tokens) * self.decode_slowdown(others_busy)

    def tpot(self, batch: float, context_tokens: float, others_busy: float = 0.0) -> float:
        return self.tpot_raw(batch, context_tokens, others_busy) * self.tpot_factors[band(TPOT_BANDS, batch)]

    # -- online calibration ----------------------------------------------------------------------
    def observe_ttft(self, queued_tokens: float, raw_predicted: float, observed: float,
                     others_busy: float = 0.0) -> None:
        b = ttft_band(queued_tokens, others_busy)
        self.ttft_factors[b] = self._smooth(self.ttft_factors[b], raw_predicted, observed)

    def observe_tpot(self, batch: float, raw_predicted: float, observed: float) -> None:
        b = band(TPOT_BANDS, batch)
        self.tpot_factors[b] = self._smooth(self.tpot_factors[b], raw_predicted, observed)

    def relax(self) -> None:
        """Move every calibration factor a step back toward 1: called when an idle pair refuses a
        request only because of calibration (the uncalibrated curves say it fits). A refused request
        is never observed, so without this, factors learned in a burst would keep an idle system
        refusing."""
        step = self.smoothing / 2
        self.ttft_factors = [f + (1 - f) * step for f in self.ttft_factors]
        self.tpot_factors = [f + (1 - f) * step for f in self.tpot_factors]
        self.local_ttft_factors = [f + (1 - f) * step for f in self.local_ttft_factors]

    def _smooth(self, factor: float, raw_predicted: float, observed: float) -> float:
        """One step of a stochastic quantile estimate, multiplicative: up by smoothing·q when the
        observation exceeds the calibrated prediction, down by smoothing·(1 − q) otherwise, so the
        factor settles where a share q of the ratios observed / predicted lie at or below it."""
        if raw_predicted <= 0 or observed <= 0:
            return factor
        lo, hi = CALIBRATION_LIMITS
        q = self.calibration_quantile
        step = q if observed > factor * raw_predicted else q - 1.0
        return min(hi, max(lo, factor * math.exp(self.smoothing * step)))

    # -- profile.json ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown profile fields {unknown}")
        model = cls(**data)
        for f in fields(cls):
            value = getattr(model, f.name)
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, (int, float)) and v >= 0 for v in values):
                raise ValueError(f"{path}: {f.name} must be non-negative numbers")
        if not 0 < model.calibration_quantile < 1:
            raise ValueError(f"{path}: calibration_quantile must be in (0, 1), got {model.calibration_quantile}")
        ttft_bands = len(TTFT_BANDS) * BUSY_BANDS
        if len(model.ttft_factors) == len(TTFT_BANDS):  # a profile from before the busy bands: each queue band's
            model.ttft_factors = [f for f in model.ttft_factors for _ in range(BUSY_BANDS)]  # factor for all
        if len(model.ttft_factors) != ttft_bands or len(model.tpot_factors) != len(TPOT_BANDS):
            raise ValueError(f"{path}: ttft_factors / tpot_factors need {ttft_bands} / {len(TPOT_BANDS)} bands")
        return model


def fit_linear(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least-squares coefficients (non-negative, clipped) of y ≈ Σ x_i·c_i (include a 1 column for a base),
    by the normal equations (a handful of columns: no linear-algebra library in the router)."""
    n = len(xs[0])
    a = [[sum(row[i] * row[j] for row in xs) for j in range(n)] + [sum(row[i] * y for row, y in zip(xs, ys))]
         for i in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            continue  # a column without information keeps coefficient 0
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col])]
    return [max(0.0, a[i][n] / a[i][i]) if abs(a[i][i]) >= 1e-300 else 0.0 for i in range(n)]


def profile_engine(model: str, dtype: str = DEFAULT_DTYPE, say=print, lengths: tuple[int, ...] = (16, 64, 256, 1024),
                   batches: tuple[int, ...] = (1, 4, 16, 64), contexts: tuple[int, ...] = (32, 256)) -> PerfModel:
    """Measure prefill (at `lengths`) and decode (at `batches` × `contexts`) of the engine in-process
    on `model` and fit a PerfModel. The one router command that runs the engine in its own process, so
    the only place the router package loads torch (on demand)."""
    from shared.engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype)
    engine = llm.engine
    limit = engine.max_model_len
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    xs, ys = [], []
    for length in [n for n in lengths if n < limit // 2]:
        times = []
        for rep in range(3):
            prompt = [(7 * i + rep) % 200 + 3 for i in range(length)]
            t0 = time.perf_counter()
            llm.generate([prompt], one)
            times.append(time.perf_counter() - t0)
        xs.append([1.0, length, length * length])
        ys.append(statistics.median(times))
        say(f"prefill {length:5d} tokens: {ys[-1] * 1e3:8.1f} ms")
    pa, pb, pc = fit_linear(xs, ys)
    xs, ys = [], []
    steps = 8
    for batch in batches:
        for prompt_len in contexts:
            if prompt_len + steps + 2 >= limit:
                continue
            params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
            seqs = [engine.add_request([(3 * i + b) % 200 + 3 for i in range(prompt_len)], params)
                    for b in range(batch)]
            while any(s.is_prefilling for s in seqs):
                engine.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            seconds = (time.perf_counter() - t0) / steps
            while engine.has_work:
                engine.step()
            xs.append([1.0, batch, batch * (prompt_len + steps)])
            ys.append(seconds)
            say(f"decode batch {batch:3d} context {prompt_len:4d}: {seconds * 1e3:8.1f} ms/step")
    da, db, dc = fit_linear(xs, ys)
    kv_bytes = engine.layout.bytes_per_token()
    return PerfModel(prefill_base_s=pa, prefill_per_token_s=pb, prefill_per_token2_s=pc, decode_base_s=da,
                     decode_per_seq_s=db, decode_per_context_token_s=dc, kv_bytes_per_token=float(kv_bytes))


def profile_served(address: str, say=print, lengths: tuple[int, ...] = (16, 64, 256),
                   batches: tuple[int, ...] = (1, 4, 16), contexts: tuple[int, ...] = (32, 128),
                   steps: int = 16, open_channel=None) -> PerfModel:
    """Measure through a running router (`pdserve profile --router ADDR`): TTFT of one prompt at a
    time for the prefill curve (queue-free, so it holds the whole disaggregated path: prefill, KV
    push, admission), and the TPOT of `batch` concurrent streams for the decode curve. This is what
    the router will see, processes sharing cores included."""

    def stream(stub, prompt: list[int], n: int) -> list[float]:
        req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True))
        t0, stamps = time.perf_counter(), [0.0]
        for msg in stub.Generate(req, timeout=600):
            stamps.extend([time.perf_counter() - t0] * len(msg.token_ids))
        return stamps[1:]

    with (open_channel or grpc.insecure_channel)(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        stream(stub, [5, 6, 7], 2)  # warm
        xs, ys = [], []
        for length in lengths:
            ttfts = [stream(stub, [(11 * i + rep) % 400 + 3 for i in range(length)], 1)[0] for rep in range(3)]
            xs.append([1.0, length, length * length])
            ys.append(statistics.median(ttfts))
            say(f"TTFT {length:5d} tokens: {ys[-1] * 1e3:8.1f} ms")
        pa, pb, pc = fit_linear(xs, ys)
        xs, ys = [], []
        for batch in batches:
            for ctx in contexts:
                out: list[list[float]] = []

                def run(b: int, ctx: int = ctx, out: list = out) -> None:
                    out.append(stream(stub, [(13 * i + b) % 400 + 3 for i in range(ctx)], steps + 1))

                threads = [threading.Thread(target=run, args=(b,)) for b in range(batch)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                tpot = statistics.median((s[-1] - s[0]) / (len(s) - 1) for s in out if len(s) > 1)
                xs.append([1.0, batch, batch * (ctx + steps / 2)])
                ys.append(tpot)
                say(f"TPOT batch {batch:3d} context {ctx:4d}: {tpot * 1e3:8.1f} ms")
        da, db, dc = fit_linear(xs, ys)
        prefill_i, decode_i = measure_interference(stub, stream, steps, say)
    return PerfModel(prefill_base_s=pa, prefill_per_token_s=pb, prefill_per_token2_s=pc, decode_base_s=da,
                     decode_per_seq_s=db, decode_per_context_token_s=dc, transfer_bytes_per_s=float("inf"),
                     prefill_interference=prefill_i, decode_interference=decode_i)


def measure_interference(stub, stream, steps: int, say=print, prompt_tokens: int = 64) -> tuple[float, float]:
    """(prefill, decode) interference through the served path: the TTFT of a prompt while one stream keeps
    a decode stepping, and the TPOT of a stream while prompts keep the prefill computing, each against the
    same alone (medians of 5). Near 0 where instances do not share cores."""

    def prompt(seed: int, n: int) -> list[int]:  # distinct prompts: no prefix-cache hits
        return [(29 * i + 7919 * seed) % 400 + 3 for i in range(n)]

    def tpot(seed: int) -> float:
        s = stream(stub, prompt(seed, 64), steps + 1)
        return (s[-1] - s[0]) / (len(s) - 1)

    def ttft(seed: int) -> float:
        return stream(stub, prompt(seed, prompt_tokens), 1)[0]

    def beside(background, measure, seed: int) -> float:
        """`measure` while `background` runs in a thread, once the background work is under way."""
        t = threading.Thread(target=background, args=(1000 * seed,), daemon=True)
        t.start()
        time.sleep(0.3)
        value = measure(10 + seed)
        t.join()
        return value

    def long_decode(seed: int) -> None:  # one decode stepping for ~2 s (no prefill in the window)
        stream(stub, prompt(seed, 16), 100)

    def prompts(seed: int) -> None:  # the prefill computing distinct prompts back to back for ~1 s
        for k in range(6):
            stream(stub, prompt(seed + k, 256), 1)

    samples = 5
    alone_ttft = statistics.median(ttft(100 + s) for s in range(samples))
    busy_ttft = statistics.median(beside(long_decode, ttft, 200 + s) for s in range(samples))
    alone_tpot = statistics.median(tpot(300 + s) for s in range(samples))
    busy_tpot = statistics.median(beside(prompts, tpot, 400 + s) for s in range(samples))
    prefill_i, decode_i = max(0.0, busy_ttft / alone_ttft - 1), max(0.0, busy_tpot / alone_tpot - 1)
    say(f"interference: TTFT {alone_ttft * 1e3:.1f} ms alone, {busy_ttft * 1e3:.1f} ms beside a busy decode "
        f"→ {prefill_i:.2f}; TPOT {alone_tpot * 1e3:.1f} ms alone, {busy_tpot * 1e3:.1f} ms beside a busy "
        f"prefill → {decode_i:.2f}")
    return prefill_i, decode_i
