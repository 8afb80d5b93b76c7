"""MTP speculative decoding: greedy output is bitwise the non-speculative output, sampled output keeps its
distribution, drafts are counted, and nothing leaks."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.speculative import MtpSpeculator
from shared.loader.tiny import write_checkpoint
from tests.helpers import random_prompts


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny V3.2 checkpoint with a (random) MTP layer in DeepSeek's layout; sparse attention past 8."""
    return write_checkpoint(tmp_path_factory.mktemp("mtp"), "deepseek_v32", tokenizer=False, mtp=True,
                            index_topk=8, vocab_size=512, hidden_size=64, q_lora_rank=32, kv_lora_rank=64,
                            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
                            intermediate_size=128, num_hidden_layers=3, index_head_dim=32, index_n_heads=4)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(path, prompts, params, **kw):
    llm = LLM(str(path), dtype="float32", block_size=4, **kw)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    kv = llm.engine.kv
    assert kv.allocator.num_free == kv.num_blocks  # every block back, rejected drafts' included
    return outs, llm.engine


def _oracle(want: dict[tuple[int, ...], list[int]], flip_every: int):
    """Replace the MTP drafts by the true greedy continuation, every `flip_every`-th one wrong: drafts are
    then accepted 0..K at a time, so verification, KV roll-back and the MTP catch-up over several
    positions all run (a random MTP layer is never right)."""
    real = MtpSpeculator.catch_up
    counter = iter(range(1 << 30))

    def draft(self, catch_up, hidden, draft=True):
        real(self, catch_up, hidden, draft)
        for seq, *_ in catch_up:
            d = self.drafts.get(seq.request_id)
            if d is None or tuple(seq.prompt_token_ids) not in want:  # (the engine's warm-up request)
                continue
            done = seq.output_token_ids
            truth = want[tuple(seq.prompt_token_ids)][len(done) : len(done) + len(d.tokens)]
            d.tokens = [t if next(counter) % flip_every else (t + 1) % 512 for t in truth]
    return draft


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_mtp_equals_without(mtp_model, k, monkeypatch):
    prompts = random_prompts(5, [5, 17, 30, 9, 3], 512, seed=1)  # different lengths: continuous batching
    want, _ = _run(mtp_model, prompts, GREEDY)
    got, engine = _run(mtp_model, prompts, GREEDY, speculative="mtp", num_speculative_tokens=k)
    assert got == want
    assert engine.speculator.stats.drafted[k - 1] > 0
    monkeypatch.setattr(MtpSpeculator, "catch_up", _oracle({tuple(p): w for p, w in zip(prompts, want)}, 4))
    got, engine = _run(mtp_model, prompts, GREEDY, speculative="mtp", num_speculative_tokens=k)
    stats = engine.speculator.stats
    print(f"K={k} oracle drafts (every 4th wrong): drafted {stats.drafted[:k]}, accepted {stats.accepted[:k]}")
    assert got == want
    assert stats.accepted[0] > 0 and (k == 1 or stats.accepted[k - 1] > 0)  # several drafts accepted at once


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson–Hilferty: the chi-square quantile at one-sided normal z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_mtp_keeps_the_output_distribution(tmp_path):
    """Many seeds, temperature 1, K = 2 on a model whose distributions are peaked and whose MTP layer
    disagrees with it (so drafts are both accepted and rejected): the tokens after the first follow the
    same distribution with and without speculation (two-sample chi-square, p > 0.001)."""
    path = write_checkpoint(tmp_path / "peaked", "deepseek_v32", tokenizer=False, mtp=True, std=0.5, seed=3,
                            index_topk=8, vocab_size=32, hidden_size=64, q_lora_rank=32, kv_lora_rank=64,
                            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
                            intermediate_size=128, num_hidden_layers=2, index_head_dim=32, index_n_heads=4)
    n = 1200
    prompts = [[3, 1, 4, 1, 5]] * n
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]

    def tokens(**kw) -> tuple[list[list[int]], object]:
        llm = LLM(str(path), dtype="float32", block_size=4, max_num_seqs=256, **kw)
        return [o.token_ids for o in llm.generate(prompts, params)], llm.engine

    plain, _ = tokens()
    spec, engine = tokens(speculative="mtp", num_speculative_tokens=2, speculative_max_draft_tokens=0)  # all draft
    stats = engine.speculator.stats
    print(f"sampled K=2: drafted {stats.drafted[:2]}, accepted {stats.accepted[:2]} ({stats.acceptance()[:2]})")
    assert 0 < stats.accepted[0] < stats.drafted[0]  # both branches of the rejection rule ran
    for pos in (1, 2, 3):
        a = torch.bincount(torch.tensor([t[pos] for t in plain]), minlength=32).double()
        b = torch.bincount(torch.tensor([t[pos] for t in spec]), minlength=32).double()
        keep = (a + b) >= 10  # bins with enough mass; the rest pooled
        a = torch.cat([a[keep], a[~keep].sum(0, keepdim=True)])
        b = torch.cat([b[keep], b[~keep].sum(0, keepdim=True)])
        rows = torch.stack([a, b])
        expected = rows.sum(1, keepdim=True) * rows.sum(0, keepdim=True) / rows.sum()
        mask = expected.sum(0) > 0
        chi2 = float(((rows - expected)[:, mask] ** 2 / expected[:, mask]).sum())
        df = int(mask.sum()) - 1
        crit = _chi_square_critical(df)
        print(f"token {pos}: chi-square {chi2:.1f} over {df} df (critical {crit:.1f} at p = 0.001); "
              f"top token share {a.max() / n:.2f}")
        assert chi2 < crit
        assert a.max() / n > 3 / 32  # far from uniform over the 32 tokens: a wrong rule would show


