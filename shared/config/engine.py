"""The engine's knobs (EngineConfig: every front takes its defaults from here) and how one instance's ranks
split the work (ParallelConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.knobs import check_bounds, flag

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
    # 64 tokens, FlashMLA's page: a block's rows lie in one run, which decode attention streams; 16-token blocks
    # scattered by a long-running pool made the tiny model's batch-256 decode 4 % slower (README: block size)
    block_size: int = flag(64, "KV block size in tokens", bounds=(1, None))
    num_kv_blocks: int | None = None  # default: kv_cache_tokens / block_size
    kv_cache_tokens: int = flag(65536, "KV pool size in tokens (per rank)", bounds=(1, None))
    max_num_seqs: int = flag(256, "requests decoding at once per rank", bounds=(1, None))
    max_num_batched_tokens: int = flag(4096, "one token budget per step: decodes + prompt chunks",
                                       bounds=(1, None))
    kv_tier_tokens: int = flag(0, "second KV tier in tokens (per rank; 0: off): evicted prefix-cache blocks are "
                                  "kept in host memory (accelerator) or files (CPU, --kv-tier-dir) and read back "
                                  "on a hit", bounds=(0, None))
    kv_tier_dir: str | None = flag(None, "with --kv-tier-tokens on CPU: directory for the tier's files (each "
                                         "process makes a fresh subdirectory, removed at exit; default: the "
                                         "system's temporary directory)")
    kv_store_master: str | None = flag(None, "with --kv-tier-tokens: keep the tier's records in a Mooncake Store "
                                             "(its mooncake_master's HOST:PORT), shared by every instance of the "
                                             "model, instead of this process's files or host memory")
    kv_store_host: str = "127.0.0.1"  # where other store clients reach this rank (the service's public host)
    kv_store_protocol: str = "tcp"  # the store's transfers: the service's --mooncake-protocol
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompts' common prefixes
    attention_workspace_mb: int = flag(256, "attention / indexer working set per tile (independent of context)",
                                       bounds=(1, None))
    indexer_numerics: str = flag("deepseek", "lightning indexer numerics: DeepSeek's own (Hadamard + FP8 e4m3) "
                                             "or transformers'", choices=("deepseek", "transformers"))
    seed: int = 0
    progress: bool = False
    compile: bool = False  # torch.compile (inductor) the per-token layer parts (norms, MLPs, router); see README
    enforce_eager: bool = flag(False, "run every decode step eagerly: no recorded steps replayed (decode steps, "
                                      "on one rank, TP or DP/EP ranks, are recorded once per padded batch size "
                                      "and replayed)")
    graph_memory_mb: int = 2048  # what the recorded decode steps may keep (their intermediates), all together
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
    # under that cap, each step's drafts per request are the count measured fastest for its batch size
    # (shared.engine.draft_tuner); False: always the cap's count (tests that count drafts)
    speculative_tuning: bool = True

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.kv_store_master and not self.kv_tier_tokens:
            raise ValueError("kv_store_master: the store holds the second tier's records: give kv_tier_tokens too")
        self.speculative = self.speculative or None  # "" (the flag's "off") is unset
