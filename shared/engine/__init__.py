"""Engine: offline LLM API, continuous-batching scheduler, sampler, tokenizer."""

from shared.engine.llm import LLM, EngineConfig, LLMEngine, RequestOutput, StepEvent
from shared.engine.sampler import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "StepEvent"]
