"""Typed configs: the model's config.json (model), the knob machinery every config uses (knobs), the engine's
knobs and rank layout (engine), the services' flags (service). Import them from here: `shared.config`."""

from shared.config.engine import LAYER_SHARDABLE, MAX_SPECULATIVE_TOKENS, EngineConfig, ParallelConfig
from shared.config.knobs import (
    REQUIRED,
    add_flags,
    check_bounds,
    flag,
    flag_name,
    from_flags,
    knob_choices,
    knob_default,
    parse_flags,
    same_as,
)
from shared.config.model import (
    SUPPORTED_MODEL_TYPES,
    W8A8_METHOD,
    Fp8Scheme,
    ModelConfig,
    RopeConfig,
    yarn_get_mscale,
)
from shared.config.service import DecodeConfig, EndpointConfig, PrefillConfig, ServiceConfig, add_tls_arguments

__all__ = ["LAYER_SHARDABLE", "MAX_SPECULATIVE_TOKENS", "REQUIRED", "SUPPORTED_MODEL_TYPES", "W8A8_METHOD",
           "DecodeConfig", "EndpointConfig", "EngineConfig", "Fp8Scheme", "ModelConfig", "ParallelConfig",
           "PrefillConfig", "RopeConfig", "ServiceConfig", "add_flags", "add_tls_arguments", "check_bounds", "flag",
           "flag_name", "from_flags", "knob_choices", "knob_default", "parse_flags", "same_as", "yarn_get_mscale"]