def test_mtp_needs_an_mtp_layer(tmp_path):
    path = write_checkpoint(tmp_path / "nomtp", "deepseek_v32", tokenizer=False, vocab_size=64, hidden_size=64,
                            q_lora_rank=32, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                            v_head_dim=16, moe_intermediate_size=32, intermediate_size=128, num_hidden_layers=2,
                            index_head_dim=32, index_n_heads=4)
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(str(path), dtype="float32", speculative="mtp")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(path), dtype="float32", speculative="mtp", num_speculative_tokens=4)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_served_disaggregated_equals_in_process_greedy(mtp_model, tmp_path, k):
    """Prefill computes the MTP layer's cache over the prompt and pushes it as one more layer; decode's
    first step runs without drafts and its hidden state starts the chain: the streamed greedy tokens are
    the non-speculative ones."""
    from router.cluster import Cluster
    from tests.helpers import concurrent_greedy

    prompts = random_prompts(4, [5, 23, 11, 40], 512, seed=2)
    want, _ = _run(mtp_model, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    flags = ["--speculative", "mtp", "--num-speculative-tokens", str(k), "--block-size", "4"]
    with Cluster(str(mtp_model), dtype="float32", log_dir=tmp_path / "logs", extra_decode=flags,
                 extra_prefill=[*flags, "--max-prefill-tokens", "16"]) as cluster:
        assert concurrent_greedy(cluster.address, prompts, max_tokens=10) == want


def test_decode_metrics_count_drafts_per_position(mtp_model, tmp_path):
    """The decode service's /metrics: pdserve_spec_{drafted,accepted}_tokens_total by draft position."""
    import urllib.request

    from router.cluster import Cluster
    from tests.helpers import concurrent_greedy, wait_for

    flags = ["--speculative", "mtp", "--num-speculative-tokens", "2", "--block-size", "4"]
    with Cluster(str(mtp_model), dtype="float32", log_dir=tmp_path / "logs", extra_prefill=flags,
                 extra_decode=[*flags, "--metrics-port", "0"]) as cluster:
        concurrent_greedy(cluster.address, random_prompts(2, [7, 12], 512, seed=4), max_tokens=8)
        url = f"http://127.0.0.1:{cluster.metrics_ports[cluster.decode_addrs[0]]}/metrics"
        lines: list[str] = []

        def drafted_both_positions() -> bool:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            lines[:] = [line for line in text.splitlines() if line.startswith("pdserve_spec_")]
            return all(any(f'position="{i}"' in line and "drafted" in line and not line.endswith(" 0.0")
                           for line in lines) for i in (0, 1))

        assert wait_for(drafted_both_positions, 10)  # loads refresh every turn; the scrape reads the latest
    print("\n".join(lines))
    assert any('position="2"' in line and line.endswith(" 0.0") for line in lines)  # K = 2: no third draft


def test_mtp_acceptance_on_the_trained_demo_model():
    """The committed demo model (KJV) with its trained MTP layer: greedy output unchanged, acceptance above a
    floor (the MTP layer agrees with the model's greedy next-next token ~72% of the time on validation)."""
    from tests.conftest import ROOT

    path = str(ROOT / "models" / "demo-v32")
    prompts = ["And it came to pass", "The LORD is my shepherd", "In the beginning God", "And Jesus said unto them,"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, dtype="float32").generate(prompts, params)]
    for k in (1, 3):
        llm = LLM(path, dtype="float32", speculative="mtp", num_speculative_tokens=k)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.engine.speculator.stats
        print(f"demo model K={k}: acceptance per position {[round(a, 3) for a in stats.acceptance()[:k]]}, "
              f"tokens per step {stats.mean_accepted + 1:.2f}")
        assert stats.acceptance()[0] >= 0.5


