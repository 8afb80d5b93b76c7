"""pdserve's shared floors: everything both services use. Never imports a service or the router.

Layers, bottom to top. A module imports only from its own package or a package on a line above it,
at the top of the file (tests/test_house.py walks the import graph and holds the tree to this order):

    protocol    request vocabulary: sampling parameters and limits, chat, tokenizer, prefix keys (no torch)
    config      typed configs: the model's config.json, the engine's and services' knobs (no torch)
    rpc         gRPC stubs, credentials, channels, server plumbing (no torch)
    metrics     Prometheus metrics (no torch)
    device      the one place that names devices and collective backends
    quant       FP8 block scales, W8A8 INT8, C8
    kvcache     the KV layout, paged pools, block allocator, leases
    transfer    KV transport: built-in TCP, Mooncake
    parallel    process groups, collectives, rank launch
    model       DeepSeek-V3.2 in PyTorch (MLA, indexer, MoE, MTP) and its CPU kernels
    loader      safetensors loading, TP/EP slicing, shared weights, tiny checkpoints, conversion
    engine      scheduler, sampler, the step, offline LLM API, engine loop
    demo        the demo model's training recipe and the offline demo

The first four are what the router imports: it starts without torch.
"""
