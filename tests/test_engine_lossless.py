"""Losslessness of the batched engine (runtime.Engine over spec.step.SpecStep), retargeted from the
reference-loop tests (test_speculative.py, test_verify.py):

* fp32 greedy output identical to vanilla, fuzzed, several requests of different lengths in one
  batch, with a draft that is often right (OracleProposer: the real proposer's trees, the
  target's tokens), so that long accepted runs, EOS and max_new_tokens inside a run, a full
  context window and trees cut short by the window all occur (counted, and required);
* random heads, reduced draft vocabularies, small trees with wide expansions;
* both KV caches after compaction, row by row, against fresh forwards;
* speculative sampling end to end: chi-square against the exact sequence distribution, with the
  statistic's power shown on deliberately wrong verification rules.

The engine's fixed-shape mode (capacity-wide views, power-of-two row buckets) is fuzzed and
sampled too. The last test is a regression test for idle rows.

Reference: the single-request loop (generate.generate_tokens) without a draft, i.e. vanilla.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglespec.config import (EAGLE1_CHOICES, QUANT_SAMPLED_TREE, QUANT_TREE, SAMPLED_TREE, TILES_SAMPLED_TREE,
                              SamplingConfig, TreeConfig, default_tree)
from eaglespec.draft import init_random_head
from eaglespec.kv_cache import RowKVCache
from eaglespec.quant import greedy_exact, quantize_model
from eaglespec.runtime.engine import Engine, Request
from eaglespec.spec import step as step_mod
from eaglespec.spec import verify as spec_verify
from eaglespec.spec import propose as propose_mod
from eaglespec.spec.propose import Proposer
from eaglespec.spec.rng import BONUS, DRAFT, draw, uniforms
from eaglespec.spec.sampling import RowSampling, row_probabilities
from eaglespec.spec.tree import acceptance_from_path
from eaglespec.tree import sampled_layout, static_layout

from spec_helpers import (OracleProposer, RecordingEngine, check_stats, chi_square_pvalue, cut_at_eos, engine_tokens,
                          exact_sequence_probs, run_generate, sharp_random_head, single_thread)
from tiny import FAMILIES, tiny_config, tiny_model

PASS_P = 1e-3  # a correct rule must not be rejected at this level (seeds are fixed)
FAIL_P = 1e-6  # a wrong rule must be rejected at this level

CHOICE_SETS = {
    "eagle1": EAGLE1_CHOICES,
    "chain4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "small": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    "wide": [[0], [1], [2], [3], [4], [5], [0, 0], [5, 0], [5, 0, 0]],
}


def oracle(seed: int = 0, p_oracle: float = 0.5, noise: float = 0.15, memo: bool = False):
    """A proposer factory for RecordingEngine: OracleProposer over a sharp random head's trees."""
    def make(head, target, tree_cfg):
        return OracleProposer(head, target, tree_cfg, seed, p_oracle, noise, memo)
    return make


def oracle_engine(target, seed: int = 0, p_oracle: float = 0.5, noise: float = 0.15, memo: bool = False,
                  **kw) -> RecordingEngine:
    head = sharp_random_head(target.config, seed=seed + 1).to(target.dtype)
    return RecordingEngine(target, head, proposer=oracle(seed, p_oracle, noise, memo), **kw)


# --- (a) greedy, fuzzed: several requests in one batch ------------------------------------------
@st.composite
def cases(draw):
    c = {
        "seed": draw(st.integers(0, 10**6)),
        "vocab": draw(st.sampled_from([8, 16, 50, 96])),
        "arch": draw(st.sampled_from(["llama", "llama", "qwen2"])),
        "tie": draw(st.booleans()),
        "method": draw(st.sampled_from(["eagle", "eagle2"])),
        "total": draw(st.integers(1, 60) | st.integers(1, 6)),
        "depth": draw(st.integers(1, 6)),
        "choices": draw(st.sampled_from(sorted(CHOICE_SETS))),
        "eos_at": draw(st.none() | st.integers(0, 39)),
        "drafter": draw(st.sampled_from(["oracle", "oracle", "oracle", "random_head"])),
        "window": draw(st.none() | st.integers(0, 4)),  # slack over the longest request; None: roomy
        "max_batch": draw(st.integers(1, 4)),
        "prefill_chunk": draw(st.sampled_from([3, 512])),
        "vanilla_too": draw(st.booleans()),  # one more request in the engine's vanilla lane
        "fixed_shapes": draw(st.booleans()),  # capacity-wide views, power-of-two row buckets
        "requests": draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 40), st.booleans()),
                                  min_size=2, max_size=4)),  # (prompt length, max_new, until full)
    }
    c["top_k"] = draw(st.integers(1, min(10, c["vocab"])))
    return c


