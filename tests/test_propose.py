"""The batched drafter (spec.propose.Proposer) against the reference host-side Drafter: B rows with
prompts of different lengths in one batch must get, row by row, exactly the trees Drafter.draft
grows (EAGLE-2 dynamic and EAGLE-1 static, reduced draft vocabularies included), before and after
a commit of accepted pairs; and propose/commit must never read a tensor back to the host."""

from __future__ import annotations

import copy

import pytest
import torch

from eaglespec.config import TreeConfig
from eaglespec.draft import Drafter
from eaglespec.kv_cache import RowKVCache
from eaglespec.spec.propose import Proposer

from spec_helpers import SyncCounter, sharp_random_head, single_thread
from tiny import tiny_config, tiny_model

PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [70], [12, 2, 33, 4], [1, 94, 50, 50, 8, 23, 77, 31, 6, 40, 11]]
SMALL_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [0, 1, 0], [0, 1, 1]]
CAPACITY = 160


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config(vocab=96, max_pos=512)
    target = tiny_model(cfg, seed=11)
    head = sharp_random_head(cfg, seed=3, scale=0.2)  # deep, lopsided, varied EAGLE-2 trees
    small = copy.deepcopy(head)  # the same head over a reduced draft vocabulary
    small.set_vocab(torch.tensor([3, 9, 17, 40, 41, 60, 88]))
    return target, head, small


@pytest.fixture(scope="module")
def peaked(models):
    """A head so sharp that many child log-probabilities round to 0 in fp32: candidate values tie
    exactly, so the rerank's tie-breaking (shallower, then earlier) decides the tree."""
    return sharp_random_head(models[0].config, seed=3, scale=0.3)


class Rows:
    """B rows driven in lockstep: a Proposer over one RowKVCache, and one reference Drafter per row."""

    def __init__(self, target, head, tree_cfg: TreeConfig, prompts: list[list[int]]) -> None:
        self.target, self.cfg = target, tree_cfg
        self.proposer = Proposer(head, target, tree_cfg)
        c = head.config
        self.cache = RowKVCache(head.cache_layers, c.num_kv_heads, c.head_dim, CAPACITY, len(prompts))
        self.drafters = [Drafter(head, target) for _ in prompts]
        self.states, self.roots = [], []
        tokens, feats = [], []
        for p, dr in zip(prompts, self.drafters):  # the target's prompt pass, then its pairs (x[t+1], f[t])
            cache = target.new_cache(len(p))
            out = target(torch.tensor(p)[None], torch.arange(len(p))[None], cache)
            root = int(out.logits[0, -1].argmax())
            tokens.append(p[1:] + [root])
            feats.append(out.features[0])
            self.roots.append(root)
            dr.reset(CAPACITY)
        t = max(map(len, tokens))
        tok = torch.zeros(len(prompts), t, dtype=torch.long)
        feat = torch.randn(len(prompts), t, c.hidden_size)  # padding: garbage that must not matter
        for r, (x, f) in enumerate(zip(tokens, feats)):
            tok[r, : len(x)], feat[r, : len(x)] = torch.tensor(x), f
        self.commit(tok, feat, torch.tensor([len(x) for x in tokens]), view_len=t)

    def commit(self, tokens: torch.Tensor, features: torch.Tensor, count: torch.Tensor, view_len: int | None = None):
        """Commit pairs to both; the root_hidden of every row must agree with Drafter.extend's."""
        before = self.cache.lengths.clone()
        view = view_len or int(before.max()) + tokens.shape[1]
        self.root_hidden = self.proposer.commit(self.cache, before.clone(), tokens, features, count, view)
        assert self.cache.lengths.tolist() == (before + count).tolist()
        self.states = [dr.extend(tokens[r, : int(count[r])], features[r, : int(count[r])])
                       for r, dr in enumerate(self.drafters)]
        self.roots = [int(tokens[r, int(count[r]) - 1]) for r in range(len(self.drafters))]
        for r, st in enumerate(self.states):
            torch.testing.assert_close(self.root_hidden[r], st.root_hidden, rtol=1e-4, atol=1e-4)

    def propose(self, room: list[int] | None = None, wide: bool = False):
        p, n = self.proposer, self.proposer.budget
        room_t = torch.tensor(room or [n] * len(self.drafters))
        lengths = self.cache.lengths.clone()
        view = CAPACITY if wide else int(lengths.max()) + p.scratch
        tree = p.propose(self.cache, torch.tensor(self.roots), self.root_hidden, room_t, view)
        assert torch.equal(self.cache.lengths, lengths), "propose must not commit"
        assert tree.tokens.shape == tree.parents.shape == tree.valid.shape == (len(self.drafters), n)
        assert tree.ancestors.shape == (len(self.drafters), n, n)
        assert tree.valid.tolist() == [[i < r for i in range(n)] for r in room_t.tolist()]
        return tree

    def reference(self):
        return [dr.draft(root, st, self.cfg, 1000) for dr, root, st in zip(self.drafters, self.roots, self.states)]


