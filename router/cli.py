"""`pdserve` command line.

    pdserve up [--model DIR] [--num-prefill M] [--num-decode N] [--port 50051] [--kv-transport tcp|mooncake]
               [--quantization w8a8] [--kv-cache-dtype int8] [--offload-layers 2-10] [--share-weights-dir DIR]
        all-in-one on loopback: router + M prefill + N decode subprocesses; default model is the
        demo model (models/demo-v32; the random tiny model where it is absent); Ctrl-C stops all.
    pdserve generate "text" | --prompt-token-ids 1 2 3 [--chat [--thinking]] [--address 127.0.0.1:50051] ...
        streams one request to the terminal (--chat: the text as a user message, chat-encoded).
    pdserve chat [--system TEXT] [--thinking] [--address 127.0.0.1:50051]
        interactive multi-turn chat.
    pdserve certs --out DIR [--host H ...]
        a cluster CA + node certificate for the services' --tls-cert/--tls-key/--tls-ca.
    pdserve profile [--router ADDR | --model DIR] [--out profile.json]
        measures prefill and decode curves (through a running router, or in-process) → the router's PerfModel.
    pdserve plan --rate R --ttft-p90 MS --tpot-p90 MS [--profile profile.json] [--isl 128] [--osl 128] ...
        M prefill / N decode instances for the workload (analytic, then simulated with the router's policy).
    pdserve convert --src DIR --dst DIR --format w8a8 [--ep N] [--max-shard-gb 5]
        offline W8A8 INT8 conversion of an FP8 / bf16 checkpoint, tensor by tensor (--ep: per-rank expert files).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from router.autoscale import AutoscaleConfig, Bounds
from router.cluster import DEFAULT_MODEL, Cluster, cluster_from_deployment, default_model
from router.config import RouterConfig
from router.deploy import Deployment
from router.kv_store import AUTO, StoreMaster
from router.perf import PerfModel, profile_engine, profile_served
from router.planner import Dist, Workload, run_plan
from router.supervise import SupervisorConfig, supervise_cluster
from shared.config import DecodeConfig, PrefillConfig, ServiceConfig, add_flags, check_bounds, flag_name, from_flags
from shared.protocol.chat import EOS, split_reasoning
from shared.rpc.certs import make_cluster_certs
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc

# the engine flags `pdserve up` takes for prefill and decode alike (declared on ServiceConfig)
UP_ENGINE_FLAGS = ("kv_transport", "mooncake_protocol", "mooncake_devices", "dtype", "indexer_numerics",
                   "quantization", "kv_cache_dtype", "offload_layers", "offload_buffers", "share_weights_dir",
                   "speculative", "num_speculative_tokens", "kv_cache_tokens", "kv_tier_tokens", "kv_tier_dir",
                   "kv_store_master", "block_size")



def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """`--config FILE` (the deployment description the Helm chart also reads), else the flags."""
    if args.config:
        return Deployment.from_yaml(args.config)
    return Deployment.from_dict({
        "engine": {"dtype": args.dtype, "indexerNumerics": args.indexer_numerics, "kvTransport": args.kv_transport,
                   "blockSize": args.block_size,
                   "mooncake": {"protocol": args.mooncake_protocol, "devices": args.mooncake_devices},
                   "quantization": args.quantization, "kvCacheDtype": args.kv_cache_dtype,
                   "offloadLayers": args.offload_layers, "offloadBuffers": args.offload_buffers,
                   "shareWeightsDir": args.share_weights_dir, "speculative": args.speculative,
                   "numSpeculativeTokens": args.num_speculative_tokens, "kvTierTokens": args.kv_tier_tokens,
                   "kvTierDir": args.kv_tier_dir, "kvStoreMaster": args.kv_store_master},
        "prefill": {"instances": args.num_prefill, "cp": args.prefill_cp, "tp": args.prefill_tp,
                    "ep": args.prefill_ep, "layerSharding": args.layer_sharding, "noPrefixCache": args.no_prefix_cache,
                    "noKvFetch": args.no_kv_fetch,
                    "kvCacheTokens": args.kv_cache_tokens},
        "decode": {"instances": args.num_decode, "dp": args.decode_dp, "tp": args.decode_tp, "ep": args.decode_ep,
                   "layerSharding": args.layer_sharding, "noPrefixCache": args.no_prefix_cache,
                   "speculativeMaxDraftTokens": args.speculative_max_draft_tokens, "enforceEager": args.enforce_eager,
                   "kvCacheTokens": args.kv_cache_tokens},
        "router": {"port": args.port, "localPrefillTokens": args.local_prefill_tokens,
                   "overflowPrefillTokens": args.overflow_prefill_tokens, "httpPort": args.http_port,
                   "kservePort": args.kserve_port,
                   "ttftSloMs": args.ttft_slo_ms, "tpotSloMs": args.tpot_slo_ms, "drainSeconds": args.drain_seconds,
                   "apiKeyFile": args.api_key_file,
                   "servedModelName": args.served_model_name, "chatMaxTokens": args.chat_max_tokens,
                   "profile": args.profile, "noKvFetch": args.no_kv_fetch, "noTokenBus": args.no_token_bus},
        "tls": {"enabled": args.tls}})


def cluster_from_args(args: argparse.Namespace, log_dir: Path | None = None) -> Cluster:
    """The Cluster `pdserve up` starts from its parsed flags (not started yet); ValueError naming a bad one."""
    dep = deployment_from_args(args)
    model = args.model or (dep.model.path if args.config and Path(dep.model.path).is_dir() else None) \
        or default_model()
    cluster = cluster_from_deployment(dep, model, log_dir)
    if args.config:  # the description's router files and model name, given (or replaced) on the command line
        for flag, value in (("--api-key-file", args.api_key_file), ("--profile", args.profile),
                            ("--served-model-name", args.served_model_name)):
            if value is not None:
                cluster.extra_router += [flag, value]
    cluster.fork_services = args.fork_server
    if args.epp_port is not None:  # the chart runs the endpoint picker as its own Deployment (gateway.enabled)
        cluster.extra_router += ["--epp-port", str(args.epp_port)]
    if args.autoscale:  # the router decides the pools' sizes, the cluster follows (LocalAutoscaler)
        Bounds.parse(args.autoscale)
        cluster.elastic = True
        cluster.extra_router += ["--autoscale", args.autoscale, "--autoscale-period", str(args.autoscale_period),
                                 "--autoscale-down-after", str(args.autoscale_down_after),
                                 "--autoscale-headroom", str(args.autoscale_headroom),
                                 "--autoscale-burst-sigmas", str(args.autoscale_burst_sigmas),
                                 "--autoscale-window", str(args.autoscale_window),
                                 "--autoscale-lead", str(args.autoscale_lead)]
    return cluster


def cmd_up(args: argparse.Namespace) -> None:
    master: StoreMaster | None = None
    try:
        if args.kv_store_master == AUTO and not args.config:  # a Mooncake Store master for this start
            if not args.kv_tier_tokens:
                raise ValueError("--kv-store-master: the store holds the second tier: give --kv-tier-tokens too")
            master = StoreMaster.start(Path(args.log_dir) if args.log_dir else None)
            args.kv_store_master = master.address
        autoscaling = from_flags(AutoscaleConfig, args)
        check_bounds(autoscaling, flag_name)  # before anything starts: the router would refuse them later
        cluster = cluster_from_args(args, Path(args.log_dir) if args.log_dir else None)
        restarts = from_flags(SupervisorConfig, args)
    except (ValueError, OSError) as exc:  # a bad flag or description: one line naming the key, not a traceback
        if master:
            master.stop()
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        supervise_cluster(cluster, restarts, autoscaling)
    finally:
        if master:
            master.stop()


def sampling_args(args: argparse.Namespace) -> generation_pb2.SamplingParams:
    sp = generation_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, ignore_eos=args.ignore_eos, stop=args.stop or [],
                                       skip_special_tokens=not args.keep_special_tokens)
    if args.seed is not None:
        sp.seed = args.seed
    return sp


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    common = {"sampling_params": sampling_args(args), "priority": args.priority,
              "sla": generation_pb2.Sla(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)}
    if args.chat:  # the prompt as one user turn, rendered with the model's chat encoding by the router
        return generation_pb2.GenerateRequest(messages=[generation_pb2.ChatMessage(role="user", content=args.prompt)],
                                              thinking=args.thinking, **common)
    return generation_pb2.GenerateRequest(prompt=args.prompt or "", prompt_token_ids=args.prompt_token_ids or [],
                                          **common)


def client_channel(args: argparse.Namespace) -> grpc.Channel:
    """The router's public port: plain, or TLS verified with --tls-ca (no client certificate needed)."""
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)
    return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()))