def run_case(c: dict, seen: Counter) -> None:
    tight = c["window"] is not None
    window = max(n + m for n, m, _ in c["requests"]) + c["window"] if tight else 256
    if c.get("quant"):  # the CPU default mode: bf16 activations, every linear on an integer kernel
        cfg = tiny_config(arch=c["arch"], vocab=c["vocab"], max_pos=window, tie=c["tie"], hidden=64, inter=128)
        target = quantize_model(tiny_model(cfg, seed=c["seed"], dtype=torch.bfloat16), c["quant"])
        assert greedy_exact(target)
    else:
        cfg = tiny_config(arch=c["arch"], vocab=c["vocab"], max_pos=window, tie=c["tie"])
        target = tiny_model(cfg, seed=c["seed"])
    rng = random.Random(c["seed"])
    prompts = [[rng.randrange(c["vocab"]) for _ in range(n)] for n, _, _ in c["requests"]]
    # max_new_tokens None (until the window is full) only with a small window.
    budgets = [None if (tight and full) else m for _, m, full in c["requests"]]
    base = run_generate(target, prompts[0], max_new_tokens=budgets[0])
    eos = None if c["eos_at"] is None else base.tokens[c["eos_at"] % len(base.tokens)]
    eos_ids = [] if eos is None else [eos]
    vans = [run_generate(target, p, max_new_tokens=m, eos_ids=eos_ids) for p, m in zip(prompts, budgets)]
    assert vans[0].tokens == cut_at_eos(base.tokens, eos)

    if c["method"] == "eagle":
        tree = TreeConfig("eagle", choices=CHOICE_SETS[c["choices"]])
    else:
        tree = TreeConfig("eagle2", total_tokens=c["total"], depth=c["depth"], top_k=c["top_k"])
    if c["drafter"] == "oracle":
        engine = oracle_engine(target, seed=c["seed"], eos_ids=eos_ids, max_batch=c["max_batch"],
                               prefill_chunk=c["prefill_chunk"], fixed_shapes=c["fixed_shapes"])
    else:
        engine = RecordingEngine(target, init_random_head(cfg, seed=c["seed"], dtype=target.dtype), eos_ids=eos_ids,
                                 max_batch=c["max_batch"], prefill_chunk=c["prefill_chunk"],
                                 fixed_shapes=c["fixed_shapes"])
    reqs = [Request(p, c["method"], tree, max_new_tokens=m) for p, m in zip(prompts, budgets)]
    extra = [Request(prompts[-1], "vanilla", max_new_tokens=budgets[-1])] if c["vanilla_too"] else []
    engine.run(reqs + extra)
    (lane,) = [engine.lanes[k] for k in engine.lanes if k[0] != "vanilla"]
    budget, max_depth = lane.step_fn.budget, lane.step_fn.path_width - 1

    for req, van in zip(reqs + extra, vans + vans[-1:]):
        got = engine_tokens(req)
        assert got == van.tokens, c
        assert req.stats.stop_reason == van.stats.stop_reason, c
        check_stats(req.stats, got, max_depth)
        if req.max_new_tokens is None:
            assert req.stats.stop_reason in ("context_full", "eos")
            if req.stats.stop_reason == "context_full":
                assert len(req.prompt_ids) + len(got) == window

    # Every live row's step: the tree stayed inside the window, and what the fuzz exercised.
    log = lane.log
    for r in log:
        assert 1 <= r.count <= r.valid <= budget
        assert r.t_len + r.count <= window  # accepted nodes sit at positions < window
        assert r.t_len + r.valid <= window or r.valid == 1
    seen["examples"] += 1
    seen[c["method"]] += 1
    seen["fixed_shapes"] += c["fixed_shapes"]
    by_req: dict[int, list] = {}
    for r in log:
        by_req.setdefault(id(r.req), []).append(r)
    if any(r.count >= 4 for r in log):
        seen["long_run"] += 1
    if any(r.valid < budget for r in log):
        seen["tree_cut"] += 1  # a tree cut short near the window
    if len(reqs) > c["max_batch"]:
        seen["queued"] += 1
    lengths_per_step: dict[int, set] = {}
    for r in log:
        lengths_per_step.setdefault(r.step, set()).add(r.t_len)
    if any(len(v) > 1 for v in lengths_per_step.values()):
        seen["ragged_batch"] += 1  # rows of different lengths stepped together
    for req in reqs:
        recs = by_req.get(id(req), [])
        if not recs:
            continue
        last, emitted = recs[-1], req.stats.accept_lengths[-1]
        cut_inside = emitted <= last.count - 1  # the step's last emitted token was a drafted one
        if req.stats.stop_reason == "eos" and cut_inside:
            seen["eos_in_run"] += 1
            if emitted < last.count - 1:
                seen["eos_mid_run"] += 1  # accepted drafts after the EOS were dropped
        if req.stats.stop_reason == "max_new_tokens" and cut_inside:
            seen["max_new_in_run"] += 1
        if req.stats.stop_reason == "context_full":
            seen["context_full"] += 1


def test_greedy_lossless_fuzz():
    seen: Counter = Counter()

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases())
    def fuzz(c):
        run_case(c, seen)

    with single_thread():
        fuzz()
    # The fuzzing reached the cases that matter (hypothesis is derandomized: stable counts).
    for key in ("eagle", "eagle2", "long_run", "eos_in_run", "eos_mid_run", "max_new_in_run",
                "context_full", "tree_cut", "queued", "ragged_batch", "fixed_shapes"):
        assert seen[key] > 0, (key, seen)


@pytest.mark.parametrize("quant", ["int4", "int8", "int8a16"])
def test_greedy_lossless_fuzz_default_cpu_mode(quant):
    """The same fuzz in bf16 with quantised linears (the CPU default, which claims exactness like
    fp32): every request's output equals vanilla token for token."""
    seen: Counter = Counter()

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases())
    def fuzz(c):
        run_case({**c, "quant": quant}, seen)

    with single_thread():
        fuzz()
    for key in ("eagle", "eagle2", "long_run", "ragged_batch"):
        assert seen[key] > 0, (key, seen)


# --- (b) real drafts: a random head, a reduced draft vocabulary, small trees ----------------------
PROMPTS = [[3], [10, 20, 30, 40, 50, 60, 70], [5, 6, 7], list(range(1, 30))]


@pytest.fixture(scope="module")
def target96():
    return tiny_model(tiny_config(vocab=96), seed=5)


