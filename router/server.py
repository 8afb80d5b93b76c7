"""The router's process: the public `pdserve.v1.Generation/Generate` (router.servicer) on gRPC, the
OpenAI-compatible HTTP API beside it (router.http), KServe v2 gRPC on --kserve-port (router.kserve), the pools'
watchers (router.pools), readiness, autoscaling and the drain on SIGTERM.

    python -m router --model DIR --prefill HOST:PORT[,HOST:PORT...] --decode HOST:PORT[,...]
                     [--host 127.0.0.1] [--port 50051] [--metrics-port N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import time

import grpc

from router.autoscale import Autoscaler, Target, observe, read_counters
from router.config import RouterConfig
from router.pools import EndpointList
from router.request import lenient
from router.servicer import GenerationServicer
from shared import metrics
from shared.config import parse_flags
from shared.rpc.pdserve.v1 import generation_pb2
from shared.rpc.service import Lifecycle, die_with_launcher, start_server, write_port_file

log = logging.getLogger("pdserve.router")
SERVICE = "pdserve.v1.Generation"
NOT_SERVING_CHECK_S = 0.02  # how often a router that reaches no pair yet looks again (cheap: flags of its views)
EXTRA_PORTS = {"kserve": "KServe v2 gRPC (Open Inference Protocol)",
               "epp": "Gateway API Inference Extension endpoint picker (Envoy ext_proc)"}


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return parse_flags(RouterConfig, p, argv)


async def serve(cfg: RouterConfig, endpoints: EndpointList | None = None) -> tuple[grpc.aio.Server, int, Lifecycle]:
    """The router's gRPC server (Generate; with --kserve-port / --epp-port those services on their own ports;
    `endpoints`: the routers the endpoint picker picks from)."""
    servicer = GenerationServicer(cfg)

    def register(server: grpc.aio.Server) -> None:
        handler = grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=lenient(generation_pb2.GenerateRequest.FromString),
            response_serializer=generation_pb2.GenerateResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Generate": handler}),))

    handlers = [register]
    # The HTTP API, KServe and the endpoint picker are imported only where configured: FastAPI, pydantic and
    # Envoy's protos took 0.4 s of the 0.7 s a router spent importing (every start and restart of one).
    if cfg.kserve_port is not None:  # the Open Inference Protocol on its own port (the same server)
        from router.kserve import KServeServicer, register_kserve

        kserve_servicer = KServeServicer(servicer, cfg.model_name, servicer.model_config.model_type)
        handlers.append(lambda server: register_kserve(server, kserve_servicer))
    services = [SERVICE]
    if cfg.epp_port is not None:  # the inference extension's endpoint picker (Envoy ext_proc), its own port
        from router.epp import SERVICE as EPP_SERVICE
        from router.epp import EndpointPicker, register_epp

        picker = EndpointPicker(servicer, endpoints if endpoints is not None else EndpointList(cfg.epp_endpoints))
        handlers.append(lambda server: register_epp(server, picker))
        services.append(EPP_SERVICE)  # its health: the router's readiness (the protocol's service check)
    extra = {"kserve": cfg.kserve_port, "epp": cfg.epp_port}
    extra = {name: p for name, p in extra.items() if p is not None}
    server, port, life = await start_server(cfg.host, cfg.port, handlers, services, servicer.credentials,
                                            public=True, extra_ports=list(extra.values()))
    life.servicer = servicer
    life.named_ports = dict(zip(extra, life.extra_ports, strict=True))
    return server, port, life


async def _report_readiness(servicer: GenerationServicer, life: Lifecycle, period: float) -> None:
    """The router's health: SERVING only while it reaches at least one prefill and one decode instance
    (every pod of a deployment starts at once: a router must not take traffic it cannot place)."""
    serving = None
    await life.set(False)
    while not servicer.draining:  # a draining router stays NOT_SERVING
        reachable = any(i.view.up for i in servicer.prefill.instances) and \
            any(i.view.up for i in servicer.decode.instances)
        if reachable != serving:
            await life.set(reachable)
            serving = reachable
        await asyncio.sleep(period / 2 if serving else min(period / 2, NOT_SERVING_CHECK_S))


async def _autoscale(servicer: GenerationServicer, controller: Autoscaler, period: float, window: float) -> None:
    """Every `period` s: the load of the last `window` s from this router's counters → the controller →
    each pool's desired size, exported for whatever scales the pools (pdserve up, KEDA)."""
    desired = Target(len(servicer.prefill.instances), len(servicer.decode.instances))
    readings = collections.deque([(time.monotonic(), read_counters(metrics.REGISTRY.get_sample_value))])
    while True:
        metrics.DESIRED.labels("prefill").set(desired.prefill)
        metrics.DESIRED.labels("decode").set(desired.decode)
        await asyncio.sleep(period)
        now = time.monotonic()
        readings.append((now, read_counters(metrics.REGISTRY.get_sample_value)))
        while len(readings) > 2 and readings[1][0] <= now - window:
            readings.popleft()
        (t_prev, prev), cur = readings[0], readings[-1][1]
        obs = observe(prev, cur, now - t_prev)
        wanted = controller.decide(now, obs, desired)
        if wanted != desired:
            log.info("autoscale: %.2f req/s (prompt %.0f, output %.0f tokens): prefill %d → %d, decode %d → %d",
                     obs.rate, obs.mean_prompt_tokens, obs.mean_output_tokens, desired.prefill, wanted.prefill,
                     desired.decode, wanted.decode)
        desired = wanted


