"""bench/kv_reuse.py's pure parts: the window it replays, the unbounded single-cache share it holds the fleet to,
its reading of Prometheus text and of AIPerf's export, and which configurations a build can run. No AIPerf, no
cluster: those run by hand (README, "Replaying the Mooncake trace")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import kv_reuse as kr
from bench.peers.aiperf import hf_tokenizer_env, parse_aiperf_export

ROOT = Path(__file__).resolve().parents[1]


def req(t_ms: float, isl: int, ids: list[int], osl: int = 10) -> kr.TraceRequest:
    return kr.TraceRequest(t_ms, isl, osl, tuple(ids))


def test_window_selects_rebases_speeds_and_scales():
    trace = [req(0, 1024, [0, 1]), req(5_000, 1000, [0, 2]), req(10_000, 600, [3, 4]), req(20_000, 100_000, [5]),
             req(30_000, 512, [6])]
    w = kr.select_window(trace, start_s=5, duration_s=20, speed=2.0, block_size=16, context=1024, max_output=None)
    # [5 s, 25 s): the 1000-, 600- and 100,000-token prompts; the last does not fit 1,024 tokens scaled (3,125)
    assert [r.timestamp_ms for r in w.requests] == [0.0, 2500.0]
    assert [r.input_length for r in w.requests] == [32, 19]  # ceil(1000 / 32), ceil(600 / 32)
    assert w.dropped == 1 and w.prompt_tokens() == 51
    assert [r.hash_ids for r in w.requests] == [(0, 2), (3, 4)]


def test_window_cuts_outputs_to_the_context_and_the_cap():
    trace = [req(0, 512 * 60, [0] * 60, osl=500), req(1, 512, [1], osl=500)]
    w = kr.select_window(trace, 0, 1, 1.0, 16, context=1000)
    assert [(r.input_length, r.output_length) for r in w.requests] == [(960, 40), (16, 500)]
    w = kr.select_window(trace, 0, 1, 1.0, 16, context=1000, max_output=8)
    assert [r.output_length for r in w.requests] == [8, 8]
    with pytest.raises(ValueError):
        kr.select_window(trace, 0, 1, 0.0, 16, context=1000)


def test_unbounded_share_counts_full_blocks_seen_before():
    w = kr.Window((req(0, 40, [1, 2, 3]),  # 2 full blocks (1, 2) + 8 tokens of block 3: nothing seen yet
                req(1, 48, [1, 2, 3]),  # 1 and 2 seen; 3 was only a partial block before → not cached
                req(2, 32, [1, 9]),  # 1 seen, 9 new
                req(3, 48, [1, 2, 3])),  # now all three were seen in full blocks
               block_size=16, dropped=0)
    assert kr.unbounded_share(w) == pytest.approx((32 + 16 + 48) / (40 + 48 + 32 + 48))
    assert kr.working_set_tokens(w) == 4 * 16  # blocks 1, 2, 3, 9
    assert kr.unbounded_share(kr.Window((), 16, 0)) == 0.0


def test_the_vendored_trace_window(tmp_path):
    trace = kr.load_trace(ROOT / "tests" / "data" / "mooncake_conversation_first_2min.jsonl")
    w = kr.select_window(trace, 0, 60, 2.5, 16, context=1024)
    assert w.requests and all(r.input_length < 1024 and r.input_length + r.output_length <= 1024 for r in w.requests)
    assert 0 < kr.unbounded_share(w) < 1
    lines = kr.write_window(w, tmp_path / "w.jsonl").read_text().splitlines()
    assert len(lines) == len(w.requests)
    assert set(json.loads(lines[0])) == {"timestamp", "input_length", "output_length", "hash_ids"}


METRICS_BEFORE = """# HELP pdserve_tokens_total Tokens processed
# TYPE pdserve_tokens_total counter
pdserve_tokens_total{kind="prompt",service="router"} 100.0
pdserve_tokens_total{kind="cached_prompt",service="router"} 10.0
# TYPE pdserve_kv_push_bytes_total counter
pdserve_kv_push_bytes_total{transport="tcp"} 1000.0
# TYPE pdserve_prefix_cache_hit_tokens_total counter
"""
METRICS_AFTER = """# TYPE pdserve_tokens_total counter
pdserve_tokens_total{kind="prompt",service="router"} 1100.0
pdserve_tokens_total{kind="cached_prompt",service="router"} 310.0
pdserve_tokens_total{kind="prompt",service="prefill"} 7.0
# TYPE pdserve_kv_push_bytes_total counter
pdserve_kv_push_bytes_total{transport="tcp"} 41000.0
# TYPE pdserve_prefix_cache_hit_tokens_total counter
pdserve_prefix_cache_hit_tokens_total{service="prefill",tier="device"} 200.0
pdserve_prefix_cache_hit_tokens_total{service="prefill",tier="host"} 50.0
pdserve_decode_follow_up_kv_blocks_total{source="pushed"} 4.0
pdserve_decode_follow_up_kv_blocks_total{source="reused"} 20.0
weird line without value
"""


def test_metrics_deltas_and_na():
    before, after = [kr.parse_metrics(METRICS_BEFORE)], [kr.parse_metrics(METRICS_AFTER)]
    assert kr.metric_delta(before, after, "pdserve_tokens_total", service="router", kind="prompt") == 1000
    assert kr.metric_delta(before, after, "pdserve_prefix_cache_hit_tokens_total", tier="host") == 50
    assert kr.metric_delta(before, after, "pdserve_decode_kv_blocks_total", source="pushed") is None  # not exported
    row = kr.Row("prefix-cache", requests=4)
    kr.fill_metrics(row, before, after)
    assert row.prompt_tokens == 1000 and row.cache_share == pytest.approx(0.3)
    assert row.tier_share == {"device": pytest.approx(0.2), "host": pytest.approx(0.05)}
    assert row.decode_reuse_share is None  # no decode sample: n/a
    assert row.push_bytes_per_request == 10_000
    assert row.blocks_pushed is None and row.blocks_reused is None
    assert row.follow_up_fewer == pytest.approx(6.0)  # 24 blocks of follow-ups, 4 pushed (none before)


def test_label_values_with_escapes_parse():
    s = kr.parse_metrics('m_total{a="x\\"y",b="z"} 3\n')
    assert s.samples == {("m_total", (("a", 'x\\"y'), ("b", "z"))): 3.0}


def test_configs_missing_flags_and_goals():
    cs = kr.configs(["no-prefix-cache", "prefix-cache", "small-pool", "small-pool+tier"], 1024, 4096)
    assert cs[3] == kr.Config("small-pool+tier", ("--kv-cache-tokens", "1024", "--kv-tier-tokens", "4096"))
    help_text = "  --no-prefix-cache     no prefix cache\n  --kv-cache-tokens-x  other\n"
    assert [kr.missing_flags(c, help_text) for c in cs] == [[], [], ["--kv-cache-tokens"],
                                                         ["--kv-cache-tokens", "--kv-tier-tokens"]]
    with pytest.raises(ValueError, match="unknown"):
        kr.configs(["bogus"], 1, 1)
    rows = [kr.Row("no-prefix-cache", ttft_p90_ms=900.0, push_bytes_per_request=5000.0, cache_share=0.0),
            kr.Row("prefix-cache", ttft_p90_ms=300.0, push_bytes_per_request=500.0, cache_share=0.2,
                   follow_up_fewer=6.0),
            kr.Row("small-pool+tier", skipped="pdserve up has no --kv-tier-tokens")]
    g = kr.goals(rows, unbounded=0.2)
    assert [x.value for x in g] == [pytest.approx(1.0), pytest.approx(3.0), pytest.approx(6.0), None]
    assert "met" in g[0].line() and "n/a" in g[3].line()


def test_aiperf_export_parsing():
    data = {"completed_request_count": {"unit": "requests", "avg": 11.0},
            "time_to_first_token": {"unit": "ms", "avg": 120.0, "p50": 110.0, "p90": 178.0},
            "inter_token_latency": {"unit": "ns", "p50": 7_000_000.0},
            "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 4.0},
            "benchmark_duration": {"unit": "sec", "avg": 5.5},
            "error_summary": [{"error_details": {"code": 400}, "count": 2}]}
    s = parse_aiperf_export(data)
    assert (s.requests, s.errors, s.ttft_p50_ms, s.ttft_p90_ms) == (11, 2, 110.0, 178.0)
    assert s.tpot_p50_ms == pytest.approx(7.0) and s.duration_s == pytest.approx(5.5) and s.client_cache_pct == 4.0
    assert parse_aiperf_export({}).ttft_p50_ms is None


def test_hf_cache_entry_for_a_local_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_AIPERF_HF_HOME", str(tmp_path / "hf"))
    model = tmp_path / "tok-model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "config.json").write_text("{}")
    name, env = hf_tokenizer_env(model)
    assert name == "pdserve/tok-model" and env["HF_HUB_OFFLINE"] == "1"
    repo = tmp_path / "hf" / "hub" / "models--pdserve--tok-model"
    rev = (repo / "refs" / "main").read_text()
    assert len(rev) == 40 and sorted(p.name for p in (repo / "snapshots" / rev).iterdir()) == \
        ["config.json", "tokenizer.json"]
    (model / "tokenizer.json").write_text('{"changed": 1}')
    assert hf_tokenizer_env(model)[1] == env and (repo / "refs" / "main").read_text() != rev


def test_report_with_skipped_rows_and_na(tmp_path):
    rows = [kr.Row("no-prefix-cache", requests=3, errors=0, ttft_p50_ms=10.0, ttft_p90_ms=20.0, cache_share=0.0,
                   tier_share={"device": None, "host": None}),
            kr.Row("prefix-cache", requests=3, errors=1, ttft_p50_ms=5.0, cache_share=0.1,
                   tier_share={"device": 0.08, "host": 0.02}, push_bytes_per_request=2048.0),
            kr.Row("small-pool", skipped="skipped: pdserve up has no --kv-cache-tokens")]
    text = kr.report_table(rows, unbounded=0.2)
    assert "prefix-cache |" in text and "skipped: pdserve up has no --kv-cache-tokens" in text
    assert "0.50" in text and "2 KiB" in text and "n/a" in text
    assert kr.plot(tmp_path / "p.png", rows, 0.2, "t").stat().st_size > 0