def vanilla(target, prompts, budgets, eos_ids=()):
    return [run_generate(target, p, max_new_tokens=m, eos_ids=list(eos_ids)) for p, m in zip(prompts, budgets)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_target(request):
    """A tiny target of each family (Gemma 3's window of 4 is far shorter than these sequences)."""
    return tiny_model(tiny_config(arch=request.param, vocab=96), seed=5)


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_greedy_lossless_random_head(family_target, method):
    """The real proposer with a random head (acceptance near zero), four rows: still identical."""
    target96 = family_target
    budgets = [40, 40, 25, 33]
    tree = TreeConfig(method, total_tokens=24, depth=6, top_k=6)
    with single_thread():
        refs = vanilla(target96, PROMPTS, budgets)
        engine = RecordingEngine(target96, init_random_head(target96.config, seed=9))
        reqs = engine.run([Request(p, method, tree, max_new_tokens=m) for p, m in zip(PROMPTS, budgets)])
    for req, ref in zip(reqs, refs):
        assert engine_tokens(req) == ref.tokens
        check_stats(req.stats, ref.tokens)
        assert req.stats.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
@pytest.mark.parametrize("vocab_size", [3, 20])
def test_reduced_draft_vocab_lossless_and_confined(target96, method, vocab_size):
    """A head with a reduced vocabulary proposes only its tokens (even when it holds fewer than
    top_k, or than the static tree's ranks), and every row's output still equals vanilla's."""
    head = init_random_head(target96.config, seed=9)
    allowed = torch.arange(0, 96, 96 // vocab_size)[:vocab_size]
    head.set_vocab(allowed)
    tree = TreeConfig(method, total_tokens=12, depth=4, top_k=5)
    budgets = [30, 30, 30]
    with single_thread():
        refs = vanilla(target96, PROMPTS[:3], budgets)
        engine = RecordingEngine(target96, head)
        reqs = engine.run([Request(p, method, tree, max_new_tokens=m) for p, m in zip(PROMPTS[:3], budgets)])
    assert [engine_tokens(r) for r in reqs] == [r.tokens for r in refs]
    (lane,) = engine.lanes.values()
    assert lane.proposer.drafted and lane.proposer.drafted <= set(allowed.tolist())


@pytest.mark.parametrize("total, depth, top_k", [(2, 6, 10), (3, 6, 10), (5, 8, 10), (1, 6, 10), (60, 6, 10),
                                                   (30, 3, 100)])
def test_small_tree_wide_expansion(total, depth, top_k):
    """EAGLE-2 drafts (depth - 1) * top_k tentative nodes whatever total_tokens is: a small tree
    with a wide expansion still fits the draft cache's scratch. top_k above the vocabulary (64)
    is clamped to it. Random head and oracle drafts, three rows."""
    cfg = tiny_config(vocab=64)
    target = tiny_model(cfg, seed=6)
    tree = TreeConfig("eagle2", total_tokens=total, depth=depth, top_k=top_k)
    prompts, budgets = [[9, 8, 7], [1], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 2]], [32, 20, 27]
    with single_thread():
        refs = vanilla(target, prompts, budgets)
        for engine in (RecordingEngine(target, init_random_head(cfg, seed=1)), oracle_engine(target, seed=3)):
            reqs = engine.run([Request(p, "eagle2", tree, max_new_tokens=m) for p, m in zip(prompts, budgets)])
            assert [engine_tokens(r) for r in reqs] == [r.tokens for r in refs]
            (lane,) = engine.lanes.values()
            assert lane.step_fn.budget <= total
            assert max(r.valid for r in lane.log) <= total


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("method, min_tau", [("eagle", 3.0), ("eagle2", 2.5)])
def test_oracle_draft_speeds_up(method, min_tau, arch):
    """A sanity check of the test draft itself: with the oracle always on, every row's tau is
    well above 1 (and the dynamic trees of its sharp random head are deep enough for long runs).
    Every family: long accepted paths through trees, sliding windows and expert routing."""
    cfg = tiny_config(arch=arch, vocab=64)
    target = tiny_model(cfg, seed=2)
    tree = TreeConfig(method, total_tokens=16, depth=5, top_k=4)
    prompts = [[1, 2, 3], [40, 2, 17, 9, 9]]
    with single_thread():
        refs = vanilla(target, prompts, [40, 40])
        engine = oracle_engine(target, p_oracle=1.0, noise=0.0)
        reqs = engine.run([Request(p, method, tree, max_new_tokens=40) for p in prompts])
    for req, ref in zip(reqs, refs):
        assert engine_tokens(req) == ref.tokens
        assert req.stats.tau > min_tau, req.stats.accept_lengths


# --- (c) the context window --------------------------------------------------------------------------
WINDOW = 40
NEAR = [(20, 20), (30, 10), (35, None), (12, None), (38, 2), (39, 1), (39, None), (3, None)]


def window_setups(target):
    cfg = target.config
    big = TreeConfig("eagle2", total_tokens=60, depth=6, top_k=10)
    return [
        ("eagle", oracle_engine(target, seed=1, p_oracle=0.7, noise=0.1, max_batch=8), TreeConfig("eagle")),
        ("eagle2", oracle_engine(target, seed=2, p_oracle=0.7, noise=0.1, max_batch=8), big),
        ("eagle2-random", RecordingEngine(target, init_random_head(cfg, seed=3), max_batch=8), big),
    ]


def test_near_the_window_equals_vanilla():
    """Rows near the end of the window in one batch (one token short, until full, a 60-node tree
    that no longer fits): trees are cut to the room left, accepted nodes stay inside the window,
    and every row's output and stop reason are vanilla's."""
    target = tiny_model(tiny_config(vocab=64, max_pos=WINDOW), seed=8)
    prompts = [[(5 * i + 3) % 64 for i in range(n)] for n, _ in NEAR]
    budgets = [m for _, m in NEAR]
    with single_thread():
        refs = vanilla(target, prompts, budgets)
        for (n, m), ref in zip(NEAR, refs):
            assert len(ref.tokens) == (WINDOW - n if m is None else m)
            assert ref.stats.stop_reason == ("context_full" if m is None else "max_new_tokens")
        for name, engine, tree in window_setups(target):
            method = name.split("-")[0]
            reqs = engine.run([Request(p, method, tree, max_new_tokens=m) for p, m in zip(prompts, budgets)])
            (lane,) = engine.lanes.values()
            for req, ref in zip(reqs, refs):
                assert engine_tokens(req) == ref.tokens, (name, len(req.prompt_ids))
                assert req.stats.stop_reason == ref.stats.stop_reason, name
                check_stats(req.stats, ref.tokens)
            assert all(r.t_len + r.count <= WINDOW for r in lane.log), name
            assert all(r.valid == min(lane.step_fn.budget, WINDOW - r.t_len) for r in lane.log), name
            assert any(r.valid < lane.step_fn.budget for r in lane.log), name  # some trees were cut


def test_capacity_grows_mid_flight():
    """A longer request joins a lane whose KV caches were sized for a short one: they grow while
    the short one is in flight, and every row's output is still vanilla's."""
    target = tiny_model(tiny_config(vocab=64, max_pos=700), seed=3)
    tree = TreeConfig("eagle2", total_tokens=16, depth=5, top_k=4)
    specs = [([5, 1, 2], 30), (list(range(1, 50)), 400), ([9], 120)]
    with single_thread():
        refs = vanilla(target, *zip(*specs))
        engine = oracle_engine(target, p_oracle=0.8, noise=0.1, max_batch=2)
        reqs = [engine.submit(Request(specs[0][0], "eagle2", tree, max_new_tokens=specs[0][1]))]
        engine.step()
        engine.step()
        (lane,) = engine.lanes.values()
        small = lane.state.target_cache.capacity
        reqs += [engine.submit(Request(p, "eagle2", tree, max_new_tokens=m)) for p, m in specs[1:]]
        engine.step()
        assert not reqs[0].done and lane.state.target_cache.capacity > small
        while engine.step():
            pass
    assert [engine_tokens(r) for r in reqs] == [r.tokens for r in refs]


# --- (d) KV caches after compaction ------------------------------------------------------------------
class FreshRow:
    """What a row holding `seq` (its tokens, the newest one last) should hold, from scratch: the
    target KV of a fresh forward over seq[:-1], the draft KV and root_hidden of a fresh commit of
    its pairs (x[t+1], f[t]) with the target's real features, and the tree a fresh single-row
    proposer grows from there."""

    def __init__(self, target, proposer: Proposer, seq: list[int]) -> None:
        n = len(seq) - 1
        self.target_kv = target.new_cache(n)
        out = target(torch.tensor(seq[:n])[None], torch.arange(n)[None], self.target_kv)
        hc = proposer.head.config
        self.draft_kv = RowKVCache(1, hc.num_kv_heads, hc.head_dim, n + proposer.scratch, 1)
        self.hidden = proposer.commit(self.draft_kv, torch.zeros(1, dtype=torch.long), torch.tensor(seq[1:])[None],
                                      out.features, torch.tensor([n]), n)
        room = torch.tensor([target.config.max_position_embeddings - n]).clamp(min=1)
        self.tree = proposer.propose(self.draft_kv, torch.tensor(seq[-1:]), self.hidden, room, n + proposer.scratch)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["exact", "fixed"])