async def _serve_until_stopped(cfg: RouterConfig) -> None:
    endpoints = EndpointList(cfg.epp_endpoints)
    _, port, life = await serve(cfg, endpoints)
    servicer = life.servicer
    watchers = [asyncio.create_task(pool.watch_health()) for pool in (servicer.prefill, servicer.decode)]
    watchers += [asyncio.create_task(pool.poll_loads(cfg.load_interval, servicer.metadata))
                 for pool in (servicer.prefill, servicer.decode)]
    watchers += [asyncio.create_task(pool.discover(cfg.discovery_interval))
                 for pool in (servicer.prefill, servicer.decode) if pool.names or pool.files]
    watchers.append(asyncio.create_task(_report_readiness(servicer, life, cfg.load_interval)))
    watchers.append(asyncio.create_task(servicer.buses.keep_open(servicer.decode, cfg.load_interval)))
    if (controller := cfg.autoscaler(servicer.perf)) is not None:
        watchers.append(asyncio.create_task(_autoscale(servicer, controller, cfg.autoscale_period,
                                                       cfg.autoscale_window)))
    servicer.background.update(watchers)  # referenced for the life of the process
    http = gate = None
    if cfg.http_port is not None:  # up before the port file appears: a launcher may call both at once
        from router.drain import DrainGate
        from router.http import OpenAIFrontDoor, read_api_keys, start_http

        front = OpenAIFrontDoor(servicer, cfg.model_name,
                                read_api_keys(cfg.api_key_file), cfg.http_max_body_bytes, cfg.http_max_prompts)
        gate = DrainGate(front.app)
        http, http_task, http_port = await start_http(gate, cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key)
        scheme = "https" if cfg.tls_cert else "http"
        log.info("OpenAI-compatible HTTP API at %s://%s:%d/v1", scheme, cfg.host, http_port)
        if cfg.port_file:
            write_port_file(f"{cfg.port_file}.http", http_port)
    if not cfg.epp_endpoints and http is not None:
        endpoints.static = [f"{cfg.host}:{http_port}"]  # the endpoint picker's default: this router
    servicer.background.add(asyncio.create_task(endpoints.discover(cfg.discovery_interval)))
    for name, bound in life.named_ports.items():
        log.info("%s at %s:%d", EXTRA_PORTS[name], cfg.host, bound)
        if cfg.port_file:
            write_port_file(f"{cfg.port_file}.{name}", bound)
    life.announce(port, cfg.port_file, f"router listening on {cfg.host}:{port}")

    async def refuse_new() -> None:
        servicer.draining = True
        if gate is not None:
            gate.draining = True
        log.info("draining: %d requests in flight (%d over HTTP), up to %.0f s", servicer.in_flight,
                 gate.in_flight if gate is not None else 0, cfg.drain_seconds)

    async def drain_http(deadline: float) -> None:
        if http is not None:
            if not await gate.drained(deadline):
                log.warning("drain: %d HTTP requests still in flight at --drain-seconds; cutting them", gate.in_flight)
            http.should_exit = True
            await http_task

    await life.run(cfg.drain_seconds, on_stop=refuse_new, alongside=drain_http)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    die_with_launcher()
    cfg = parse_args(argv)
    metrics.start_metrics_server(cfg.metrics_port, cfg.host, cfg.port_file)
    asyncio.run(_serve_until_stopped(cfg))


__all__ = ["SERVICE", "GenerationServicer", "RouterConfig", "main", "parse_args", "serve"]