def cmd_certs(args: argparse.Namespace) -> None:
    files = make_cluster_certs(args.out, args.host or [], args.days)
    print(f"CA {files.ca}\ncertificate {files.cert}\nkey {files.key}\nservice flags: {' '.join(files.flags())}")


def cmd_generate(args: argparse.Namespace) -> None:
    with client_channel(args) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        t0, first, ids = time.perf_counter(), None, []
        try:
            for msg in stub.Generate(build_request(args), timeout=args.timeout):
                if first is None and msg.token_ids:
                    first = time.perf_counter()
                ids.extend(msg.token_ids)
                print(msg.text if msg.text else "".join(f" {t}" for t in msg.token_ids), end="", flush=True)
                if msg.finish_reason:
                    print(f"\n[finish={msg.finish_reason} prompt_tokens={msg.usage.prompt_tokens} "
                          f"cached_prompt_tokens={msg.usage.cached_prompt_tokens} "
                          f"completion_tokens={msg.usage.completion_tokens} "
                          f"ttft={1e3 * ((first or t0) - t0):.1f}ms]")
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            sys.exit(1)
    if args.show_ids:
        print("token ids:", ids)


def cmd_chat(args: argparse.Namespace, read: Callable[[str], str] = input) -> None:
    """Interactive chat: each turn sends the whole conversation (DeepSeek-V3.2 chat encoding on the
    router); in thinking mode the reasoning is shown dimmed and dropped from the history."""
    system = [generation_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
    history = list(system)
    args.keep_special_tokens = args.keep_special_tokens or args.thinking  # </think> separates the answer
    print("pdserve chat: /reset clears the conversation, /exit (or Ctrl-D) quits", flush=True)
    with client_channel(args) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while True:
            try:
                line = read("you> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return
            if line.strip() in ("/exit", "/quit"):
                return
            if line.strip() == "/reset":
                history = list(system)
                continue
            if not line.strip():
                continue
            history.append(generation_pb2.ChatMessage(role="user", content=line))
            req = generation_pb2.GenerateRequest(messages=history, thinking=args.thinking,
                                                 sampling_params=sampling_args(args))
            text = ""
            print("assistant> ", end="", flush=True)
            try:
                for msg in stub.Generate(req, timeout=args.timeout):
                    print(msg.text, end="", flush=True)
                    text += msg.text
            except grpc.RpcError as exc:
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                history.pop()
                continue
            print(flush=True)
            reasoning, answer = split_reasoning(text) if args.thinking else ("", text)
            history.append(generation_pb2.ChatMessage(role="assistant", content=answer.replace(EOS, "")))


def cmd_profile(args: argparse.Namespace) -> None:

    if args.router:
        args.address = args.router
        perf = profile_served(args.router, lengths=args.prompt_lengths, open_channel=lambda _: client_channel(args))
    else:
        perf = profile_engine(args.model or default_model(), args.dtype)
    perf.save(args.out)
    print(f"wrote {args.out}")


def _prompt_lengths(text: str) -> tuple[int, ...]:
    """`pdserve profile --prompt-lengths`: at least three positive token counts (the prefill curve has three terms)."""
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts") from None
    if len(lengths) < 3 or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least three positive lengths (the curve has three terms)")
    return lengths


def cmd_plan(args: argparse.Namespace) -> None:

    perf = PerfModel.load(args.profile) if args.profile else PerfModel()
    w = Workload(args.rate, Dist.parse(args.isl), Dist.parse(args.osl), args.ttft_p90 / 1e3, args.tpot_p90 / 1e3,
                 args.attainment)
    if run_plan(perf, w, args.max_m, args.max_n, args.dp, args.requests, args.seed, args.plot) is None:
        sys.exit(1)


def cmd_convert(args: argparse.Namespace) -> None:
    from shared.loader.convert import convert_checkpoint  # torch, loaded by this command only

    try:
        print(convert_checkpoint(args.src, args.dst, args.format, args.ep, args.max_shard_gb, progress=True))
    except (ValueError, KeyError, OSError) as exc:  # a bad checkpoint or flag: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def proto_int(bits: int) -> Callable[[str], int]:
    """An argparse type for a signed protobuf integer field: a value the field cannot hold is a usage error
    naming the flag, not the client's traceback from the message constructor."""
    bound = 1 << (bits - 1)

    def parse(text: str) -> int:
        value = int(text)
        if not -bound <= value < bound:
            raise argparse.ArgumentTypeError(f"{value} does not fit a {bits}-bit integer")
        return value

    parse.__name__ = f"int{bits}"  # argparse names the type in "invalid int32 value: 'x'"
    return parse


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--tls-ca", default=None, help="the router serves TLS: verify it with this CA certificate")
    p.add_argument("--max-tokens", type=proto_int(32), default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=proto_int(32), default=0)
    p.add_argument("--seed", type=proto_int(64), default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--keep-special-tokens", action="store_true", help="keep special tokens (e.g. <think>) in the text")
    p.add_argument("--thinking", action="store_true", help="chat: thinking mode (the reply starts with reasoning)")
    p.add_argument("--timeout", type=float, default=600.0)


def parser() -> argparse.ArgumentParser:
    """The `pdserve` command line (tests parse `pdserve up ...` with it, as a user types it)."""
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_up(sub)
    certs = sub.add_parser("certs", help="make a cluster CA and a node certificate for --tls-*")
    certs.add_argument("--out", required=True, help="directory for ca.pem, ca.key, node.pem, node.key")
    certs.add_argument("--host", action="append", help="a host name or IP the services are reached at (repeat)")
    certs.add_argument("--days", type=int, default=30)
    certs.set_defaults(fn=cmd_certs)
    _add_generate(sub)
    chat = sub.add_parser("chat", help="interactive chat with the router (DeepSeek-V3.2 chat encoding)")
    chat.add_argument("--system", default="", help="system prompt")
    _add_sampling_flags(chat, 256)
    chat.set_defaults(fn=cmd_chat)
    prof = sub.add_parser("profile", help="measure the engine's prefill and decode curves → profile.json")
    prof.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    prof.add_argument("--router", default=None, metavar="ADDR",
                      help="measure through a running router instead (the served path, and the interference of "
                           "instances sharing cores)")
    prof.add_argument("--tls-ca", default=None, help="with --router: the router serves TLS, verify it with this CA")
    prof.add_argument("--prompt-lengths", type=_prompt_lengths, default=(16, 64, 256),
                      help="with --router: the prompt lengths the prefill curve is fitted on (cover your prompts': "
                           "the quadratic term extrapolates badly)")
    add_flags(prof, ServiceConfig, only=("dtype",))
    prof.add_argument("--out", default="profile.json")
    prof.set_defaults(fn=cmd_profile)
    _add_plan(sub)
    conv = sub.add_parser("convert", help="convert a checkpoint offline (W8A8 INT8), tensor by tensor")
    conv.add_argument("--src", required=True, help="Hugging Face checkpoint dir (FP8 release or bf16/fp32)")
    conv.add_argument("--dst", required=True, help="output dir (must not hold a checkpoint yet)")
    conv.add_argument("--format", default="w8a8", choices=["w8a8"], help="target format")
    conv.add_argument("--ep", type=int, default=1, help="write routed experts to N per-rank files (1: no slicing)")
    conv.add_argument("--max-shard-gb", type=float, default=5.0, help="size limit of the shared shards")
    conv.set_defaults(fn=cmd_convert)
    return p


def _add_up(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run router + prefill + decode on loopback")
    up.add_argument("--model", default=None, help=f"checkpoint dir (default: the demo model {DEFAULT_MODEL})")
    up.add_argument("--num-prefill", type=int, default=1)
    up.add_argument("--num-decode", type=int, default=1)
    up.add_argument("--port", type=int, default=50051, help="router port")
    up.add_argument("--log-dir", default=None, help="write each service's log here")
    up.add_argument("--no-fork-server", dest="fork_server", action="store_false", default=Cluster.fork_services,
                    help="start every prefill and decode front as a new interpreter (default: fork them from one "
                         "process that imported torch and the services once, where that is safe)")
    add_flags(up, ServiceConfig, only=UP_ENGINE_FLAGS)  # the services' own defaults, choices and help
    up.add_argument("--prefill-cp", type=int, default=1, help="context-parallel ranks per prefill instance")
    up.add_argument("--prefill-tp", type=int, default=1, help="local-TP ranks per prefill instance (with cp 1)")
    up.add_argument("--prefill-ep", type=int, default=1, help="expert-parallel ranks per prefill instance")
    up.add_argument("--decode-dp", type=int, default=1, help="attention-DP ranks per decode instance")
    up.add_argument("--decode-tp", type=int, default=1, help="local-TP ranks per decode instance (with dp 1)")
    up.add_argument("--decode-ep", type=int, default=1, help="expert-parallel ranks per decode instance")
    up.add_argument("--layer-sharding", default="", help="o_proj,q_b_proj: store layer i's weight on rank i %% K")
    add_flags(up, DecodeConfig, only=("speculative_max_draft_tokens", "enforce_eager"))  # decode's own flags
    add_flags(up, RouterConfig, only=("local_prefill_tokens", "overflow_prefill_tokens", "http_port", "kserve_port",
                                      "epp_port", "api_key_file", "ttft_slo_ms", "tpot_slo_ms", "profile",
                                      "served_model_name", "chat_max_tokens", "drain_seconds", "no_token_bus"))
    add_flags(up, PrefillConfig, only=("no_prefix_cache", "no_kv_fetch"))
    add_flags(up, AutoscaleConfig)  # passed to the router, which decides
    add_flags(up, SupervisorConfig)  # pdserve up's own: how it restarts a service that exits
    up.add_argument("--config", default=None,
                    help="deployment description (YAML, the Helm chart's values keys); replaces the shape flags")
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS on every hop (gRPC and KV) with a CA and certificate made for this start")
    up.set_defaults(fn=cmd_up)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream one request from the router")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--prompt-token-ids", type=proto_int(32), nargs="+", default=None)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat encoding)")
    _add_sampling_flags(gen, 32)
    gen.add_argument("--show-ids", action="store_true")
    gen.add_argument("--priority", type=proto_int(32), default=0,
                     help="lower is more urgent: < 0 may use its whole SLA targets, > 0 is refused first under load; "
                          "the prefill queue serves lower first")
    gen.add_argument("--ttft-ms", type=float, default=0.0, help="this request's TTFT target (0: the router's)")
    gen.add_argument("--tpot-ms", type=float, default=0.0, help="this request's TPOT target (0: the router's)")
    gen.set_defaults(fn=cmd_generate)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="how many prefill (M) and decode (N) instances a workload needs")
    plan.add_argument("--profile", default=None, help="profile.json from `pdserve profile` (default: built-in)")
    plan.add_argument("--rate", type=float, required=True, help="requests per second")
    plan.add_argument("--isl", default="128", help="prompt tokens: N, LO:HI (uniform) or exp:MEAN")
    plan.add_argument("--osl", default="128", help="output tokens: N, LO:HI (uniform) or exp:MEAN")
    plan.add_argument("--ttft-p90", type=float, required=True, help="TTFT target (ms) for the attainment share")
    plan.add_argument("--tpot-p90", type=float, required=True, help="TPOT target (ms)")
    plan.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both")
    plan.add_argument("--max-m", type=int, default=8)
    plan.add_argument("--max-n", type=int, default=16)
    plan.add_argument("--dp", type=int, default=1, help="attention-DP ranks per decode instance")
    plan.add_argument("--requests", type=int, default=2000, help="simulated requests per stage-B run")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--plot", default=None, help="PNG of SLA attainment vs request rate")
    plan.set_defaults(fn=cmd_plan)


def up_cluster(argv: list[str], log_dir: Path | None = None) -> Cluster:
    """The Cluster `pdserve up ARGV` starts (not started yet)."""
    return cluster_from_args(parser().parse_args(["up", *argv]), log_dir)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