@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_kv_caches_after_compaction(method, fixed_shapes, arch):
    """After every engine step, each live row's committed target KV entries are those of a fresh
    forward over its tokens (prompt + output, the newest excepted), and its draft entries and
    root_hidden those of a fresh commit of its pairs (x[t+1], f[t]) with the target's real
    features. And every tree the engine proposes for a row (reused rows' first ones included) is
    the one a fresh single-row proposer grows from that state. Four requests in three rows.
    Gemma 3: sliding-window layers after compaction (slots moved, positions contiguous)."""
    cfg = tiny_config(arch=arch, vocab=32, max_pos=128)
    target = tiny_model(cfg, seed=21)
    tree = (TreeConfig("eagle2", total_tokens=20, depth=5, top_k=3) if method == "eagle2"
            else TreeConfig("eagle"))
    prompts = [[4, 9, 1, 30, 2], [7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 8, 8, 2]]
    budgets = [40, 12, 30, 25]
    checked, proposals = Counter(), {}
    with single_thread(), torch.inference_mode():
        engine = oracle_engine(target, seed=4, p_oracle=0.9, noise=0.3, max_batch=3, fixed_shapes=fixed_shapes)
        reqs = [engine.submit(Request(p, method, tree, max_new_tokens=m)) for p, m in zip(prompts, budgets)]
        fresh_proposer = Proposer(engine.head, target, tree)

        def check_proposal(row, ctx, proposed, b):
            want = FreshRow(target, fresh_proposer, ctx).tree
            for f in ("tokens", "parents", "valid"):
                assert torch.equal(getattr(proposed, f)[b], getattr(want, f)[0]), (f, row, len(ctx))
            proposals.setdefault(id(lane.requests[row]), []).append(len(ctx))

        lane = engine._lane(reqs[0])  # the lane all four share, made before they are admitted
        lane.proposer.on_propose = check_proposal
        while engine.step():
            s = lane.state
            for r in lane.active:
                req = lane.requests[r]
                seq = req.prompt_ids + engine_tokens(req)
                n = len(seq) - 1
                assert int(s.target_cache.lengths[r]) == n == lane.lengths[r]
                assert int(s.draft_cache.lengths[r]) == n
                assert int(s.root[r]) == seq[-1]
                fresh = FreshRow(target, fresh_proposer, seq)
                for name in ("k", "v"):
                    torch.testing.assert_close(getattr(s.target_cache, name)[:, r, :, :n],
                                               getattr(fresh.target_kv, name)[:, 0], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(getattr(s.draft_cache, name)[:, r, :, :n],
                                               getattr(fresh.draft_kv, name)[:, 0, :, :n], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(s.root_hidden[r], fresh.hidden[0], rtol=1e-4, atol=1e-4)
                checked[id(req)] += 1
    refs = vanilla(target, prompts, budgets)
    assert [engine_tokens(r) for r in reqs] == [r.tokens for r in refs]
    assert sum(checked.values()) >= 25 and set(checked) == {id(r) for r in reqs}  # the reused row's too
    # Every request's trees were checked from its first on (right after its prefill).
    assert [proposals[id(r)][0] for r in reqs] == [len(p) + 1 for p in prompts]
    # Accepted paths that needed slots moved, not just a prefix kept.
    assert sum(r.path != list(range(r.count)) for r in lane.log) >= 3


# --- (e) speculative sampling end to end, with power -----------------------------------------------
PROMPT = [1, 2, 3, 4]
NEW = 3
SMALL_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
E2E = [  # (method, sampling, fixed_shapes)
    ("eagle", SamplingConfig(temperature=1.0), False),
    ("eagle2", SamplingConfig(temperature=1.0), False),
    ("eagle2", SamplingConfig(temperature=0.7, top_k=4), True),
    ("eagle", SamplingConfig(temperature=0.9, top_p=0.8), True),
]


@pytest.fixture(scope="module")
def small_target():
    cfg = tiny_config(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, inter=32)
    return tiny_model(cfg, seed=1, scale=2.0)


def tree_for(method: str) -> TreeConfig | None:
    if method == "vanilla":
        return None
    if method == "eagle":
        return TreeConfig("eagle", choices=SMALL_CHOICES)
    return TreeConfig("eagle2", total_tokens=8, depth=3, top_k=3)


def sample_engine(target, method: str, cfg: SamplingConfig, n: int, seed0: int = 0, wave: int = 64,
                  fixed_shapes: bool = False):
    """n requests (seeds seed0..) through one engine, 8 rows at a time, with the deterministic
    oracle draft. Returns (Counter of outputs, accepted drafts in total)."""
    engine = oracle_engine(target, p_oracle=1.0, noise=0.0, memo=True, max_batch=8, fixed_shapes=fixed_shapes)
    reqs = [Request(PROMPT, method, tree_for(method), dataclasses.replace(cfg, seed=seed0 + s), NEW)
            for s in range(n)]
    with single_thread():
        for a in range(0, n, wave):  # in waves: the engine scans its whole queue every step
            engine.run(reqs[a:a + wave])
    counts, accepted = Counter(), 0
    for r in reqs:
        out = engine_tokens(r)
        assert len(out) == NEW
        counts[tuple(out)] += 1
        accepted += sum(a - 1 for a in r.stats.accept_lengths)
    return counts, accepted


@pytest.mark.parametrize("method, cfg, fixed_shapes", E2E,
                         ids=["eagle-t1", "eagle2-t1", "eagle2-t0.7-topk4-fixed", "eagle-topp0.8-fixed"])
def test_engine_sampling_lossless(small_target, method, cfg, fixed_shapes):
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    n = 1500
    counts, accepted = sample_engine(small_target, method, cfg, n, fixed_shapes=fixed_shapes)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert df >= 15, df
    assert pval > PASS_P, (stat, df)
    assert accepted > 0.3 * n  # the drafts were informative: many draft tokens were accepted


def test_engine_sampling_lossless_moe():
    """Speculative sampling on a tiny Mixtral-style MoE target: the output distribution is the
    target's (every tree node routes to its own experts)."""
    cfg = dataclasses.replace(tiny_config(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, inter=32),
                              architecture="mixtral", num_experts=4, experts_per_token=2)
    target = tiny_model(cfg, seed=1, scale=2.0)
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_sequence_probs(target, PROMPT, sampling, NEW)
    n = 1500
    counts, accepted = sample_engine(target, "eagle2", sampling, n)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert df >= 15, df
    assert pval > PASS_P, (stat, df)
    assert accepted > 0.3 * n


def verify_first_child(tree, logits, sampling, step, *, max_children=None):
    """WRONG (sampled rows): always accept the first valid child, down to a leaf; the bonus is
    drawn from the target at the last node. Greedy rows verify as usual."""
    real = spec_verify.verify(tree, logits, sampling, step, max_children=max_children)
    b, n = tree.tokens.shape
    parents, valid = tree.parents.tolist(), tree.valid.tolist()
    paths, nodes = [], []
    for r in range(b):
        path = [0]
        while True:
            kids = [j for j in range(1, n) if valid[r][j] and parents[r][j] == path[-1]]
            if not kids:
                break
            path.append(kids[0])
        nodes.append(path[-1])
        paths.append(path + [path[-1]] * (tree.max_depth + 1 - len(path)))
    path, node = torch.tensor(paths), torch.tensor(nodes)
    count = torch.tensor([len(set(p)) for p in paths])
    p = row_probabilities(logits[torch.arange(b), node], sampling)
    wrong = acceptance_from_path(tree, path, count, draw(p, uniforms(sampling.seed, step, node, BONUS)))
    g = sampling.greedy
    return dataclasses.replace(wrong, **{f: torch.where(g.view(-1, *([1] * (getattr(real, f).dim() - 1))),
                                                       getattr(real, f), getattr(wrong, f))
                                          for f in ("path", "count", "emitted", "bonus")})


def no_zeroing(monkeypatch):
    """WRONG: a rejected draft token keeps its mass in p (accept with p(x), never remove x).
    Broken in the torch ops, so verification is routed to them (a CPU runs temperature-only rows
    through csrc/sampling.cpp, whose agreement with the oracle tests/test_batch_verify.py checks)."""
    monkeypatch.setattr(spec_verify, "ops_kernel", lambda: None)
    monkeypatch.setattr(spec_verify, "_residual", lambda p, q, x: p)


def first_child(monkeypatch):
    monkeypatch.setattr(step_mod, "verify", verify_first_child)


@pytest.mark.parametrize("wrong, n", [(no_zeroing, 500), (first_child, 200)])
def test_engine_sampling_statistic_has_power(small_target, monkeypatch, wrong, n):
    cfg = SamplingConfig(temperature=1.0)
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    wrong(monkeypatch)
    counts, _ = sample_engine(small_target, "eagle2", cfg, n)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert pval < FAIL_P, (stat, df)


def test_engine_vanilla_sampling_matches_exact(small_target):
    """The reference itself, through the engine's vanilla lane: plain sampling fits it, and the
    statistic rejects the reference of a different temperature."""
    cfg = SamplingConfig(temperature=1.0)
    counts, accepted = sample_engine(small_target, "vanilla", cfg, 800)
    assert accepted == 0
    assert chi_square_pvalue(counts, exact_sequence_probs(small_target, PROMPT, cfg, NEW))[0] > PASS_P
    other = exact_sequence_probs(small_target, PROMPT, SamplingConfig(temperature=0.8), NEW)
    assert chi_square_pvalue(counts, other)[0] < FAIL_P


# --- sampled chain drafts (eagle2 with top-k 1 at T > 0) ------------------------------------------
CHAIN = TreeConfig("eagle2", total_tokens=3, depth=2, top_k=1)


def sampled_engine(target, cfg: SamplingConfig, n: int, greedy_every: int = 0, fixed_shapes: bool = False,
                 sharpness: float = 1.0, tree: TreeConfig = CHAIN):
    """n sampled requests (seeds 0..) through a real (random) head with the chain tree (or
    `tree`), 8 rows a step; every `greedy_every`-th request in between is greedy (a mixed batch).
    Returns (Counter of the sampled outputs, accepted drafts of the sampled requests, the greedy
    requests). sharpness: the head's draft_sharpness (its drafts drawn from softmax(s * logits / T))."""
    head = init_random_head(target.config, seed=3)
    head.draft_sharpness = sharpness
    engine = RecordingEngine(target, head, max_batch=8, fixed_shapes=fixed_shapes)
    reqs, sampled, greedy = [], [], []
    for s in range(n):
        r = Request(PROMPT, tree.method, tree, dataclasses.replace(cfg, seed=s), NEW)
        reqs.append(r)
        sampled.append(r)
        if greedy_every and s % greedy_every == 0:
            greedy.append(Request(PROMPT, tree.method, tree, SamplingConfig(), NEW))
            reqs.append(greedy[-1])
    with single_thread():
        for a in range(0, len(reqs), 64):
            engine.run(reqs[a:a + 64])
    counts = Counter(tuple(engine_tokens(r)) for r in sampled)
    return counts, sum(sum(a - 1 for a in r.stats.accept_lengths) for r in sampled), greedy


@pytest.mark.parametrize("cfg, greedy_every, fixed_shapes, sharpness", [
    (SamplingConfig(temperature=1.0), 0, False, 1.0),
    (SamplingConfig(temperature=0.8, top_k=5), 4, True, 1.0),
    (SamplingConfig(temperature=1.0), 0, False, 2.5),
], ids=["t1", "t0.8-topk5-mixed-fixed", "t1-sharpness2.5"])
def test_sampled_chain_lossless(small_target, cfg, greedy_every, fixed_shapes, sharpness):
    """Chain drafts sampled from the head's q and verified by min(1, p/q): the output is the
    target's distribution, greedy rows in the same batch stay equal to greedy vanilla, and the
    drafts are accepted often (sum(min(p, q)), not p(top-1)). A head's draft_sharpness changes q
    (a much sharper one here), never the output's distribution."""
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    n = 1500
    counts, accepted, greedy = sampled_engine(small_target, cfg, n, greedy_every, fixed_shapes, sharpness)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert df >= 15, df
    assert pval > PASS_P, (stat, df)
    assert accepted > 0.2 * n  # a random head's q, and still a fifth of the drafts pass
    assert len(greedy) == (n + greedy_every - 1) // greedy_every if greedy_every else not greedy
    want = vanilla(small_target, [PROMPT], [NEW])[0].tokens
    assert all(engine_tokens(r) == want for r in greedy)


def three_committed_rows(p: Proposer, target, configs: list[SamplingConfig], capacity: int):
    """Rows with these settings whose head caches hold three committed pairs (root token 4 next):
    (RowSampling, the head cache, root_hidden, step counters 5, 5, 9)."""
    head, b = p.head, len(configs)
    cache = RowKVCache(head.cache_layers, head.config.num_kv_heads, head.config.head_dim, capacity, b,
                       head.fc.weight.dtype, "cpu")
    tokens = torch.tensor([[1, 2, 3]] * b)
    feats = torch.randn(b, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = p.commit(cache, torch.zeros(b, dtype=torch.long), tokens, feats, torch.full((b,), 3), 3 + 3)
    return RowSampling.from_configs(configs, "cpu"), cache, hidden, torch.tensor([5, 5, 9])[:b]


def test_sampled_chain_drafts_come_from_q(small_target):
    """The proposer's sampled chain: each drafted token is the draw of its DRAFT uniform from the
    q stored for its parent, q is the head's distribution under the row's settings (zero outside
    the draft vocabulary), the leaf row is empty, and a greedy row gets the top-1 chain."""
    head = init_random_head(small_target.config, seed=3)
    vocab = torch.tensor([0, 2, 3, 5, 7])
    head.set_vocab(vocab)
    p = Proposer(head, small_target, CHAIN)
    assert p.samples_chain and p.budget == 3 and p.max_depth == 2
    configs = [SamplingConfig(1.0, seed=7), SamplingConfig(), SamplingConfig(0.7, top_k=2, seed=8)]
    sampling, cache, hidden, step = three_committed_rows(p, small_target, configs, 16)
    b = len(configs)
    with torch.no_grad():
        tree = p.propose(cache, torch.tensor([4, 4, 4]), hidden, torch.full((b,), 3), 3 + p.scratch, sampling, step)
        greedy = p.propose(cache, torch.tensor([4, 4, 4]), hidden, torch.full((b,), 3), 3 + p.scratch)
    q = tree.draft_probs
    assert q.shape == (b, 3, small_target.config.vocab_size)
    assert torch.all(q[:, 2] == 0) and torch.allclose(q[:, :2].sum(-1), torch.ones(b, 2))
    outside = torch.ones(small_target.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.all(q[:, :2, outside] == 0)
    assert tree.parents.tolist() == [[-1, 0, 1]] * b
    assert (q[2, :2] > 0).sum(-1).tolist() == [2, 2]  # the row's top-k 2 applies to q too
    with torch.no_grad():
        root_logits = torch.nn.functional.linear(hidden, small_target.lm_head.weight[vocab]).float()
    assert torch.allclose(q[0, 0, vocab], root_logits[0].softmax(-1), atol=1e-5)
    for r in (0, 2):
        for d in (1, 2):
            u = uniforms(sampling.seed[r:r + 1], step[r:r + 1], torch.tensor([d]), DRAFT)
            assert int(tree.tokens[r, d]) == int(draw(q[r:r + 1, d - 1], u)[0])
    assert tree.tokens[1].tolist() == greedy.tokens[1].tolist()  # the greedy row: the top-1 chain
    head.draft_sharpness = 1.7  # drafts drawn from softmax(1.7 * logits / T)
    sharp = Proposer(head, small_target, CHAIN)
    with torch.no_grad():
        tree = sharp.propose(cache, torch.tensor([4, 4, 4]), hidden, torch.full((b,), 3), 3 + p.scratch, sampling, step)
    assert torch.allclose(tree.draft_probs[0, 0, vocab], (1.7 * root_logits[0]).softmax(-1), atol=1e-5)
    assert tree.tokens[1].tolist() == greedy.tokens[1].tolist()


def test_sampled_eagle2_requests_default_to_a_chain(small_target):
    """Without a tree, a sampled eagle2 request gets a chain (its drafts are sampled): SAMPLED_TREE on
    a float target, TILES_SAMPLED_TREE on int8a16, QUANT_SAMPLED_TREE on int4 / int8; a greedy one
    TreeConfig's default, or QUANT_TREE on int4 / int8; eagle its static tree."""
    assert default_tree("eagle2", "none", 0.7) == TreeConfig("eagle2", **SAMPLED_TREE)
    assert SAMPLED_TREE["top_k"] == TILES_SAMPLED_TREE["top_k"] == QUANT_SAMPLED_TREE["top_k"] == 1
    assert default_tree("eagle2", "none", 0.0) == default_tree("eagle2") == TreeConfig("eagle2")
    assert default_tree("eagle2", "int4") == default_tree("eagle2", "int8") == TreeConfig("eagle2", **QUANT_TREE)
    assert default_tree("eagle2", "int4", 1.0) == TreeConfig("eagle2", **QUANT_SAMPLED_TREE)
    assert default_tree("eagle", "none", 1.0) == default_tree("eagle", "int4") == TreeConfig("eagle")
    assert default_tree("eagle2", "int8a16") == TreeConfig("eagle2")  # AMX: a tree costs about a decode
    assert default_tree("eagle2", "int8a16", 1.0) == TreeConfig("eagle2", **TILES_SAMPLED_TREE)
    engine = Engine(small_target, init_random_head(small_target.config, seed=3))
    with single_thread():
        sampled, greedy = engine.run([Request(PROMPT, "eagle2", None, SamplingConfig(1.0, seed=1), NEW),
                                      Request(PROMPT, "eagle2", None, SamplingConfig(), NEW)])
    assert sampled.tree == TreeConfig("eagle2", **SAMPLED_TREE) and greedy.tree == TreeConfig("eagle2")
    assert engine.lanes[("eagle2", 3, 2, 1)].proposer.samples_chain


def test_sampled_chain_statistic_has_power(small_target, monkeypatch):
    """A wrong p/q rule for the sampled chain (after a rejection, draw from p instead of the
    residual max(0, p - q)) is rejected by the same statistic. (Verifying the sampled tokens as
    top-k drafts, accept with p(x), would not be wrong: that rule holds for any draft token.)"""
    cfg = SamplingConfig(temperature=1.0)
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    no_zeroing(monkeypatch)
    counts, _, _ = sampled_engine(small_target, cfg, 600)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert pval < FAIL_P, (stat, df)


# --- sampled trees (eagle2 with top-k > 1 at T > 0) ----------------------------------------------
SAMPLED_TREE_CFG = TreeConfig("eagle2", total_tokens=8, depth=3, top_k=3)


WIDE_TREE = TreeConfig("eagle2", total_tokens=9, depth=2, top_k=4)  # the root has 4 sampled children


@pytest.mark.parametrize("cfg, greedy_every, fixed_shapes, sharpness, tree", [
    (SamplingConfig(temperature=1.0, top_p=0.9), 0, False, 1.0, SAMPLED_TREE_CFG),
    (SamplingConfig(temperature=0.8, top_k=3), 4, True, 1.0, WIDE_TREE),
    (SamplingConfig(temperature=1.0), 0, False, 10.0, WIDE_TREE),
    (SamplingConfig(temperature=0.9), 3, False, 1.0, TreeConfig("eagle", choices=SMALL_CHOICES)),
], ids=["t1-topp0.9-8,3,3", "t0.8-topk3-mixed-fixed-9,2,4", "t1-sharpness10-9,2,4", "eagle1-t0.9-mixed"])
def test_sampled_tree_lossless(small_target, cfg, greedy_every, fixed_shapes, sharpness, tree):
    """Sibling drafts drawn from the head's q without replacement (tree.sampled_layout's shape),
    verified by the p/q rounds that remove each rejected draft from q: the target's distribution,
    greedy rows in the same batch equal to greedy vanilla. With top-k 3 a node's q holds three
    tokens, fewer than four siblings: the fourth draws from no mass and is never accepted. An
    EAGLE-1 layout whose siblings are in rank order is drawn the same way."""
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    n = 1500
    counts, accepted, greedy = sampled_engine(small_target, cfg, n, greedy_every, fixed_shapes, sharpness, tree)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert df >= 15, df
    assert pval > PASS_P, (stat, df)
    assert accepted > 0.1 * n  # a random head's q (a tenth even when sharpened tenfold)
    want = vanilla(small_target, [PROMPT], [NEW])[0].tokens
    assert all(engine_tokens(r) == want for r in greedy)


def test_sampled_tree_beats_its_chain_and_the_top_k_tree(small_target, monkeypatch):
    """What the sampled siblings are for: more accepted drafts than the chain of the same depth
    (later siblings catch what the first missed) and than the reranked top-k tree verified with
    q = 1 (SAMPLED_TREES off), on the same requests."""
    cfg = SamplingConfig(temperature=1.0)
    chain = TreeConfig("eagle2", total_tokens=4, depth=3, top_k=1)
    accepted = {name: sampled_engine(small_target, cfg, 300, tree=t)[1]
                for name, t in (("chain", chain), ("tree", SAMPLED_TREE_CFG))}
    monkeypatch.setattr(propose_mod, "SAMPLED_TREES", False)
    top_k = sampled_engine(small_target, cfg, 300, tree=SAMPLED_TREE_CFG)[1]
    assert accepted["tree"] > 1.1 * max(accepted["chain"], top_k), (accepted, top_k)


def test_sampled_tree_statistic_has_power(small_target, monkeypatch):
    """WRONG: siblings drawn *with* replacement (each from the whole q) while verification removes
    each rejected draft from q. With a sharp q (the lossless case "t1-sharpness10-9,2,4") the
    later siblings repeat the rejected first one, and verification then takes the residual of a q
    they were not drawn from: rejected by the same statistic. (With a flat q the error is a few
    percent of an output's probability, beyond what 600 samples see.)"""
    cfg = SamplingConfig(temperature=1.0)
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    monkeypatch.setattr(propose_mod, "_without", lambda q, x: q)
    counts, _, _ = sampled_engine(small_target, cfg, 600, sharpness=10.0, tree=WIDE_TREE)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert pval < FAIL_P, (stat, df)


def test_eagle1_layouts_out_of_rank_order_keep_top_k_drafts(small_target):
    """An EAGLE-1 layout with a rank-2 child and no rank-1 sibling cannot hold draws without
    replacement (verification would try the second draw against the first q): sampled rows get
    its top-k drafts, verified with q = 1; one in rank order gets draws and their q."""
    head = init_random_head(small_target.config, seed=3)
    configs = [SamplingConfig(1.0, seed=7), SamplingConfig()]
    for choices, drawn in (([[0], [2], [0, 0]], False), ([[0], [1], [0, 0]], True)):
        p = Proposer(head, small_target, TreeConfig("eagle", choices=choices))
        sampling, cache, hidden, step = three_committed_rows(p, small_target, configs, 16)
        with torch.no_grad():
            tree = p.propose(cache, torch.tensor([4, 4]), hidden, torch.full((2,), 4), 3 + p.scratch, sampling, step)
        assert (tree.draft_probs is not None) == drawn


def test_sampled_tree_drafts_come_from_q_without_replacement(small_target):
    """The proposer's sampled tree: tree.sampled_layout's shape; each sibling is the draw of its
    DRAFT uniform (id parent * max_children + rank) from its parent's q with the earlier siblings
    removed; q is stored per parent; a greedy row gets the layout's top-k tokens. (The torch ops:
    tests/test_draft_runner.py shows the C++ runner's draws are theirs.)"""
    head = init_random_head(small_target.config, seed=3)
    cfg = TreeConfig("eagle2", total_tokens=12, depth=3, top_k=4)
    p = Proposer(head, small_target, cfg)
    layout = static_layout(sampled_layout(12, 3, 4))
    configs = [SamplingConfig(1.0, seed=7), SamplingConfig(), SamplingConfig(0.7, top_p=0.95, seed=8)]
    sampling, cache, hidden, step = three_committed_rows(p, small_target, configs, 32)
    b = len(configs)
    with torch.no_grad():
        tree = p.propose(cache, torch.tensor([4, 4, 4]), hidden, torch.full((b,), 12), 3 + p.scratch, sampling, step)
        top = p._static(cache, torch.tensor([4, 4, 4]), hidden, 3 + p.scratch, p._sampled_plan)[0]
    assert tree.parents[0].tolist() == layout.parents and tree.depth[0].tolist() == layout.depth
    assert max(layout.ranks) == 3 and max(layout.depth) == 3
    q = tree.draft_probs
    inner = sorted(set(layout.parents[1:]))
    leaves = [i for i in range(12) if i not in inner]
    assert torch.all(q[:, leaves] == 0) and torch.allclose(q[:, inner].sum(-1), torch.ones(b, len(inner)))
    for r in (0, 2):
        for parent in inner:
            left = q[r, parent]
            kids = [i for i in range(12) if layout.parents[i] == parent]
            for rank, i in enumerate(kids):
                draw_id = torch.tensor([parent * p.max_children + rank])
                u = uniforms(sampling.seed[r:r + 1], step[r:r + 1], draw_id, DRAFT)
                assert int(tree.tokens[r, i]) == int(draw(left[None], u)[0])
                left = left.clone()
                left[tree.tokens[r, i]] = 0  # (draw scales by what is left: renormalised)
            assert len({int(tree.tokens[r, i]) for i in kids}) == len(kids)
    assert tree.tokens[1].tolist() == top[1].tolist()


# --- regression: idle rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["exact", "fixed"])
def test_idle_row_does_not_outgrow_the_cache(fixed_shapes):
    """Regression: row 0 finishes after one step; row 1 (sampled, so it accepts little) runs on. The
    idle row 0 keeps being stepped greedily (its lengths must stay pinned at 0, else it outgrows the
    KV cache: IndexError for the live request), and with this target (every logit 0: greedy always says token
    0, which the draft's rank-0 chain proposes) it accepts the whole chain every step."""
    cfg = tiny_config(vocab=96, max_pos=1024)
    target = tiny_model(cfg, seed=5)
    with torch.no_grad():
        target.lm_head.weight.zero_()
    tree = TreeConfig("eagle", choices=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]])
    live = dict(method="eagle", tree=tree, sampling=SamplingConfig(1.0, seed=0), max_new_tokens=200)
    with single_thread():
        head = init_random_head(cfg, seed=9)
        (alone,) = Engine(target, head, max_batch=2, fixed_shapes=fixed_shapes).run([Request([4, 5, 6], **live)])
        engine = Engine(target, head, max_batch=2, fixed_shapes=fixed_shapes)
        _, long = engine.run([Request([1, 2, 3], "eagle", tree, max_new_tokens=2), Request([4, 5, 6], **live)])
    assert engine_tokens(long) == engine_tokens(alone)
