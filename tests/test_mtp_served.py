"""MTP served through `pdserve up` on the trained demo model (its MTP layer agrees with the model ~72% of
the time, so drafts are accepted, often several at once) in every instance shape: one rank, attention-DP +
EP decode, local-TP decode, and a CP prefill feeding DP + EP decode. Concurrent greedy streams end on
`max_tokens`, stop tokens, stop strings and EOS that land inside runs of accepted drafts; each must equal
the plain (non-speculative) engine's answer: same tokens, same text, same finish reason.

By default one K per shape (every K covered); PDSERVE_MTP_MATRIX=1 runs every shape x K = 1..3 and
prints the table (the closing-note table of issue 23)."""

from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import dataclass

import pytest

from shared.engine import LLM, SamplingParams
from shared.rpc.pdserve.v1 import generation_pb2
from tests.conftest import ROOT
from tests.helpers import Completion, concurrent_generate, prefill_paths, wait_for

DEMO = str(ROOT / "models" / "demo-v32")
PROMPTS = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
    "darkness was upon the face of the deep.",
    "And it came to pass in those days, that there went out a decree from Caesar Augustus, that all the world "
    "should be taxed.",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he leadeth me "
    "beside the still waters.",
    "And Jesus said unto them, I am the bread of life: he that cometh to me shall never hunger;",
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are they that mourn: for "
    "they shall be comforted.",
    "Now the serpent was more subtil than any beast of the field which the LORD God had made.",
]
MAX_TOKENS = 40  # prompts of 24-34 tokens + 40: past the indexer's top-64, so main and MTP attention go sparse

SHAPES = {  # name → the `pdserve up` flags of the shape
    "1-rank": ["--local-prefill-tokens", "28"],  # the shorter prompts may prefill on decode (selective)
    "dp2-ep2": ["--decode-dp", "2", "--decode-ep", "2"],
    "tp2": ["--decode-tp", "2"],
    "cp2-to-dp2-ep2": ["--prefill-cp", "2", "--decode-dp", "2", "--decode-ep", "2"],
}
# A TP decode instance's o_proj partial sums are rounded to bf16 before the all-reduce (DeepSeek's own TP
# numerics), so its greedy answer is its own: MTP on it is checked against the same shape served without MTP.
OWN_NUMERICS = {"tp2"}
DEFAULT_K = {"1-rank": 2, "dp2-ep2": 1, "tp2": 3, "cp2-to-dp2-ep2": 2}
CASES = ([(s, k) for s in SHAPES for k in (1, 2, 3)] if os.environ.get("PDSERVE_MTP_MATRIX")
         else list(DEFAULT_K.items()))


@dataclass
class Case:
    """One served request and the plain engine's answer to it."""

    prompt: str
    params: SamplingParams
    want: Completion


def _sampling_proto(p: SamplingParams) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=p.ignore_eos,
                                         stop_token_ids=p.stop_token_ids, stop=p.stop)


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    """Streams whose ends fall at many positions (so some inside an accepted run for any K): `max_tokens`
    from 40 down to 30, a stop token and a stop string taken from the plain greedy answer mid-stream, and
    one stream free to stop at EOS."""
    llm = LLM(DEMO, dtype="bfloat16")  # the services' dtype and indexer numerics
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = llm.generate(PROMPTS, greedy)
    params = [SamplingParams(max_tokens=MAX_TOKENS - 2 * i - (i % 2), temperature=0.0, ignore_eos=True)
              for i in range(len(PROMPTS))]
    prompts = list(PROMPTS)
    for i, at in ((0, 17), (3, 26)):  # a stop token first produced at `at` in the greedy answer
        tokens = plain[i].token_ids
        token = next(t for t in tokens[at:] if t not in tokens[:at])
        prompts.append(PROMPTS[i])
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                     stop_token_ids=[token]))
    for i in (1, 2, 4):  # a stop string: two words from the middle of the greedy text
        words = re.findall(r"\S+ \S+", plain[i].text[len(plain[i].text) // 2:])
        prompts.append(PROMPTS[i])
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[words[1]]))
    prompts.append(PROMPTS[5])
    params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))  # EOS allowed
    outs = llm.generate(prompts, params)
    return [Case(p, sp, Completion(o.token_ids, o.text, o.finish_reason)) for p, sp, o in zip(prompts, params, outs)]


def _acceptance(url: str, k: int) -> list[float]:
    """Accepted / drafted per draft position from the decode instance's /metrics (summed over its ranks;
    rank loads refresh every engine turn, so wait until position 0 shows drafts)."""
    counts: dict[tuple[str, int], float] = {}

    def read() -> bool:
        counts.clear()
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        for kind, pos, value in re.findall(
                r'pdserve_spec_(drafted|accepted)_tokens_total\{[^}]*position="(\d)"[^}]*\} (\S+)', text):
            counts[kind, int(pos)] = counts.get((kind, int(pos)), 0) + float(value)
        return counts.get(("drafted", 0), 0) > 0

    wait_for(read, 10)
    return [counts.get(("accepted", i), 0) / max(counts.get(("drafted", i), 0), 1) for i in range(k)]


