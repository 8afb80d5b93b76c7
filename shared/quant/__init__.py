"""Quantization helpers (FP8 block weights of real DeepSeek checkpoints, FP8 activation emulation)."""
