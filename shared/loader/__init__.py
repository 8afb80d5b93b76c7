"""Checkpoint loading (Hugging Face safetensors, FP8 block scales) and tiny-checkpoint generation."""

from shared.loader.checkpoint import LoadReport, load_model, load_weights

__all__ = ["LoadReport", "load_model", "load_weights"]
