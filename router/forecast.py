"""The load a few minutes ahead, for an autoscaler that plans ahead (router.autoscale): an instance asked for
now serves only a boot time later, so the pools are sized for the load then, not the load seen.

Each decision sees the last window's load (arrivals / s and prompt tokens / s, the cached ones apart): a
window's mean stands for the window's middle, half a window ago. `Trend` follows each series with Holt's linear
trend (a smoothed level and slope) through those midpoints and extrapolates to the time asked. `Margin` keeps
what the forecasts missed by: every forecast is checked once its target time has been observed, and the margin
is the median of actual / forecast plus 1.28 robust deviations over the recent ones (never below 1): sized on
the forecast times the margin, the pools cover the forecast's own recent errors, no more.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from router.planner import Observation

TREND_LEVEL = 0.3  # Holt's smoothing of the level (per observation)
TREND_SLOPE = 0.05  # ... and of the slope: a trend is believed only after it lasts
MARGIN_SAMPLES = 60  # the forecast errors the margin is taken over
MARGIN_Z = 1.28  # the margin covers the errors' median + this many deviations (their 90th percentile, if normal)
SETTLE_WINDOWS = 2  # forecasts are scored once the trend has seen this many windows


@dataclass
class Trend:
    """Holt's linear trend of one series observed at increasing times (seconds)."""

    level: float | None = None
    slope: float = 0.0  # per second: flat until the observations say otherwise
    t: float = 0.0

    def update(self, t: float, x: float) -> None:
        if self.level is None:
            self.level, self.t = x, t
            return
        dt = t - self.t
        if dt <= 0:
            return
        predicted = self.level + self.slope * dt
        level = TREND_LEVEL * x + (1 - TREND_LEVEL) * predicted
        self.slope = TREND_SLOPE * (level - self.level) / dt + (1 - TREND_SLOPE) * self.slope
        self.level, self.t = level, t

    def at(self, t: float) -> float:
        """The series at time `t` (never below 0)."""
        return max(0.0, (self.level or 0.0) + self.slope * (t - self.t))


@dataclass
class Margin:
    """How far above its forecasts the load came: the median of actual / forecast plus MARGIN_Z deviations (the
    median absolute deviation's, robust to a burst), over the last MARGIN_SAMPLES forecasts whose time has been
    observed (never below 1; 1 until there are some)."""

    pending: collections.deque = field(default_factory=collections.deque)  # (target time, forecast), in order
    ratios: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MARGIN_SAMPLES))

    def forecast_made(self, target_t: float, value: float) -> None:
        self.pending.append((target_t, value))

    def observed(self, t: float, value: float) -> None:
        """The series' value at `t`: the forecasts made for `t` or before are scored."""
        while self.pending and self.pending[0][0] <= t:
            _, forecast = self.pending.popleft()
            if forecast > 0:
                self.ratios.append(value / forecast)

    @property
    def value(self) -> float:
        if len(self.ratios) < 2:
            return 1.0
        mid = statistics.median(self.ratios)
        spread = 1.4826 * statistics.median(abs(r - mid) for r in self.ratios)  # a normal deviation's worth
        return max(1.0, mid + MARGIN_Z * spread)


@dataclass
class LoadForecast:
    """The load `lead_s` ahead from the window observations the autoscaler is handed: arrivals / s, and prompt,
    cached-prompt and output tokens per request (their rates' trends over the arrivals' trend)."""

    window_s: float
    rate: Trend = field(default_factory=Trend)
    prompt: Trend = field(default_factory=Trend)  # prompt tokens / s
    cached: Trend = field(default_factory=Trend)  # of them, found in a prefix cache, / s
    margin: Margin = field(default_factory=Margin)
    started: float | None = None

    def observe(self, now: float, obs: Observation) -> None:
        """A window's load, ending now (the window shorter at the start)."""
        if self.started is None:
            self.started = now - self.window_s
        full = now - self.started >= SETTLE_WINDOWS * self.window_s  # the trend has settled: a fair score
        mid = now - min(self.window_s, now - self.started) / 2
        self.rate.update(mid, obs.rate)
        self.prompt.update(mid, obs.rate * obs.mean_prompt_tokens)
        self.cached.update(mid, obs.rate * obs.mean_cached_prompt_tokens)
        if full:
            self.margin.observed(mid, obs.rate)
        else:
            self.margin.pending.clear()  # forecasts made before the trend settled are not scored

    def ahead(self, now: float, lead_s: float, obs: Observation, scored: bool = True) -> Observation:
        """The load `lead_s` from now, arrivals times the margin (`scored`: the forecast is scored later)."""
        t = now + lead_s
        rate = self.rate.at(t)
        if scored:
            self.margin.forecast_made(t, rate)
        if rate <= 0:
            return Observation(0.0, obs.mean_prompt_tokens, obs.mean_output_tokens, obs.mean_cached_prompt_tokens,
                               obs.seconds)
        prompt = self.prompt.at(t) / rate
        cached = min(prompt, self.cached.at(t) / rate)
        return Observation(rate * self.margin.value, prompt, obs.mean_output_tokens, cached, obs.seconds)
