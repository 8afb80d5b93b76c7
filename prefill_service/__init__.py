"""Prefill instance: runs (chunked) prefill and pushes each layer's KV to a decode instance."""
