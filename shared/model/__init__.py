"""DeepSeek-V3.2 model in plain PyTorch."""

from shared.model.batch import ForwardBatch, SeqChunk
from shared.model.model import DeepseekForCausalLM

__all__ = ["DeepseekForCausalLM", "ForwardBatch", "SeqChunk"]