# --- MTP on parallel instances ----------------------------------------------------------------------

def _parallel_mtp_rank(rank: int, world: int, path: str, shape: dict, prompts: list[list[int]], want: dict, k: int):
    """One rank of a DP+EP (each rank its own prompts) or TP (every rank all prompts) engine drafting with
    oracle drafts, so requests accept differently; counts the MTP forwards this rank runs."""
    from shared.engine import EngineConfig, LLMEngine
    from shared.parallel import ParallelConfig, ParallelState

    state = ParallelState.initialize(ParallelConfig(world=world, **shape), rank, torch.device("cpu"))
    MtpSpeculator.catch_up = _oracle(want, 3)
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, speculative="mtp",
                                    num_speculative_tokens=k), state)
    real, mtp_forwards = engine.model.forward_mtp, []

    def counted(*a, **kw):
        mtp_forwards.append(1)
        return real(*a, **kw)

    engine.model.forward_mtp = counted
    mine = prompts if shape.get("tp") else prompts[rank::world][: 1 + 2 * (1 - rank)]  # rank 1: fewer, idles
    for p in mine:
        engine.add_request(p, GREEDY, f"r{prompts.index(p)}")
    tokens: dict[str, list[int]] = {}
    steps = 0
    while True:
        events = engine.step()
        if not engine.stepped:
            break
        steps += 1
        for ev in events:
            tokens.setdefault(ev.seq.request_id, []).append(ev.token_id)
    stats = engine.speculator.stats
    return tokens, steps, len(mtp_forwards), engine.kv.allocator.num_free == engine.usable_blocks, \
        (stats.drafted[:k], stats.accepted[:k])


@pytest.mark.parametrize("shape", [{"dp": 2, "ep": 2}, {"tp": 2}], ids=["dp2-ep2", "tp2"])
def test_mtp_on_parallel_ranks_equals_single_rank_greedy(mtp_model, shape):
    """Attention DP + EP: each rank drafts and accepts for its own requests, an idle rank runs dummy main and
    MTP forwards, and every rank runs the same number of MTP forwards (the MTP block's EP all-to-alls pair
    up). Local TP: the mirrored ranks draft identically. Greedy tokens are the single-rank ones, every
    block comes back."""
    from tests.dist_utils import run_ranks

    k = 2
    prompts = random_prompts(6, [5, 17, 30, 9, 3, 12], 512, seed=7)
    want, _ = _run(mtp_model, prompts, GREEDY)
    oracle = {tuple(p): w for p, w in zip(prompts, want)}
    results = run_ranks(_parallel_mtp_rank, 2, str(mtp_model), shape, prompts, oracle, k)
    for rank, (tokens, steps, forwards, all_free, (drafted, accepted)) in enumerate(results):
        print(f"{shape} rank {rank}: {len(tokens)} requests, {steps} steps, {forwards} MTP forwards, "
              f"drafted {drafted}, accepted {accepted}")
        assert all_free
        for rid, got in tokens.items():
            assert got == want[int(rid[1:])], rid
    (t0, s0, f0, _, (_, acc0)), (t1, s1, f1, _, _) = results
    assert s0 == s1 and f0 == f1
    assert acc0[0] > 0 and acc0[1] > 0  # several drafts accepted at once: KV roll-back under parallel ranks
    if "dp" in shape:
        assert f0 == s0 * k  # lock-step: K MTP forwards per step on every rank, dummies included
        assert len(t1) < len(t0) and len(t0) + len(t1) == 3 + 1  # rank 1 idled while rank 0 decoded
    else:
        assert t0 == t1 and len(t0) == len(prompts)


