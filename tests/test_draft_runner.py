"""csrc/draft_runner.cpp: the Proposer's drafting (EAGLE-2 trees, EAGLE-1 layouts, sampled chains)
and committing as one C++ call each
(spec.propose.NATIVE) must grow the torch-op path's trees bit for bit, return the same head outputs
and leave the same head cache; it must take the calls it claims and decline the heads it cannot run."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from spec_helpers import sharp_random_head, single_thread
from tiny import tiny_config, tiny_model

from eaglespec import kernels
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.draft import init_random_head
from eaglespec.kv_cache import RowKVCache
from eaglespec.quant import quantize_model
from eaglespec.runtime.engine import Engine, Request
from eaglespec.spec import draft_quant
from eaglespec.spec import propose as propose_mod
from eaglespec.spec.propose import Proposer
from eaglespec.spec.sampling import RowSampling

pytestmark = pytest.mark.skipif(kernels.ops_kernel() is None or kernels.int8_kernel() is None,
                                reason="the package's CPU kernels did not build here")

CAPACITY = 96
PROMPT_LENGTHS = [9, 3, 14]


class Counting:
    """A DraftRunner that counts the calls it takes."""

    def __init__(self, runner) -> None:
        self.runner, self.calls = runner, collections.Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.runner, name)
        if name not in ("commit", "propose", "propose_static", "sample_chain", "sample_static"):
            return attr

        def counted(*args):
            self.calls[name] += 1
            return attr(*args)

        return counted


@pytest.fixture
def a8(monkeypatch):
    """Draft with the W8A8 products the runner calls, also where AMX would pick W8A16."""
    monkeypatch.setattr(draft_quant, "_acts", lambda in_features: "a8")


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config(hidden=64, inter=128, heads=2, kv_heads=1, vocab=96)  # head_dim 32: the kernels' unit
    target = tiny_model(cfg, seed=5, dtype=torch.bfloat16)
    head = sharp_random_head(cfg, seed=3, scale=0.2).to(torch.bfloat16)
    return target, head


def drive(target, head, tree_cfg: TreeConfig, native: bool, steps: int = 4, sampling: RowSampling | None = None):
    """B rows: commit each prompt's pairs, then `steps` rounds of propose (with `sampling`, if any)
    and a commit of a few random pairs (what acceptance would append). Returns every output, the
    final cache and the runner's call counts."""
    torch.manual_seed(0)  # (the rows' random pairs: the same for both paths)
    propose_mod.NATIVE = native
    try:
        proposer = Proposer(head, target, tree_cfg, int8=True)
        counting = None
        if proposer._native is not None:
            counting = proposer._native = Counting(proposer._native)
        c = head.config
        b = len(PROMPT_LENGTHS)
        cache = RowKVCache(1, c.num_kv_heads, c.head_dim, CAPACITY, b, torch.bfloat16)
        t = max(PROMPT_LENGTHS)
        tokens = torch.randint(0, c.vocab_size, (b, t))
        feats = torch.randn(b, t, c.hidden_size).bfloat16()
        count = torch.tensor(PROMPT_LENGTHS)
        committed = torch.zeros(b, dtype=torch.long)
        outs = []
        with torch.inference_mode(), single_thread():
            hidden = proposer.commit(cache, committed, tokens, feats, count, t)
            root = tokens.gather(1, (count - 1)[:, None])[:, 0]
            for _ in range(steps):
                view = int(cache.lengths.max()) + proposer.scratch
                tree = proposer.propose(cache, root, hidden, torch.full((b,), CAPACITY), view, sampling,
                                        torch.full((b,), 10 + len(outs)))
                outs.append((hidden.clone(), tree.tokens, tree.parents, tree.depth, tree.ancestors, tree.valid)
                            + (() if tree.draft_probs is None else (tree.draft_probs,)))
                n = torch.randint(1, 4, (b,))
                new_tokens = torch.randint(0, c.vocab_size, (b, 3))
                new_feats = torch.randn(b, 3, c.hidden_size).bfloat16()
                committed = cache.lengths.clone()
                hidden = proposer.commit(cache, committed, new_tokens, new_feats, n, int(committed.max()) + 3)
                root = new_tokens.gather(1, (n - 1)[:, None])[:, 0]
            outs.append((hidden.clone(),))
        return outs, (cache.k.clone(), cache.v.clone(), cache.lengths.clone()), counting
    finally:
        propose_mod.NATIVE = True