def assert_same_trees(tree, refs) -> None:
    for r, ref in enumerate(refs):
        n = tree.size
        assert ref.size == n, f"row {r}: reference tree has {ref.size} nodes, the batch {n}"
        assert tree.tokens[r, :n].tolist() == ref.tokens.tolist(), f"row {r} tokens"
        assert tree.parents[r, :n].tolist() == ref.parents.tolist(), f"row {r} parents"
        assert tree.depth[r, :n].tolist() == ref.depth.tolist()
        assert torch.equal(tree.ancestors[r, :n, :n], ref.mask)


def accept_some(tree, counts: list[int], seed: int):
    """Fabricated verification results: per row, the first count[b] nodes of a path to its deepest
    node (fewer if the row is shallower), emitted tokens (the path's next tokens, then a random
    bonus) and random features, padded to max_depth + 1."""
    b, width = tree.batch_size, tree.max_depth + 1
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 96, (b, width), generator=g)
    feats = torch.randn(b, width, 32, generator=g)
    kept = []
    for r, c in enumerate(counts):
        path = [int(tree.depth[r].argmax())]
        while path[-1] != 0:
            path.append(int(tree.parents[r, path[-1]]))
        path = path[::-1]
        kept.append(min(c, len(path)))
        tokens[r, : kept[-1] - 1] = tree.tokens[r, path[1:kept[-1]]]
    return tokens, feats, torch.tensor(kept)


CASES = [
    ("eagle2", dict(total_tokens=16, depth=5, top_k=4), False),
    ("eagle2", dict(total_tokens=40, depth=6, top_k=3), False),
    ("eagle2", dict(total_tokens=9, depth=3, top_k=10), False),
    ("eagle2", dict(total_tokens=30, depth=4, top_k=10), True),  # top_k above the 7-token vocabulary
    ("eagle2", dict(total_tokens=50, depth=2, top_k=3), False),  # pool of 12 < total: budget 13
    ("eagle2", dict(total_tokens=6, depth=1, top_k=8), False),
    ("eagle", dict(), False),
    ("eagle", dict(choices=SMALL_CHOICES), False),
    ("eagle", dict(), True),  # the default's ranks 0..3 all fit the 7-token vocabulary
    ("eagle", dict(choices=[[0], [9], [0, 0], [0, 8], [9, 1], [0, 8, 0]]), True),  # ranks >= 7 dropped
]


PEAKED = [("eagle2", dict(total_tokens=14, depth=6, top_k=4), "peaked"),  # exact ties at the rerank's cut
          ("eagle2", dict(total_tokens=12, depth=4, top_k=8), "peaked")]
DEEP = [("eagle2", dict(total_tokens=16, depth=5, top_k=4), "two-layer"), ("eagle", dict(), "two-layer")]


@pytest.fixture(scope="module")
def two_layer(models):
    """A head with two stacked decoder layers (two layers of draft cache)."""
    return sharp_random_head(models[0].config, seed=4, scale=0.2, num_layers=2)


@pytest.mark.parametrize("method, kw, reduced", CASES + PEAKED + DEEP)
def test_matches_drafter_over_two_steps(models, peaked, two_layer, method, kw, reduced):
    target, head, small = models
    cfg = TreeConfig(method, **kw)
    with single_thread(), torch.inference_mode():
        rows = Rows(target, {False: head, True: small, "peaked": peaked, "two-layer": two_layer}[reduced], cfg, PROMPTS)
        tree = rows.propose()
        refs = rows.reference()
        assert_same_trees(tree, refs)
        assert tree.max_depth == rows.proposer.max_depth >= int(tree.depth.max())
        # A second step: varied numbers of accepted pairs per row, a capacity-wide view this time.
        rows.commit(*accept_some(tree, [1, 3, 2, 4], seed=len(kw)), view_len=CAPACITY)
        assert_same_trees(rows.propose(wide=True), rows.reference())


def test_budget_scratch_and_depth(models):
    target, head, small = models
    p = Proposer(head, target, TreeConfig("eagle2", total_tokens=60, depth=6, top_k=10))
    assert (p.budget, p.max_depth, p.scratch) == (60, 6, 50)
    p = Proposer(head, target, TreeConfig("eagle2", total_tokens=4, depth=6, top_k=10))
    assert (p.budget, p.max_depth, p.scratch) == (4, 3, 20)  # 3 nodes can reach depth 3 at most
    p = Proposer(small, target, TreeConfig("eagle2", total_tokens=100, depth=2, top_k=10))
    assert (p.k, p.budget, p.max_depth, p.scratch) == (7, 1 + 7 + 49, 2, 7)
    p = Proposer(head, target, TreeConfig("eagle"))
    assert (p.budget, p.max_depth, p.scratch) == (26, 5, 10)  # inner nodes: 4 + 4 + 1 + 1
    p = Proposer(small, target, TreeConfig("eagle", choices=[[0], [9], [0, 0], [0, 8], [9, 1]]))
    assert (p.budget, p.max_depth, p.scratch) == (3, 2, 1)