def test_mtp_served_cp_prefill_to_dp_ep_decode(mtp_model, tmp_path):
    """A CP=2 prefill computes the MTP layer's cache zigzag-split like the main layers and pushes it; a
    DP=2 / EP=2 decode drafts with MTP in lock-step: streamed greedy tokens are the non-speculative ones."""
    from router.cluster import Cluster
    from tests.helpers import concurrent_greedy

    prompts = random_prompts(5, [5, 23, 11, 40, 2], 512, seed=8)
    follow_ups = [p + [3] * 9 for p in prompts[1:4]]  # next turns: decode starts them on the rows it kept (MTP's too)
    want, _ = _run(mtp_model, prompts + follow_ups, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    spec = ["--speculative", "mtp", "--num-speculative-tokens", "2", "--block-size", "4"]
    with Cluster(str(mtp_model), dtype="float32", log_dir=tmp_path / "logs",
                 extra_prefill=[*spec, "--cp", "2", "--max-prefill-tokens", "16"],
                 extra_decode=[*spec, "--dp", "2", "--ep", "2"]) as cluster:
        got = concurrent_greedy(cluster.address, prompts, max_tokens=10)
        assert got + concurrent_greedy(cluster.address, follow_ups, max_tokens=10) == want


def test_mtp_with_prefix_cache_equals_without(mtp_model, monkeypatch):
    """Requests that reuse a cached prefix (main and MTP rows) draft and verify on it: greedy tokens are the
    plain ones (the MTP row at a cached block's edge may come from another continuation: drafts only)."""
    prefix = random_prompts(1, [22], 512, seed=9)[0]
    prompts = [prefix + t for t in random_prompts(3, [3, 7, 1], 512, seed=10)]
    want = [o.token_ids for o in LLM(str(mtp_model), dtype="float32", block_size=4,
                                     enable_prefix_caching=False).generate(prompts, GREEDY)]
    monkeypatch.setattr(MtpSpeculator, "catch_up", _oracle({tuple(p): w for p, w in zip(prompts, want)}, 3))
    llm = LLM(str(mtp_model), dtype="float32", block_size=4, speculative="mtp", num_speculative_tokens=2)
    got = [o.token_ids for o in llm.generate(prompts[:1], GREEDY)]  # computes and caches the prefix
    seqs: list = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **kw: seqs.append(add(*a, **kw)) or seqs[-1])
    got += [o.token_ids for o in llm.generate(prompts[1:], GREEDY)]
    assert got == want
    assert [s.num_cached_prompt_tokens for s in seqs] == [20, 20]  # five full blocks of the prefix reused
    assert llm.engine.speculator.stats.accepted[1] > 0
    kv = llm.engine.kv
    assert kv.allocator.num_free == kv.num_blocks


# --- batched verification: equal to the per-request rule, edge cases --------------------------------------

