"""pdserve shared layers: model, KV cache, loader, engine, transfer. Never imports a service."""
