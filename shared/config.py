"""Typed model configuration read from a Hugging Face `config.json`.

Supports `model_type` `deepseek_v32` (MLA + lightning indexer) and `deepseek_v3` (dense MLA), in
both the legacy (`rope_scaling` + `rope_theta`) and the transformers-5 (`rope_parameters`) spelling.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "deepseek_v3")
W8A8_METHOD = "w8a8_int8"  # quantization_config.quant_method of W8A8 checkpoints (shared.quant.int8)


@dataclass(frozen=True)
class RopeConfig:
    """RoPE / YaRN parameters, normalized from either HF spelling."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class Fp8Scheme:
    """`quantization_config` of an FP8 block-quantized checkpoint (DeepSeek's release: fmt e4m3,
    weight_block_size [128, 128], scale_fmt ue8m0, activation_scheme dynamic). Weight scales are
    `weight_scale_inv` multipliers per block, stored as fp32 (powers of two under ue8m0) or as raw
    e8m0 exponent bytes (float8_e8m0fnu, or uint8 with scale_fmt ue8m0)."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None
    activation_scheme: str = "dynamic"

    @classmethod
    def from_quantization_config(cls, q: dict[str, Any]) -> Fp8Scheme | None:
        if not q or q.get("quant_method") == W8A8_METHOD:
            return None
        method = q.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported "
                             f"(supported: 'fp8', {W8A8_METHOD!r})")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r} is not supported (supported: 'e4m3')")
        block = q.get("weight_block_size") or [128, 128]
        if len(block) != 2 or min(int(b) for b in block) <= 0:
            raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
        scale_fmt = q.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r} is not supported (None or 'ue8m0')")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported ('dynamic')")
        return cls((int(block[0]), int(block[1])), scale_fmt, scheme)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    num_nextn_predict_layers: int = 0
    quantization: dict[str, Any] = field(default_factory=dict)
    checkpoint_dtype: str | None = None  # config.json "torch_dtype" / "dtype"

    @property
    def default_dtype(self) -> str:
        """dtype "auto": the checkpoint's own compute dtype (FP8 releases compute in bfloat16)."""
        if self.quantization or self.checkpoint_dtype not in ("float32", "bfloat16", "float16"):
            return "bfloat16"
        return self.checkpoint_dtype

    @property
    def fp8(self) -> Fp8Scheme | None:
        """The checkpoint's FP8 block quantization, read from `quantization_config` (None: unquantized)."""
        return Fp8Scheme.from_quantization_config(self.quantization)

    @property
    def w8a8(self) -> bool:
        """The checkpoint holds W8A8 INT8 weights (written by `pdserve convert --format w8a8`)."""
        return self.quantization.get("quant_method") == W8A8_METHOD

    @property
    def has_indexer(self) -> bool:
        return self.model_type == "deepseek_v32"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5, times mscale² when YaRN sets mscale_all_dim."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """The MTP layers past num_hidden_layers are MoE blocks, as DeepSeek ships them."""
        return layer >= len(self.mlp_layer_types) or self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read an HF config.json; a missing field takes transformers' default for the model type
        (DeepseekV3Config / DeepseekV32Config), and values the model does not implement are refused."""
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        raw = {**_HF_DEFAULTS[model_type], **{k: v for k, v in raw.items() if v is not None or k == "q_lora_rank"}}
        _check_supported(raw)
        n_layers = int(raw["num_hidden_layers"])
        layer_types = raw.get("mlp_layer_types")
        if not layer_types:
            n_dense = min(int(raw["first_k_dense_replace"]), n_layers)
            layer_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        if len(layer_types) != n_layers or set(layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list 'dense'/'sparse' for each of {n_layers} layers")
        if raw.get("n_routed_experts") in (None, 0):
            layer_types = ["dense"] * n_layers
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        v32 = model_type == "deepseek_v32"
        cfg = cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            q_lora_rank=raw.get("q_lora_rank"),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            n_routed_experts=int(raw.get("n_routed_experts") or 0),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            n_group=int(raw["n_group"]),
            topk_group=int(raw["topk_group"]),
            routed_scaling_factor=float(raw["routed_scaling_factor"]),
            norm_topk_prob=bool(raw["norm_topk_prob"]),
            mlp_layer_types=tuple(layer_types),
            rms_norm_eps=float(raw["rms_norm_eps"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rope=_parse_rope(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            tie_word_embeddings=bool(raw["tie_word_embeddings"]),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            index_topk=int(raw["index_topk"]) if v32 else 0,
            index_head_dim=int(raw["index_head_dim"]) if v32 else 0,
            index_n_heads=int(raw["index_n_heads"]) if v32 else 0,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
            quantization=dict(raw.get("quantization_config") or {}),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Shapes the model can run; a bad value fails here, not as a NaN later."""
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings"]
        if self.has_indexer:
            positive += ["index_topk", "index_head_dim", "index_n_heads"]
        if self.n_routed_experts:
            positive += ["num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size"]
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.json: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"config.json: n_group {self.n_group} does not divide n_routed_experts "
                                 f"{self.n_routed_experts}")
            if self.topk_group > self.n_group:
                raise ValueError(f"config.json: topk_group {self.topk_group} > n_group {self.n_group}")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                raise ValueError("config.json: num_experts_per_tok exceeds the experts in topk_group groups")
        if self.has_indexer and self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("config.json: index_head_dim must be >= qk_rope_head_dim (the indexer ropes its "
                             "first dims)")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))


# transformers' DeepseekV3Config / DeepseekV32Config defaults: a field missing from config.json takes
# these values, exactly as `AutoConfig` would read the same file.
_COMMON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False, "rope_theta": 10000.0,
}
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {**_COMMON_DEFAULTS, "max_position_embeddings": 4096},
    "deepseek_v32": {**_COMMON_DEFAULTS, "max_position_embeddings": 163840, "index_topk": 2048,
                     "index_head_dim": 128, "index_n_heads": 64},
}
# Values of routing / activation fields this model implements (DeepSeek-V3/V3.2 use exactly these).
_SUPPORTED_VALUES: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "hidden_act": ("silu",), "moe_layer_freq": (1,),
}


def _check_supported(raw: dict[str, Any]) -> None:
    for key, allowed in _SUPPORTED_VALUES.items():
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"config.json: {key}={raw[key]!r} is not implemented (supported: {list(allowed)})")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope type {rope_type!r} is not supported (default, yarn)")
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
    if factor is None:
        factor = raw.get("max_position_embeddings", orig) / orig if rope_type == "yarn" else 1.0
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


LAYER_SHARDABLE = ("o_proj", "q_b_proj")


@dataclass(frozen=True)
class ParallelConfig:
    """How one instance's ranks split the work (see shared.parallel.state for the groups built from it)."""

    world: int = 1
    cp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    layer_sharding: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("world", "cp", "dp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.cp > 1 and self.dp > 1:
            raise ValueError("cp (prefill) and dp (decode) cannot both be > 1 in one instance")
        if max(self.cp, self.dp) not in (1, self.world):
            raise ValueError(f"cp/dp must equal world ({self.world})")
        for name in ("tp", "ep"):
            if self.world % getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)} must divide world={self.world}")
        if self.tp > 1 and (self.cp > 1 or self.dp > 1):
            raise ValueError("local TP needs ranks that see the same tokens: use tp with cp=dp=1")
        bad = set(self.layer_sharding) - set(LAYER_SHARDABLE)
        if bad:
            raise ValueError(f"layer_sharding supports {LAYER_SHARDABLE}, got {sorted(bad)}")


REQUIRED: Any = MISSING  # flag(REQUIRED, ...): a flag without default


def flag(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
         bounds: tuple[float, float | None] | None = None) -> Any:
    """A config field that is also a command-line flag: its default, help, choices and inclusive
    `bounds` (lo, hi or None) are written once, here; `add_flags` turns the dataclass into argparse
    flags (`--kebab-case` of the field name), `check_bounds` holds a value to its bounds, and other
    configs that take the same knob re-declare it with `same_as` (the deployment description and the
    chart's values.yaml are checked against these declarations by tests/test_config_source.py)."""
    meta = {"help": help, "choices": choices, "bounds": bounds, "required": default is MISSING}
    if default is MISSING:
        return field(metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def same_as(cls: type, name: str) -> Any:
    """Field `name` of config `cls` declared again, same default, help, choices and bounds: a knob
    several configs take (engine, service, deployment) is declared once, on the lowest of them."""
    f = cls.__dataclass_fields__[name]
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


def knob_default(cls: type, name: str) -> Any:
    """The declared default of field `name` of config `cls`."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def knob_choices(cls: type, name: str) -> tuple[str, ...]:
    """The declared choices of field `name` of config `cls`."""
    return cls.__dataclass_fields__[name].metadata["choices"]


def check_bounds(obj: Any, label: Callable[[str], str] = str) -> None:
    """Raise ValueError, naming the field as `label(name)` does, for a value outside its flag's bounds
    or choices."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        bounds, choices = f.metadata.get("bounds"), f.metadata.get("choices")
        if bounds and value is not None:
            lo, hi = bounds
            if value < lo or (hi is not None and value > hi):
                raise ValueError(f"{label(f.name)}: expected " + (f"at least {lo}" if hi is None else f"{lo}..{hi}")
                                 + f", got {value}")
        if choices and value is not None and value not in choices:
            raise ValueError(f"{label(f.name)}: expected one of {', '.join(choices)}, got {value!r}")


def add_flags(p: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None) -> None:
    """One flag per `flag()` field of dataclass `cls` (or the fields named in `only`):
    bool → store_true, tuple/list → comma-separated."""
    for f in fields(cls):
        if "help" not in f.metadata or (only is not None and f.name not in only):
            continue
        name = flag_name(f.name)
        kind = str(f.type)
        default = f.default if f.default_factory is MISSING else f.default_factory()  # type: ignore[misc]
        default = None if default is MISSING else default
        help_ = f.metadata["help"] + ("" if f.metadata["required"] or "%(default)" in f.metadata["help"]
                                      or default in (None, False, (), []) else " (default: %(default)s)")
        if kind == "bool":
            p.add_argument(name, action="store_true", help=help_)
        elif kind.startswith(("tuple", "list")):
            p.add_argument(name, default=",".join(default or ()), required=f.metadata["required"], help=help_)
        else:
            conv = int if kind.startswith("int") else float if kind.startswith("float") else str
            p.add_argument(name, type=conv, default=None if f.metadata["required"] else default,
                           choices=f.metadata["choices"], required=f.metadata["required"], help=help_)


def from_flags(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass from parsed flags (comma-separated values become tuples / lists)."""
    values = {}
    for f in fields(cls):
        if not hasattr(args, f.name):
            continue
        value, kind = getattr(args, f.name), str(f.type)
        if kind.startswith(("tuple", "list")) and isinstance(value, str):
            items = [x for x in value.split(",") if x]
            value = tuple(items) if kind.startswith("tuple") else items
        values[f.name] = value
    return cls(**values)


MAX_SPECULATIVE_TOKENS = 3  # MTP drafts per step the engine supports


@dataclass
class EngineConfig:
    """The engine's knobs, each declared once: the services, `pdserve up`, the deployment description
    and the chart's values.yaml take their defaults from here (`same_as`)."""

    model: str
    dtype: str = flag("auto", "compute dtype (auto: the checkpoint's own: bfloat16 for DeepSeek's FP8 and "
                              "bf16 releases, float32 for a float32 checkpoint)",
                      choices=("auto", "bfloat16", "float32"))
    device: str | None = None  # None/"auto": best available
    block_size: int = flag(16, "KV block size in tokens", bounds=(1, None))
    num_kv_blocks: int | None = None  # default: kv_cache_tokens / block_size
    kv_cache_tokens: int = flag(65536, "KV pool size in tokens (per rank)", bounds=(1, None))
    max_num_seqs: int = flag(256, "requests decoding at once per rank", bounds=(1, None))
    max_num_batched_tokens: int = flag(4096, "one token budget per step: decodes + prompt chunks",
                                       bounds=(1, None))
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompts' common prefixes
    attention_workspace_mb: int = flag(256, "attention / indexer working set per tile (independent of context)",
                                       bounds=(1, None))
    indexer_numerics: str = flag("deepseek", "lightning indexer numerics: DeepSeek's own (Hadamard + FP8 e4m3) "
                                             "or transformers'", choices=("deepseek", "transformers"))
    seed: int = 0
    progress: bool = False
    compile: bool = False  # torch.compile (inductor) the per-token layer parts (norms, MLPs, router); see README
    quantization: str = flag("auto", "weights: w8a8 quantizes MLA's projections (kv_b aside), the indexer's "
                                     "wq_b, dense MLPs and the experts to INT8 while loading; fp8 keeps an "
                                     "FP8 checkpoint's weights FP8 (1 byte/param, dequantized per block on the "
                                     "fly); auto: the checkpoint's own (FP8 dequantized)",
                             choices=("auto", "none", "w8a8", "fp8"))
    kv_cache_dtype: str = flag("auto", "KV cache: int8 stores the latent as int8 + per-128 scales and the indexer "
                                       "key as FP8 + one scale (C8); prefill and decode must agree",
                               choices=("auto", "int8"))
    offload_layers: str = flag("", "decoder layers whose weights stay in host memory and are copied in, one layer "
                                   "ahead, while the previous layer computes: 3,5,7 | 2-10 | all")
    offload_buffers: int = flag(2, "device staging buffers for --offload-layers", bounds=(1, None))
    share_weights_dir: str | None = flag(None, "map the weights from one file in this directory (e.g. "
                                               "/dev/shm/pdserve) shared by every co-located process holding the "
                                               "same slice")
    speculative: str | None = flag("", "mtp: the checkpoint's MTP layer drafts, the model verifies (greedy output "
                                       "unchanged, sampling distribution unchanged); set on prefill and decode "
                                       "alike (prefill computes the MTP layer's cache over the prompt)",
                                   choices=("", "mtp"))
    num_speculative_tokens: int = flag(1, "drafts per decode step with --speculative mtp",
                                       bounds=(1, MAX_SPECULATIVE_TOKENS))
    speculative_max_draft_tokens: int = flag(16, "with --speculative mtp, drafts per step in all (0: no cap): B "
                                                 "decoding requests draft min(K, this // B) each, none past it (a "
                                                 "verified row costs about a decode row once a step has many)",
                                             bounds=(0, None))

    def __post_init__(self) -> None:
        check_bounds(self)
        self.speculative = self.speculative or None  # "" (the flag's "off") is unset


def flag_name(field_name: str) -> str:
    """--kebab-case: how a config field is spelled on the command line."""
    return "--" + field_name.replace("_", "-")


def parse_flags(cls: type, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> Any:
    """Config `cls` from the command line: its flags added to `parser`, parsed, built; a value outside a
    flag's bounds exits like any bad flag (usage, the flag named, status 2), not with a traceback."""
    add_flags(parser, cls)
    args = parser.parse_args(argv)
    try:
        return from_flags(cls, args)
    except ValueError as exc:
        parser.error(str(exc))


@dataclass(kw_only=True)
class EndpointConfig:
    """What every pdserve process that serves gRPC takes: address, metrics, drain, authentication."""

    host: str = flag("127.0.0.1", "interface to bind")
    port: int = flag(0, "gRPC port (0 = pick a free one, reported with --port-file)")
    port_file: str | None = flag(None, "write the bound gRPC port here once serving")
    metrics_port: int | None = flag(None, "serve Prometheus /metrics on this port (0: a free one, reported in "
                                          "PORT_FILE.metrics)")
    drain_seconds: float = flag(5.0, "on SIGTERM: in-flight requests get this long to finish, then the process exits")
    auth_token_file: str | None = flag(None, "file holding the cluster's shared secret (default: "
                                             "$PDSERVE_CLUSTER_TOKEN)")
    insecure: bool = flag(False, "no cluster secret on internal calls (development only)")
    tls_cert: str | None = flag(None, "PEM certificate of this process (mutual TLS on every hop)")
    tls_key: str | None = flag(None, "PEM private key of --tls-cert")
    tls_ca: str | None = flag(None, "PEM certificate of the cluster CA: peers must present one it signed")


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """--tls-cert / --tls-key / --tls-ca, as every service takes them (for clients and probes)."""
    add_flags(p, EndpointConfig, only=("tls_cert", "tls_key", "tls_ca"))


@dataclass(kw_only=True)
class ServiceConfig(EndpointConfig):
    """The flags every engine-backed service takes (the deployment renders exactly these)."""

    model: str = flag(REQUIRED, "checkpoint directory (HF layout)")
    kv_transport: str = flag("tcp", "KV transfer engine", choices=("tcp", "mooncake"))
    mooncake_protocol: str = flag("tcp", "with --kv-transport mooncake: rdma (one-sided writes over RDMA NICs; "
                                         "the service refuses to start without one) or tcp",
                                  choices=("tcp", "rdma"))
    mooncake_devices: str = flag("auto", "RDMA NICs for --mooncake-protocol rdma: names (mlx5_0,mlx5_1) or auto "
                                         "(every device under /sys/class/infiniband with an active port)")
    dtype: str = same_as(EngineConfig, "dtype")
    indexer_numerics: str = same_as(EngineConfig, "indexer_numerics")
    quantization: str = same_as(EngineConfig, "quantization")
    kv_cache_dtype: str = same_as(EngineConfig, "kv_cache_dtype")
    offload_layers: str = same_as(EngineConfig, "offload_layers")
    offload_buffers: int = same_as(EngineConfig, "offload_buffers")
    speculative: str = same_as(EngineConfig, "speculative")
    num_speculative_tokens: int = same_as(EngineConfig, "num_speculative_tokens")
    share_weights_dir: str | None = same_as(EngineConfig, "share_weights_dir")
    block_size: int = same_as(EngineConfig, "block_size")
    kv_cache_tokens: int = same_as(EngineConfig, "kv_cache_tokens")
    ep: int = flag(1, "expert-parallel ranks (divides the instance's ranks)")
    tp: int = flag(1, "local TP ranks for o_proj / lm_head / embedding")
    cp: int = 1  # prefill instances (their own flag)
    dp: int = 1  # decode instances (their own flag)
    layer_sharding: tuple[str, ...] = flag((), "o_proj,q_b_proj: layer i's weight lives on rank i %% K")
    advertise_host: str | None = flag(None, "address peers reach this instance at (needed with --host 0.0.0.0)")
    engine_in_process: bool = flag(False, "run the engine loop in the gRPC process (default: its own process, "
                                          "so handlers and the engine never share a GIL)")
    cpu_threads: int = flag(0, "CPU threads of the instance's engine ranks on this host, shared out among them (0: "
                               "OMP_NUM_THREADS if set, else the usable cores less one, left to the front ends)",
                            bounds=(0, None))

    @property
    def public_host(self) -> str:
        """The host peers reach this instance at (KV endpoints, Mooncake): --advertise-host, or --host
        when that names one interface (a wildcard bind names none)."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError("--host binds every interface: give --advertise-host, the address peers use")
        return self.host

    @property
    def world(self) -> int:
        """Ranks in the instance (cp, dp and tp exclude each other beyond 1)."""
        return self.cp * self.dp * self.tp

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(world=self.world, cp=self.cp, dp=self.dp, tp=self.tp, ep=self.ep,
                              layer_sharding=self.layer_sharding)

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The engine this service runs: its own flags where the names agree, then `overrides`."""
        names = {f.name for f in fields(EngineConfig)}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}
        return EngineConfig(**{**values, **overrides})

    def __post_init__(self) -> None:
        check_bounds(self, flag_name)


@dataclass(kw_only=True)
class PrefillConfig(ServiceConfig):
    """The prefill service's flags."""

    cp: int = flag(1, "context-parallel ranks")
    max_prefill_tokens: int = flag(knob_default(EngineConfig, "max_num_batched_tokens"),
                                   "prompt tokens computed per engine step (chunked prefill; several prompts batch "
                                   "up to it)", bounds=(1, None))
    no_prefix_cache: bool = flag(False, "recompute every prompt (no prefix cache)")
    kv_stall_seconds: float = flag(1.5, "a KV push that makes no progress this long fails (the request gets "
                                        "UNAVAILABLE)")

    def engine_config(self, **overrides: object) -> EngineConfig:
        return super().engine_config(max_num_batched_tokens=self.max_prefill_tokens,
                                     enable_prefix_caching=not self.no_prefix_cache, **overrides)


@dataclass(kw_only=True)
class DecodeConfig(ServiceConfig):
    """The decode service's flags."""

    dp: int = flag(1, "attention data-parallel ranks")
    speculative_max_draft_tokens: int = same_as(EngineConfig, "speculative_max_draft_tokens")
    kv_port: int = flag(0, "TCP KV receiver port of rank 0, rank r uses +r (0 = free)")
    lease_seconds: float = flag(30.0, "unused reservations expire after this")
    kv_stall_seconds: float = flag(3.0, "a KV write being received that gets no byte this long is dropped and its "
                                        "reservation's blocks freed at once (a write whose reservation is released "
                                        "meanwhile is dropped at once)", bounds=(0.1, None))
    reserve_wait_seconds: float = flag(5.0, "a reservation that finds the KV pool full waits up to this long for "
                                            "blocks to free (within its caller's deadline) before it is refused "
                                            "with RESOURCE_EXHAUSTED (0: refused at once)", bounds=(0.0, None))
    max_num_seqs: int = same_as(EngineConfig, "max_num_seqs")