def _replayed(url: str) -> float:
    """Decode steps the instance replayed from recordings (shared.engine.graphs), from its /metrics."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r'pdserve_decode_steps_total\{[^}]*mode="replayed"[^}]*\} (\S+)', text))


def _serve(argv: list[str], cases: list[Case], log_dir, k: int = 0
           ) -> tuple[list[Completion | None], list[float], float]:
    """Every case at once through `pdserve up ARGV`; with `k`, the decode instance's acceptance and replayed steps
    too. Prints where the prompts were prefilled (the router's pdserve_router_prefill_path_total)."""
    from router.cli import up_cluster

    cluster = up_cluster(["--model", DEMO, "--port", "0", *argv], log_dir)
    cluster.extra_decode.extend(["--metrics-port", "0"])
    cluster.extra_router.extend(["--metrics-port", "0"])
    with cluster:
        requests = [generation_pb2.GenerateRequest(prompt=c.prompt, sampling_params=_sampling_proto(c.params))
                    for c in cases]
        got = concurrent_generate(cluster.address, requests)
        url = f"http://127.0.0.1:{cluster.metrics_ports[cluster.decode_addrs[0]]}/metrics"
        print("prefill paths:", prefill_paths(f"http://127.0.0.1:{cluster.metrics_ports[cluster.address]}/metrics"))
        acceptance = _acceptance(url, k) if k else []
        return got, acceptance, _replayed(url)


@pytest.mark.parametrize(("shape", "k"), CASES, ids=[f"{s}-K{k}" for s, k in CASES])
def test_mtp_served_equals_plain_greedy(cases, shape, k, tmp_path):
    mtp = ["--speculative", "mtp", "--num-speculative-tokens", str(k)]
    got, acceptance, replayed = _serve([*mtp, *SHAPES[shape]], cases, tmp_path / "logs", k)
    want = [c.want for c in cases]
    if shape in OWN_NUMERICS:
        want = _serve(SHAPES[shape], cases, tmp_path / "plain")[0]
    exact = sum(g == w for g, w in zip(got, want))
    short = sum(g is not None and w is not None and len(g.token_ids) < len(w.token_ids) for g, w in zip(got, want))
    print(f"\nMTP | {shape} | K={k} | {exact}/{len(cases)} streams exact | {short} short | acceptance per position "
          f"{[round(a, 3) for a in acceptance]}")
    for g, w, c in zip(got, want, cases):
        assert g == w, (c.params, g, w)
    assert {w.finish_reason for w in want} == {"length", "stop"}
    assert acceptance[0] > 0.5  # drafts were accepted: the tails under test existed
    assert replayed > 0  # every decode shape replays its MTP verification steps (one rank and TP: the MTP layer too)


def test_mtp_with_the_prefill_prefix_cache_served(tmp_path):
    """The prefill instance's prefix cache under MTP: prompts that share a cached prefix reuse its main and
    MTP-layer blocks (usage.cached_prompt_tokens), push them with the rest, and decode's drafts and
    verification on them give the plain greedy answer."""
    prefix = PROMPTS[0] + " " + PROMPTS[2]  # 66 tokens: four full 16-token blocks to reuse
    prompts = [prefix] + [f"{prefix} {tail}" for tail in ("And God said,", "Thus saith the LORD,", "Behold,")]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(DEMO, dtype="bfloat16", enable_prefix_caching=False).generate(prompts, greedy)
    cases = [Case(p, greedy, Completion(o.token_ids, o.text, o.finish_reason)) for p, o in zip(prompts, plain)]
    from router.cli import up_cluster

    cluster = up_cluster(["--model", DEMO, "--port", "0", "--speculative", "mtp", "--num-speculative-tokens", "2",
                          "--decode-dp", "2", "--decode-ep", "2"], tmp_path / "logs")
    with cluster:
        requests = [generation_pb2.GenerateRequest(prompt=c.prompt, sampling_params=_sampling_proto(c.params))
                    for c in cases]
        first = concurrent_generate(cluster.address, requests[:1])  # computes and caches the prefix
        rest = concurrent_generate(cluster.address, requests[1:])
    got = first + rest
    print("cached prompt tokens:", [g.cached_prompt_tokens for g in got])
    assert got == [c.want for c in cases]
    assert got[0].cached_prompt_tokens == 0 and all(g.cached_prompt_tokens >= 64 for g in rest)