SMALL_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [0, 1, 0], [0, 1, 1]]
SHAPES = [("eagle2", (3, 2, 1)), ("eagle2", (8, 3, 2)), ("eagle2", (16, 5, 4)), ("eagle2", (6, 5, 1)),
          ("eagle2", (10, 2, 4)), ("eagle", None), ("eagle", SMALL_CHOICES)]


@pytest.mark.parametrize("method, shape", SHAPES, ids=[f"{m}-{s if m == 'eagle2' else 'layout'}-{i}"
                                                       for i, (m, s) in enumerate(SHAPES)])
@pytest.mark.parametrize("reduced", [False, True])
def test_native_drafting_is_the_torch_ops_bits(models, a8, method, shape, reduced):
    target, head = models
    if reduced:  # a reduced draft vocabulary of 32 target ids (the int8 kernel wants whole 16-row blocks)
        head = copy.deepcopy(head)
        head.set_vocab(torch.arange(0, 96, 3))
    if method == "eagle2":
        tree_cfg = TreeConfig("eagle2", *shape)
    else:  # EAGLE-1: the default static layout, or a small one
        tree_cfg = TreeConfig("eagle") if shape is None else TreeConfig("eagle", choices=shape)
    fast, fast_cache, counting = drive(target, head, tree_cfg, native=True)
    slow, slow_cache, none = drive(target, head, tree_cfg, native=False)
    assert counting is not None and none is not None
    assert counting.calls == {"commit": 5, "propose" if method == "eagle2" else "propose_static": 4}, \
        "the runner must take every call here"
    assert none.calls == {}, "NATIVE off must keep the torch ops"
    for a, b in zip(fast, slow, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    for x, y in zip(fast_cache, slow_cache, strict=True):
        assert torch.equal(x, y)
    assert int(fast[-2][3].max()) >= 2, "real trees: deeper than one level"


@pytest.mark.parametrize("shape", [(2, 1, 1), (3, 2, 1), (6, 5, 1), (4, 2, 2), (9, 2, 4), (12, 4, 4), "eagle1"])
@pytest.mark.parametrize("reduced, sharpness", [(False, 1.0), (True, 1.0), (True, 1.3)])
def test_native_sampled_chains_are_the_torch_ops_draws(models, a8, shape, reduced, sharpness):
    """Sampled rows (two temperatures) beside a greedy one: the same drafted tokens and the same q
    (with a head's draft_sharpness too), for chains and for sampled trees (siblings drawn without
    replacement)."""
    target, head = models
    if reduced:
        head = copy.deepcopy(head)
        head.set_vocab(torch.arange(0, 96, 3))
    if sharpness != 1.0:
        head.draft_sharpness = sharpness
    sampling = RowSampling.from_configs([SamplingConfig(temperature=1.0, seed=7), SamplingConfig(temperature=0.0),
                                         SamplingConfig(temperature=0.6, seed=8)])
    tree_cfg = TreeConfig("eagle") if shape == "eagle1" else TreeConfig("eagle2", *shape)  # EAGLE-1's default layout
    fast, fast_cache, counting = drive(target, head, tree_cfg, native=True, sampling=sampling)
    slow, slow_cache, none = drive(target, head, tree_cfg, native=False, sampling=sampling)
    if shape == "eagle1":
        shape = (fast[-2][1].shape[1], None, 10)
    assert counting.calls == {"commit": 5, "sample_chain" if shape[2] == 1 else "sample_static": 4}
    assert none.calls == {}
    for a, b in zip(fast, slow, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    for x, y in zip(fast_cache, slow_cache, strict=True):
        assert torch.equal(x, y)
    probs, parents = fast[-2][-1], fast[-2][2]  # [B, N, V]: q sums to 1 below every inner node, else 0
    inner = torch.zeros(3, shape[0], dtype=torch.bool).scatter_(1, parents[:, 1:], True)
    assert probs.shape == (3, shape[0], 96)
    assert torch.allclose(probs.sum(-1), inner.float())
    if shape[2] > 1:  # siblings are distinct draws
        for r in range(3):
            kids = parents[r] == 0
            assert fast[-2][1][r][kids].unique().numel() == int(kids.sum()) > 1


def test_ties_break_to_the_earlier_child(models, a8, monkeypatch):
    """With the LM head's logits made equal, every candidate ties: both paths must keep the
    earliest children (a stable order), not whatever a top-k happens to return."""
    target, head = models
    head = init_random_head(head.config, seed=1).to(torch.bfloat16)
    for native in (True, False):
        proposer = Proposer(head, target, TreeConfig("eagle2", 9, 3, 2), int8=True)
        assert proposer._native is not None
        flat = torch.full_like(proposer._lm, 0.01)  # equal LM rows: equal logits
        monkeypatch.setattr(proposer, "_lm_head", draft_quant.int8_linear(flat))
        proposer._native = propose_mod.native_runner(proposer.head, target, proposer._lm_head, proposer._draft_ids)
        propose_mod.NATIVE = native
        try:
            c = head.config
            cache = RowKVCache(1, c.num_kv_heads, c.head_dim, 32, 1, torch.bfloat16)
            with torch.inference_mode():
                hidden = proposer.commit(cache, torch.zeros(1, dtype=torch.long), torch.tensor([[4, 5]]),
                                         torch.randn(1, 2, c.hidden_size).bfloat16(), torch.tensor([2]), 2)
                tree = proposer.propose(cache, torch.tensor([5]), hidden, torch.tensor([32]), 2 + proposer.scratch)
        finally:
            propose_mod.NATIVE = True
        # Within a depth every value ties: the rerank keeps creation order, and the frontier is the
        # first K children (node 1's), so depth 3 hangs off node 3.
        assert tree.tokens[0].tolist() == [5, 0, 1, 0, 1, 0, 1, 0, 1], native
        assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 3], native


def test_declines_what_it_cannot_run(models, a8):
    target, head = models
    tree_cfg = TreeConfig("eagle2", 8, 3, 2)
    assert Proposer(head, target, tree_cfg, int8=True)._native is not None
    assert Proposer(head, target, tree_cfg, int8=False)._native is None  # bf16 products
    assert Proposer(copy.deepcopy(head).float(), copy.deepcopy(target).float(), tree_cfg)._native is None
    cfg = head.config
    eagle3 = init_random_head(cfg, kind="eagle3", dtype=torch.bfloat16)
    assert Proposer(eagle3, target, tree_cfg, int8=True)._native is None
    deep = init_random_head(cfg, num_layers=2, dtype=torch.bfloat16)
    assert Proposer(deep, target, tree_cfg, int8=True)._native is None


def test_engine_output_is_vanilla_with_the_runner(models, a8, monkeypatch):
    """Through the engine (greedy, int8 drafting): identical to plain decoding, with the runner
    taking the drafting calls."""
    target = quantize_model(copy.deepcopy(models[0]), "int4")  # row-invariant products: exact greedy
    head = models[1]
    made = []

    def counting_runner(*args):
        runner = native_runner(*args)
        if runner is not None:
            made.append(Counting(runner))
            return made[-1]
        return None

    native_runner = propose_mod.native_runner
    monkeypatch.setattr(propose_mod, "native_runner", counting_runner)
    engine = Engine(target, head, max_batch=2, draft_int8=True)
    prompts = [[5, 17, 3, 88, 41, 9, 60], [12, 2, 33, 4]]
    with single_thread():
        for p in prompts:
            plain = Request(p, "vanilla", None, SamplingConfig(temperature=0.0), max_new_tokens=24)
            spec = Request(p, "eagle2", TreeConfig("eagle2", 8, 3, 2), SamplingConfig(temperature=0.0),
                           max_new_tokens=24)
            engine.run([plain])
            engine.run([spec])
            assert spec.pending_tokens == plain.pending_tokens
    assert made and sum(r.calls["propose"] for r in made) > 0 and sum(r.calls["commit"] for r in made) > 0
