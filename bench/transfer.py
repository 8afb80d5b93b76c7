"""KV transfer throughput: one 4096-token prompt in the real DeepSeek-V3.2 671B layout.

    python bench/transfer.py [--tokens 4096] [--repeat 3]

61 layers × (576 × 2 bytes MLA latent+rope in bf16 + 128 + 4 bytes FP8 index key + scale) per token,
pushed block by block into a leased destination pool over the built-in TCP transport, over Mooncake
(protocol tcp, loopback) and, as the yardstick, one plain loopback socket moving the same bytes from
one contiguous buffer. Prints GB/s and the ratio to the socket; saves bench/out/transfer.png.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import socket
import threading
import time

import torch

from bench.common import OUT, bar_plot, table
from shared.kvcache import KVCache, KVLayout
from shared.kvcache.lease import LeaseTable
from shared.transfer import TcpReceiver, make_sender
from shared.transfer.base import cache_kinds
from shared.transfer.mooncake import MooncakeReceiver, mooncake_available

LAYOUT_671B = KVLayout(num_layers=61, block_size=64, kv_lora_rank=512, rope_dim=64, index_head_dim=132,
                       dtype=torch.bfloat16, index_dtype=torch.uint8)


def push_once(transport: str, src: KVCache, receiver, leases: LeaseTable, tokens: int) -> float:
    lease = leases.reserve("bench", tokens)
    blocks = list(range(len(lease.blocks)))
    t0 = time.perf_counter()
    push = make_sender(transport, src).open(receiver.destination(lease)) if transport == "tcp" else \
        _mooncake_sender(src).open(receiver.destination(lease))
    for layer in range(src.layout.num_layers):
        push.send_layer(layer, blocks, 0)
    push.finish()
    dt = time.perf_counter() - t0
    leases.claim(lease.lease_id)
    dst = receiver.kv
    order = torch.tensor(lease.blocks)
    same = torch.equal(dst.mla.view(torch.int16)[:, order], src.mla.view(torch.int16)[:, blocks])  # bitwise
    if not (same and torch.equal(dst.index[:, order], src.index[:, blocks])):
        raise AssertionError(f"{transport}: received KV differs from the source")
    leases.ledger.drop_claimed(lease.blocks)  # claimed for the check above, used by no request
    return dt


_MC = {}


def _mooncake_sender(src: KVCache):
    if "s" not in _MC:
        _MC["s"] = make_sender("mooncake", src)
    return _MC["s"]


def plain_socket_once(nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()
    dst = bytearray(nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(dst), 0
        while got < nbytes:
            got += conn.recv_into(view[got:])
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(memoryview(src))
        conn.recv(1)
    dt = time.perf_counter() - t0
    thread.join()
    server.close()
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    layout = LAYOUT_671B
    n_blocks = -(-args.tokens // layout.block_size)
    nbytes = layout.bytes_per_token() * n_blocks * layout.block_size
    print(f"KV of {args.tokens} tokens: {layout.bytes_per_token_per_layer()} B/token/layer × {layout.num_layers} "
          f"layers = {nbytes / 1e6:.1f} MB", flush=True)
    src = KVCache(layout, n_blocks, torch.device("cpu"))
    src.mla.view(torch.int16).random_()
    src.index.random_()
    dst = KVCache(layout, n_blocks, torch.device("cpu"))
    leases = LeaseTable(dst.ledger, layout.block_size, layout.num_layers, cache_kinds(layout))
    tcp = TcpReceiver(dst, leases)
    receivers = {"built-in tcp": ("tcp", tcp)}
    if mooncake_available():
        receivers["mooncake (tcp)"] = ("mooncake", MooncakeReceiver(dst, tcp))
    results = {}
    for name, (transport, receiver) in receivers.items():
        times = []
        for i in range(args.repeat):
            times.append(push_once(transport, src, receiver, leases, args.tokens))
            print(f"  {name}: run {i + 1}/{args.repeat} {nbytes / times[-1] / 1e9:.2f} GB/s", flush=True)
        results[name] = min(times)
    times = []
    for i in range(args.repeat):
        times.append(plain_socket_once(nbytes))
        print(f"  plain socket: run {i + 1}/{args.repeat} {nbytes / times[-1] / 1e9:.2f} GB/s", flush=True)
    results["plain socket"] = min(times)
    base = nbytes / results["plain socket"]
    rows = [[name, f"{nbytes / 1e6:.1f}", f"{dt * 1e3:.1f}", f"{nbytes / dt / 1e9:.2f}", f"{nbytes / dt / base:.2f}x"]
            for name, dt in results.items()]
    print()
    print(table(["transport", "MB", "best ms", "GB/s", "vs socket"], rows))
    png = bar_plot(OUT / "transfer.png", f"KV push of {args.tokens} tokens, 671B layout (loopback)",
                   list(results), {"GB/s": [nbytes / dt / 1e9 for dt in results.values()]}, "GB/s")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