def _reference_greedy(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """The per-request rule: walk each request's drafts while they equal the target argmax."""
    out, row = [], 0
    for d in drafts:
        target = logits[row : row + len(d) + 1].argmax(-1).tolist()
        n = 0
        while n < len(d) and d[n] == target[n]:
            n += 1
        out.append([*d[:n], target[n]])
        row += len(d) + 1
    return out


def test_batched_greedy_acceptance_equals_per_request():
    """All rejected, all accepted, partly accepted, drafts of different lengths in one step: the tensor
    comparison gives the per-request walk's tokens."""
    from shared.engine.speculative import Draft, VerifyBatch, accept_greedy

    g = torch.Generator().manual_seed(0)
    vocab, lengths = 11, [3, 3, 3, 1, 2, 3, 2]
    logits = torch.randn(sum(n + 1 for n in lengths), vocab, generator=g)
    target = logits.argmax(-1).tolist()
    drafts, row = [], 0
    for i, n in enumerate(lengths):
        truth = target[row : row + n]
        wrong = [(t + 1) % vocab for t in truth]
        right = {0: 0, 1: n, 2: 1}.get(i % 3, n)  # none, all, one right (then wrong)
        drafts.append(truth[:right] + wrong[right:])
        row += n + 1
    firsts = [sum(n + 1 for n in lengths[:i]) for i in range(len(lengths))]
    batch = VerifyBatch.of([Draft(d, []) for d in drafts], firsts, logits.device)
    n, last = accept_greedy(logits, batch)
    got = [[*d[:a], t] for d, a, t in zip(drafts, n, last)]
    assert got == _reference_greedy(logits, drafts)
    assert n[0] == 0 and n[1] == 3 and n[2] == 1  # all rejected, all accepted, one accepted


def test_batched_sampled_acceptance_follows_the_rejection_rule(monkeypatch):
    """With the uniforms fixed, the batched rejection pass takes each request's draft i exactly when
    u_i · q(d_i) < p(d_i), and the token after the accepted ones is the inverse-CDF draw from max(p − q, 0)
    (or from p after the last draft) with that request's last uniform."""
    import shared.engine.speculative as spec
    from shared.engine.sampler import probabilities
    from shared.engine.speculative import Draft, VerifyBatch

    vocab, k = 7, 2
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    logits = torch.randn(3 * (k + 1), vocab, generator=g)
    q_logits = torch.randn(3 * k, vocab, generator=g)
    q = probabilities(q_logits, [params] * (3 * k)).view(3, k, vocab)
    p = probabilities(logits, [params] * (3 * (k + 1))).view(3, k + 1, vocab)
    tokens = [[int(q[r, i].argmax()) for i in range(k)] for r in range(3)]
    ratio = torch.tensor([[float(p[r, i, tokens[r][i]] / q[r, i, tokens[r][i]]) for i in range(k)] for r in range(3)])
    # request 0 rejects its first draft, request 1 accepts both, request 2 accepts one then rejects
    u = torch.tensor([[min(0.999, float(ratio[0, 0]) + 0.001), 0.5, 0.3],
                      [max(0.0, float(ratio[1, 0]) - 0.001), max(0.0, float(ratio[1, 1]) - 0.001), 0.7],
                      [max(0.0, float(ratio[2, 0]) - 0.001), min(0.999, float(ratio[2, 1]) + 0.001), 0.5]])
    assert ratio[0, 0] < 0.999 and ratio[2, 1] < 0.999  # at this seed those drafts can be rejected (p < q)
    monkeypatch.setattr(spec, "uniform_rows", lambda gens, n: u[:, :n])

    class Seq:
        def __init__(self):
            self.params, self.generator = params, None

    drafts = [Draft(tokens[r], [q[r, i] for i in range(k)]) for r in range(3)]
    batch = VerifyBatch.of(drafts, [0, k + 1, 2 * (k + 1)], logits.device)
    n, last = MtpSpeculator._accept_sampled(None, logits, batch, [Seq(), Seq(), Seq()])
    assert n == [0, 2, 1]
    for r, (a, token) in enumerate(zip(n, last)):
        weights = (p[r, a] - q[r, a]).clamp(min=0) if a < k else p[r, a]
        cdf = weights.cumsum(-1)
        want = int(torch.searchsorted(cdf, (u[r, k] * cdf[-1]).view(1), right=True).clamp(max=vocab - 1))
        assert token == want
        if a < k:
            assert float(weights[token]) > 0  # never a token where p ≤ q after a rejection


def test_few_token_step_indices_equal_the_general_ones():
    """MTP verification and catch-up steps (a few tokens per request, uniform or not) build their batch
    metadata from host lists: the same tensors as the general path."""
    from shared.model.batch import SeqChunk, _chunk_indices, _host_indices

    g = torch.Generator().manual_seed(5)
    block = 4
    for lens in ([2, 2, 2], [1, 3, 2, 4], [4], [1, 2]):
        chunks = []
        for n in lens:
            start = int(torch.randint(0, 30, (), generator=g))
            table = torch.randperm(64, generator=g)[: -(-(start + n) // block) + 1].tolist()
            chunks.append(SeqChunk([7] * n, start, table))
        n_blocks = max(-(-(c.start_pos + n) // block) for c, n in zip(chunks, lens))
        tables = torch.tensor([c.block_table[:n_blocks] + [0] * (n_blocks - len(c.block_table[:n_blocks]))
                               for c in chunks])
        for got, want in zip(_host_indices(chunks, lens, tables, block), _chunk_indices(chunks, lens, tables, block)):
            assert got.dtype == want.dtype and torch.equal(got, want)


# --- the draft cap and stops inside drafts -----------------------------------------------------------------

def test_drafts_per_request_under_the_cap(mtp_model):
    """B requests decoding draft min(K, cap // B) each, none past the cap; no cap: always K."""
    llm = LLM(str(mtp_model), dtype="float32", block_size=4, speculative="mtp", num_speculative_tokens=3,
              speculative_max_draft_tokens=16, speculative_tuning=False)
    spec = llm.engine.speculator
    assert [spec.drafts_per_request(b) for b in (1, 5, 6, 8, 9, 16, 17, 64)] == [3, 3, 2, 2, 1, 1, 0, 0]
    spec.max_draft_tokens = 0
    assert spec.drafts_per_request(64) == 3


def test_capped_drafting_equals_plain_greedy_and_resumes(mtp_model, monkeypatch):
    """More requests decode than the cap allows: those steps draft nothing and skip the MTP layer's decode
    positions; as requests end the batch drops under the cap and drafting resumes (on MTP rows with gaps).
    Greedy tokens are the plain ones throughout, every block comes back."""
    prompts = random_prompts(5, [5, 17, 30, 9, 3], 512, seed=11)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 6, 16, 20, 24)]
    llm = LLM(str(mtp_model), dtype="float32", block_size=4)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(MtpSpeculator, "catch_up", _oracle({tuple(p): w for p, w in zip(prompts, want)}, 5))
    llm = LLM(str(mtp_model), dtype="float32", block_size=4, speculative="mtp", num_speculative_tokens=2,
              speculative_max_draft_tokens=6, speculative_tuning=False)  # 5/4 decoding: 1 each; 3: 2 each
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    spec = llm.engine.speculator
    assert spec.gated_steps == 0 and spec.stats.drafted[1] > 0
    llm = LLM(str(mtp_model), dtype="float32", block_size=4, speculative="mtp", num_speculative_tokens=2,
              speculative_max_draft_tokens=3, speculative_tuning=False)  # 5/4 decoding: none, then drafts
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    spec = llm.engine.speculator
    print(f"cap 3: {spec.gated_steps} steps without drafts, drafted {spec.stats.drafted[:2]}, "
          f"accepted {spec.stats.accepted[:2]}")
    assert spec.gated_steps > 0 and spec.stats.accepted[0] > 0 and spec.stats.accepted[1] > 0
    kv = llm.engine.kv
    assert kv.allocator.num_free == kv.num_blocks


@pytest.mark.parametrize("end", ["stop_token", "max_tokens"])
def test_a_request_ending_inside_accepted_drafts(mtp_model, monkeypatch, end):
    """Drafts right (K = 3), so a stop token or max_tokens falls inside a run of accepted drafts: the output
    ends exactly where plain decoding ends, the drafts past it are dropped and every block comes back."""
    prompts = random_prompts(3, [6, 13, 21], 512, seed=12)
    full = [o.token_ids for o in LLM(str(mtp_model), dtype="float32", block_size=4).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))]
    if end == "stop_token":
        params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[f[6]]) for f in full]
    else:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 6, 7)]
    want = [o.token_ids for o in LLM(str(mtp_model), dtype="float32", block_size=4).generate(prompts, params)]
    monkeypatch.setattr(MtpSpeculator, "catch_up", _oracle({tuple(p): f for p, f in zip(prompts, full)}, 1 << 30))
    llm = LLM(str(mtp_model), dtype="float32", block_size=4, speculative="mtp", num_speculative_tokens=3)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert all(len(w) < 24 for w in want)
    stats = llm.engine.speculator.stats
    assert stats.accepted[2] > 0  # whole runs of drafts accepted
    kv = llm.engine.kv
    assert kv.allocator.num_free == kv.num_blocks


def test_the_engine_tunes_from_its_own_steps_with_plain_greedy_output(mtp_model):
    prompts = random_prompts(6, [5, 17, 30, 9, 3, 12], 512, seed=21)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(mtp_model), dtype="float32", block_size=4).generate(prompts, params)]
    llm = LLM(str(mtp_model), dtype="float32", block_size=4, speculative="mtp", num_speculative_tokens=3)
    spec = llm.engine.speculator
    assert spec.tuner is not None and not spec.tuner.buckets  # the warm-up's cold steps were forgotten
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    samples = {key: sum(b.samples) for key, b in spec.tuner.buckets.items()}
    assert samples and all(n > 0 for n in samples.values()), samples  # measured steps, by batch bucket
    assert any(b.samples[0] > 0 for b in spec.tuner.buckets.values())  # plain steps were tried too
    kv = llm.engine.kv
    assert kv.allocator.num_free == kv.num_blocks
