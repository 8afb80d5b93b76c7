"""gRPC shell of a decode instance: Reserve → (KV pushed by prefill) → Decode stream → blocks freed.

    python -m decode_service --model DIR [--host 127.0.0.1] [--port 0] [--metrics-port 0]
                             [--kv-transport tcp|mooncake] [--lease-seconds 30]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from dataclasses import dataclass

import grpc
import torch

from shared import metrics
from shared.engine import EngineConfig, LLMEngine
from shared.engine.worker import FINISHED, EngineWorker
from shared.kvcache import OutOfBlocks
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from shared.rpc.service import build_server, sampling_from_proto, set_serving
from shared.transfer import TcpReceiver
from shared.transfer.base import cache_kinds

log = logging.getLogger("pdserve.decode")
SERVICE = "pdserve.v1.Decode"


@dataclass
class DecodeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    kv_transport: str = "tcp"
    kv_port: int = 0
    lease_seconds: float = 30.0
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_tokens: int = 65536
    max_num_seqs: int = 256


class DecodeServicer(internal_pb2_grpc.DecodeServicer):
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.engine = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, block_size=cfg.block_size,
                                             kv_cache_tokens=cfg.kv_cache_tokens, max_num_seqs=cfg.max_num_seqs))
        kv = self.engine.kv
        self.leases = LeaseTable(kv.allocator, cfg.block_size, kv.layout.num_layers, cache_kinds(kv.layout),
                                 cfg.lease_seconds)
        self.tcp = TcpReceiver(kv, self.leases, cfg.host, cfg.kv_port)
        self.receiver = self.tcp
        if cfg.kv_transport == "mooncake":
            from shared.transfer.mooncake import MooncakeReceiver

            self.receiver = MooncakeReceiver(kv, self.tcp, cfg.host)
        self.worker = EngineWorker(self.engine, "decode-engine")
        self._stop = threading.Event()
        threading.Thread(target=self._reaper, name="lease-reaper", daemon=True).start()
        metrics.KV_TOTAL_BLOCKS.labels("decode").set(kv.num_blocks)

    def _reaper(self) -> None:
        while not self._stop.wait(min(1.0, self.cfg.lease_seconds / 4)):
            if self.leases.expire():
                log.info("expired unused KV reservations")
            self._update_gauges()

    def _update_gauges(self) -> None:
        metrics.KV_FREE_BLOCKS.labels("decode").set(self.engine.kv.allocator.num_free)
        metrics.ACTIVE_LEASES.set(len(self.leases))
        metrics.RUNNING.labels("decode").set(len(self.engine.scheduler.running))

    def Reserve(self, request, context):  # noqa: N802 - gRPC method name
        if request.num_prompt_tokens <= 0 or request.max_tokens <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_prompt_tokens and max_tokens must be > 0")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.engine.max_model_len:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"max_tokens: prompt + max_tokens ({total}) exceeds the context {self.engine.max_model_len}")
        try:
            lease = self.leases.reserve(request.request_id, total)
        except OutOfBlocks as exc:
            metrics.REQUESTS.labels("decode", "rejected").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode KV pool full: {exc}")
        self._update_gauges()
        dest = self.receiver.destination(lease)
        return internal_pb2.ReserveResponse(destination=dest.to_proto(internal_pb2.KVDestination), dp_rank=0)

    def Release(self, request, context):  # noqa: N802
        released = self.leases.release(request.lease_id)
        self._update_gauges()
        return internal_pb2.ReleaseResponse(released=released)

    def GetLoad(self, request, context):  # noqa: N802
        sched = self.engine.scheduler
        return internal_pb2.LoadReport(running=len(sched.running), waiting=len(sched.waiting),
                                       free_blocks=self.engine.kv.allocator.num_free,
                                       total_blocks=self.engine.kv.num_blocks, active_leases=len(self.leases))

    def Decode(self, request, context):  # noqa: N802
        try:
            lease = self.leases.claim(request.lease_id)
        except LeaseError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        params = sampling_from_proto(request.sampling_params)
        rid = request.request_id or lease.request_id
        stream = self.worker.open_stream(rid)

        def admit(engine: LLMEngine):
            try:
                seq = engine.make_sequence(list(request.prompt_token_ids), params, rid)
            except ValueError:
                engine.kv.allocator.free(lease.blocks)
                raise
            seq.block_table = list(lease.blocks)
            if request.rng_state and params.seed is not None:
                seq.generator.set_state(torch.frombuffer(bytearray(request.rng_state), dtype=torch.uint8))
            return engine.add_prefilled(seq, request.first_token_id)

        try:
            self.worker.deliver(self.worker.call(admit).result())
        except ValueError as exc:
            self.worker._close_stream(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        context.add_callback(lambda: self.worker.abort(rid))
        reason = None
        while True:
            item = stream.get()
            if item is FINISHED:
                break
            reason = "stop" if item.finished and item.seq.finish_reason == "stop" else (
                item.seq.finish_reason if item.finished else None)
            metrics.TOKENS.labels("decode", "output").inc()
            yield internal_pb2.DecodeResponse(token_ids=[item.token_id], text=item.text, finish_reason=reason or "")
        metrics.REQUESTS.labels("decode", reason or "abort").inc()
        self._update_gauges()
        if reason is None and context.is_active():
            yield internal_pb2.DecodeResponse(finish_reason="abort")

    def close(self) -> None:
        self._stop.set()
        self.worker.stop()
        self.receiver.close()
        if self.receiver is not self.tcp:
            self.tcp.close()


def parse_args(argv: list[str] | None = None) -> DecodeConfig:
    p = argparse.ArgumentParser(prog="python -m decode_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--kv-transport", choices=["tcp", "mooncake"], default="tcp")
    p.add_argument("--kv-port", type=int, default=0, help="TCP KV receiver port (0 = free port)")
    p.add_argument("--lease-seconds", type=float, default=30.0, help="unused reservations expire after this")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=256)
    a = p.parse_args(argv)
    return DecodeConfig(a.model, a.host, a.port, a.metrics_port, a.kv_transport, a.kv_port, a.lease_seconds,
                        a.dtype, a.block_size, a.kv_cache_tokens, a.max_num_seqs)


def serve(cfg: DecodeConfig) -> tuple[grpc.Server, int, DecodeServicer]:
    servicer = DecodeServicer(cfg)
    server, port, health = build_server(
        cfg.host, cfg.port, [lambda s: internal_pb2_grpc.add_DecodeServicer_to_server(servicer, s)], [SERVICE])
    server.start()
    set_serving(health, [SERVICE])
    return server, port, servicer


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    cfg = parse_args(argv)
    metrics.start_metrics_server(cfg.metrics_port)
    server, port, servicer = serve(cfg)
    print(f"decode_service listening on {cfg.host}:{port} (kv {servicer.receiver.transport})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
    servicer.close()
    sys.exit(0)