@pytest.mark.parametrize("method", ["eagle2", "eagle"])
def test_room_cuts_rows_to_trees(models, method):
    target, head, _ = models
    cfg = TreeConfig(method, total_tokens=20, depth=5, top_k=4)
    with single_thread(), torch.inference_mode():
        rows = Rows(target, head, cfg, PROMPTS)
        full = rows.propose()
        room = [1, 2, 7, rows.proposer.budget + 5]
        tree = rows.propose(room)
        # Room only marks nodes invalid; the tree itself is the full one.
        assert torch.equal(tree.tokens, full.tokens) and torch.equal(tree.parents, full.parents)
        for r, keep in enumerate(room):
            par = tree.parents[r, : min(keep, tree.size)].tolist()
            assert par[0] == -1 and all(0 <= p < i for i, p in enumerate(par) if i)
        if method == "eagle":  # the static tree is cut to a prefix of its layout, as Drafter does
            for r, keep in enumerate(room):
                ref = rows.drafters[r].draft(rows.roots[r], rows.states[r], cfg, keep)
                n = min(keep, tree.size)
                assert tree.tokens[r, :n].tolist() == ref.tokens.tolist()
                assert tree.parents[r, :n].tolist() == ref.parents.tolist()


def test_root_only_tree(models):
    target, head, _ = models
    with single_thread(), torch.inference_mode():
        rows = Rows(target, head, TreeConfig("eagle2", total_tokens=1), PROMPTS[:2])
        tree = rows.propose()
        assert tree.tokens.tolist() == [[r] for r in rows.roots] and tree.parents.tolist() == [[-1], [-1]]
        assert tree.max_depth == 0 and rows.proposer.scratch == 0


def test_prefill_in_chunks_matches_one_commit(models):
    target, head, _ = models
    p = Proposer(head, target, TreeConfig())
    c = head.config
    g = torch.Generator().manual_seed(0)
    tokens, feats = torch.randint(0, 96, (1, 11), generator=g), torch.randn(1, 11, 32, generator=g)
    with torch.inference_mode():
        one = RowKVCache(1, c.num_kv_heads, c.head_dim, 32)
        h_one = p.commit(one, one.lengths.clone(), tokens, feats, torch.tensor([11]), 11)
        chunked = RowKVCache(1, c.num_kv_heads, c.head_dim, 32)
        for a, e in ((0, 4), (4, 8), (8, 11)):
            h = p.commit(chunked, chunked.lengths.clone(), tokens[:, a:e], feats[:, a:e], torch.tensor([e - a]), e)
    assert chunked.lengths.tolist() == [11]
    torch.testing.assert_close(h, h_one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.k[:, :, :, :11], one.k[:, :, :, :11], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["eagle2", "eagle"])
def test_no_host_sync(models, monkeypatch, method):
    target, _, small = models
    cfg = TreeConfig(method, total_tokens=12, depth=4, top_k=5)
    with single_thread(), torch.inference_mode():
        rows = Rows(target, small, cfg, PROMPTS[:3])
        p, cache = rows.proposer, rows.cache
        roots, hidden, room = torch.tensor(rows.roots), rows.root_hidden, torch.tensor([3, 12, 40])
        view = CAPACITY - 1
        width = p.max_depth + 1
        tokens, feats = torch.zeros(3, width, dtype=torch.long), torch.randn(3, width, 32)
        count = torch.tensor([1, 2, 3])
        counter = SyncCounter(monkeypatch)
        tree = p.propose(cache, roots, hidden, room, view)
        hidden = p.commit(cache, cache.lengths.clone(), tokens, feats, count, view)
        p.propose(cache, roots, hidden, room, view)
        calls = list(counter.calls)
    monkeypatch.undo()
    assert calls == []
    assert tree.tokens.shape == (3, p.budget)


def test_frame_mask_is_row_attention_mask():
    """The per-propose precomputed mask parts give row_attention_mask's mask exactly."""
    from eaglespec.kv_cache import row_attention_mask
    from eaglespec.spec.propose import _Frame

    g = torch.Generator().manual_seed(0)
    committed = torch.tensor([0, 5, 11])
    for scratch, view_len, t in ((8, 19, 4), (1, 12, 1), (6, 30, 3)):
        anc = torch.rand(3, t, scratch, generator=g) < 0.5
        frame = _Frame.of(committed, scratch, view_len)
        assert torch.equal(frame.mask(anc), row_attention_mask(committed, committed, anc, view_len))
        assert torch.equal(frame.slots, committed[:, None] + torch.arange(scratch))
