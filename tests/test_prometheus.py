"""Metrics through a real Prometheus server (Debian package `prometheus`, installed by the Makefile):
the test starts it on loopback with a 1 s scrape interval and a generated config, runs requests
through a cluster with a dp=2 decode instance, and queries Prometheus' HTTP API. Every expression
of the Grafana dashboard parses there and names only metrics the services export."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from router.cluster import Cluster, free_port
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers import wait_for

DASHBOARD = Path(__file__).resolve().parents[1] / "helm" / "pdserve" / "dashboards" / "pdserve.json"
GRAFANA_VARS = {"$__rate_interval": "1m", "$ttft_sla": "2.5", "$tpot_sla": "0.1"}
REQUESTS, TOKENS = 6, 4


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:  # `make test` installs it (Makefile system-deps): missing is a failure, never a skip
        pytest.fail("prometheus is not installed: run `make test` (it installs the Debian package)")
    return path


def _query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _value(base: str, expr: str) -> float | None:
    result = _query(base, expr)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_every_service(served_model, prometheus_bin, tmp_path):
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs",
                 extra_decode=["--metrics-port", "0", "--dp", "2"], extra_prefill=["--metrics-port", "0"],
                 extra_router=["--metrics-port", "0"]) as c:
        targets = {role: f"127.0.0.1:{c.metrics_ports[addr]}"
                   for role, addr in (("router", c.address), ("prefill", c.prefill_addrs[0]),
                                      ("decode", c.decode_addrs[0]))}
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": role, "static_configs": [{"targets": [t]}]}
                                     for role, t in targets.items()]}
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        port = free_port()  # Prometheus cannot report a port it picked itself
        base = f"http://127.0.0.1:{port}"
        prom = subprocess.Popen([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
        try:
            def ready() -> bool:
                try:
                    return urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200
                except OSError:
                    return False

            assert wait_for(ready, timeout=60), (tmp_path / "prometheus.log").read_text()[-2000:]
            sp = generation_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
            with c.channel(c.address) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                for i in range(REQUESTS):
                    list(stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[3 + i, 7, 9],
                                                                      sampling_params=sp), timeout=60))

            def scraped() -> bool:  # every target scraped since the requests ended
                up = {r["metric"]["job"]: r["value"][1] for r in _query(base, "up")}
                return (up == {k: "1" for k in targets}
                        and _value(base, 'sum(pdserve_requests_total{service="router",status="OK"})') == REQUESTS
                        and _value(base, 'sum(pdserve_tokens_total{service="decode",kind="output"})')
                        == REQUESTS * TOKENS)

            assert wait_for(scraped, timeout=30), _query(base, "up")
            assert _value(base, 'sum(pdserve_tokens_total{service="prefill",kind="prompt"})') == REQUESTS * 3
            ttft = _value(base, "histogram_quantile(0.5, sum by (le) (pdserve_router_ttft_seconds_bucket))")
            assert ttft is not None and 0 < ttft < 60 and math.isfinite(ttft)
            assert _value(base, "sum(pdserve_router_ttft_seconds_count)") == REQUESTS
            ranks = {r["metric"]["rank"]: float(r["value"][1])
                     for r in _query(base, 'pdserve_kv_blocks_total{service="decode"}')}
            assert set(ranks) == {"0", "1"} and all(v > 0 for v in ranks.values())  # every DP rank, from rank 0
            used = _query(base, 'pdserve_kv_blocks_used{service="decode"}')
            assert sum(float(r["value"][1]) for r in used) == 0  # every request finished: nothing held
            assert _value(base, "sum(pdserve_kv_push_bytes_total)") == _value(
                base, "sum(pdserve_kv_received_bytes_total)") > 0
            assert _value(base, 'sum(pdserve_router_instance_up)') == 2

            exported = set(_query_names(base))
            for panel in json.loads(DASHBOARD.read_text())["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"]
                    for var, value in GRAFANA_VARS.items():
                        expr = expr.replace(var, value)
                    _query(base, expr)  # parses and evaluates (a bad expression is a 400)
                    names = {re.sub(r"_(bucket|count|sum)$", "", n) for n in re.findall(r"pdserve_[a-z0-9_]+", expr)}
                    assert names <= exported, (panel["title"], names - exported)
        finally:
            prom.terminate()
            prom.wait(30)


def _query_names(base: str) -> list[str]:
    body = json.loads(urllib.request.urlopen(f"{base}/api/v1/label/__name__/values", timeout=10).read())
    names = body["data"]
    # histogram and counter families: the dashboard names the family, Prometheus stores the series
    return [re.sub(r"_(bucket|count|sum)$", "", n) for n in names] + names
