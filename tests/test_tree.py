"""Draft trees: Tree.from_parents, static layouts, choices files, EAGLE-2 rerank, and the trees a
real Drafter grows."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglespec.config import EAGLE1_CHOICES, TreeConfig
from eaglespec.draft import Drafter, init_random_head
from eaglespec.tree import (Tree, chain, load_choices, rerank, sampled_layout, siblings_in_rank_order, static_layout,
                            truncate_layout)

from spec_helpers import single_thread
from tiny import tiny_config, tiny_model

FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def mask_from_rows(n: int, rows: list[set[int]]) -> torch.Tensor:
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, r in enumerate(rows):
        m[i, sorted(r)] = True
    return m


# --- Tree.from_parents on hand-drawn trees ----------------------------------------------------
def test_from_parents_branching_tree():
    #   0 ─┬─ 1 ─┬─ 3 ── 5
    #      │     └─ 4
    #      └─ 2
    t = Tree.from_parents([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 3])
    assert t.size == 6
    assert t.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.positions(7).tolist() == [7, 8, 8, 9, 9, 10]
    assert t.positions(0).tolist() == [0, 1, 1, 2, 2, 3]
    assert t.children == [[1, 2], [3, 4], [], [5], [], []]
    assert sorted(t.paths) == [[0, 1, 3, 5], [0, 1, 4], [0, 2]]
    expected = mask_from_rows(6, [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 1, 3, 5}])
    assert t.mask.dtype == torch.bool and torch.equal(t.mask, expected)
    assert t.draft_probs is None and t.values is None


def test_from_parents_not_sorted_by_depth():
    #   0 ─┬─ 1 ── 2 ── 5
    #      └─ 3 ── 4
    t = Tree.from_parents(torch.tensor([7, 8, 9, 8, 7, 6]), torch.tensor([-1, 0, 1, 0, 3, 2]))
    assert t.depth.tolist() == [0, 1, 2, 1, 2, 3]
    assert t.children == [[1, 3], [2], [5], [4], [], []]
    assert sorted(t.paths) == [[0, 1, 2, 5], [0, 3, 4]]
    expected = mask_from_rows(6, [{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 3, 4}, {0, 1, 2, 5}])
    assert torch.equal(t.mask, expected)
    assert t.positions(3).tolist() == [3, 4, 5, 4, 5, 6]


def test_root_only_and_chain():
    r = Tree.from_parents([42], [-1])
    assert r.size == 1 and r.children == [[]] and r.paths == [[0]]
    assert torch.equal(r.mask, torch.ones(1, 1, dtype=torch.bool))
    assert r.positions(5).tolist() == [5]
    c = chain([4, 5, 6, 7])
    assert c.parents.tolist() == [-1, 0, 1, 2]
    assert c.paths == [[0, 1, 2, 3]]
    assert torch.equal(c.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert c.positions(10).tolist() == [10, 11, 12, 13]


def test_from_parents_keeps_draft_probs_and_values():
    q = torch.rand(3, 5)
    v = torch.tensor([0.0, -1.0, -2.0])
    t = Tree.from_parents([1, 2, 3], [-1, 0, 1], draft_probs=q, values=v)
    assert t.draft_probs is q and t.values is v


@pytest.mark.parametrize("parents", [[], [0], [-1, -1], [-1, 1], [-1, 0, 3, 1], [-1, 0, 2]])
def test_from_parents_rejects_bad_parents(parents):
    with pytest.raises(ValueError, match="parents"):
        Tree.from_parents(list(range(len(parents))), parents)


# --- static layouts (EAGLE-1 choices) -----------------------------------------------------------
def test_static_layout_default_eagle1_tree():
    lay = static_layout(EAGLE1_CHOICES)
    assert len(lay.parents) == 26  # 25 nodes + root
    assert lay.max_depth == 5
    assert Counter(lay.depth) == Counter({0: 1, 1: 4, 2: 8, 3: 8, 4: 3, 5: 2})
    assert lay.parents[0] == -1 and lay.depth[0] == 0
    # Every node is its choice path; its parent is the path minus the last rank.
    paths = [()] + [tuple(c) for c in lay.choices]
    assert sorted(paths[1:]) == sorted(tuple(c) for c in EAGLE1_CHOICES)
    for i in range(1, 26):
        assert 0 <= lay.parents[i] < i
        assert paths[lay.parents[i]] == paths[i][:-1]
        assert lay.ranks[i] == paths[i][-1]
        assert lay.depth[i] == len(paths[i])
    # The layout is a valid tree for Tree.from_parents, with children listed in rank order.
    t = Tree.from_parents(list(range(26)), lay.parents)
    assert t.depth.tolist() == lay.depth
    for kids in t.children:
        assert [lay.ranks[k] for k in kids] == list(range(len(kids)))
    assert len(t.paths) == sum(1 for i in range(26) if not t.children[i])


def test_static_layout_hand_drawn():
    # Unsorted input with a duplicate; the layout sorts by depth, then by rank path:
    #   0 ─┬─ 1 [0] ─┬─ 3 [0,0] ── 6 [0,0,0]
    #      │         └─ 4 [0,1]
    #      └─ 2 [1] ─── 5 [1,0]
    choices = [[1], [0], [0, 1], [1, 0], [0, 0], [0], [0, 0, 0]]
    lay = static_layout(choices)
    assert lay.choices == [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    assert lay.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert lay.ranks == [0, 0, 1, 0, 1, 0, 0]
    assert lay.depth == [0, 1, 1, 2, 2, 2, 3]
    assert lay.max_depth == 3
    small = truncate_layout(lay, 4)
    assert small.parents == [-1, 0, 0, 1] and small.ranks == [0, 0, 1, 0] and small.depth == [0, 1, 1, 2]
    assert small.choices == [[0], [1], [0, 0]]
    assert truncate_layout(lay, 1).parents == [-1]


@pytest.mark.parametrize("choices, msg", [
    ([[0], [1, 0]], "no parent path"),
    ([[0, 0]], "no parent path"),
    ([[]], "non-empty"),
    ([[0], [-1]], "non-empty"),
])
def test_static_layout_errors(choices, msg):
    with pytest.raises(ValueError, match=msg):
        static_layout(choices)


# --- choices files ---------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 6))
def test_sampled_layout_invariants(total, depth, top_k):
    """A sampled tree's shape: as many paths as asked (or the whole tree of that depth and width),
    within depth and top-k, closed under parents and under earlier siblings (ranks 0..m-1: the
    order siblings are drawn and verified in), and a chain when top-k is 1."""
    paths = sampled_layout(total, depth, top_k)
    full = sum(top_k ** d for d in range(1, depth + 1))
    assert len(paths) == min(total - 1, full)
    have = {tuple(c) for c in paths}
    assert len(have) == len(paths)
    for c in have:
        assert 1 <= len(c) <= depth and max(c) < top_k
        assert len(c) == 1 or c[:-1] in have
        assert c[-1] == 0 or c[:-1] + (c[-1] - 1,) in have
    if top_k == 1:
        assert sorted(have) == [(0,) * d for d in range(1, len(paths) + 1)]
    assert siblings_in_rank_order(static_layout(paths))


def test_siblings_in_rank_order():
    assert siblings_in_rank_order(static_layout(EAGLE1_CHOICES))
    assert siblings_in_rank_order(static_layout([[0], [1], [0, 0], [0, 1], [1, 0]]))
    assert not siblings_in_rank_order(static_layout([[0], [2]]))
    assert not siblings_in_rank_order(static_layout([[0], [0, 1]]))


def test_sampled_layout_follows_the_acceptance_by_rank():
    """The most likely paths first: with a first draft accepted half the time and later siblings
    rarely, chains grow before siblings; with every rank equally likely, siblings come first."""
    assert sampled_layout(6, 5, 4, accept=(0.6, 0.1)) == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert sampled_layout(5, 3, 4, accept=(0.3,)) == [[0], [1], [2], [3]]
    assert sampled_layout(5, 3, 4, accept=(0.3, 0.1)) == [[0], [0, 0], [1], [2]]


def test_load_choices_ok(tmp_path):
    f = tmp_path / "tree.json"
    f.write_text(json.dumps([[0], [1], [0, 0]]))
    assert load_choices(f) == [[0], [1], [0, 0]]
    f.write_text(json.dumps(EAGLE1_CHOICES))
    assert load_choices(str(f)) == EAGLE1_CHOICES


@pytest.mark.parametrize("text, msg", [
    ("[[0], [1],", "unreadable JSON"),
    ("not json", "unreadable JSON"),
    ('{"a": 1}', "list of lists of ints"),
    ("[[0], 1]", "list of lists of ints"),
    ('[[0], ["1"]]', "list of lists of ints"),
    ("[[0], [1, 0], [2, 0]]", "no parent path"),
    ("[[0], [0, 0, 0]]", "no parent path"),
])
def test_load_choices_errors(tmp_path, text, msg):
    f = tmp_path / "tree.json"
    f.write_text(text)
    with pytest.raises(ValueError, match=msg):
        load_choices(f)


def test_load_choices_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unreadable"):
        load_choices(tmp_path / "nope.json")


# --- EAGLE-2 rerank ------------------------------------------------------------------------------
@st.composite
def candidate_trees(draw):
    """Candidate pools like the drafter's: parents index earlier candidates (-1 = root), and a
    child's value is its parent's minus a non-negative step (0 makes ties, also across depths)."""
    m = draw(st.integers(1, 40))
    steps = st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 1.5]) | st.floats(0.0, 3.0)
    parents, values, depth = [], [], []
    for i in range(m):
        p = draw(st.integers(-1, i - 1))
        base = 0.0 if p == -1 else values[p]
        parents.append(p)
        values.append(base - draw(steps))
        depth.append(1 if p == -1 else depth[p] + 1)
    keep = draw(st.integers(0, m + 3))
    return torch.tensor(values, dtype=torch.float32), torch.tensor(parents), torch.tensor(depth), keep


@FAST
@given(candidate_trees())
def test_rerank_invariants(case):
    values, parents, depth, keep = case
    m = values.numel()
    out = rerank(values, parents, depth, keep).tolist()
    assert len(out) == min(keep, m)
    assert len(set(out)) == len(out)
    pos = {c: j for j, c in enumerate(out)}
    for j, c in enumerate(out):
        p = int(parents[c])
        assert p == -1 or p in pos, "kept node whose parent was dropped"
        if p != -1:
            assert pos[p] < j, "child before its parent"
    # The kept set is a top-`keep` set by value (ties may go either way, but no dropped node
    # is strictly better than a kept one).
    dropped = [i for i in range(m) if i not in pos]
    if out and dropped:
        assert min(float(values[c]) for c in out) >= max(float(values[i]) for i in dropped)
    # The values of the kept set are exactly the `keep` largest values.
    assert sorted((float(values[c]) for c in out), reverse=True) == \
        sorted(values.tolist(), reverse=True)[:len(out)]


def test_rerank_ties_go_to_the_shallower_node():
    # As documented: on equal values the shallower node wins. Child 1 ties its parent 0 and
    # node 2 (another root child): the best 2 are the two depth-1 nodes.
    values = torch.tensor([-1.0, -1.0, -1.0, -3.0])
    parents = torch.tensor([-1, 0, -1, 1])
    depth = torch.tensor([1, 2, 1, 3])
    out = rerank(values, parents, depth, 2).tolist()
    assert sorted(out) == [0, 2]
    out = rerank(values, parents, depth, 3).tolist()
    assert out.index(0) < out.index(1)


# --- trees grown by a real Drafter ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_drafter():
    cfg = tiny_config(vocab=96, max_pos=512)
    target = tiny_model(cfg, seed=11)
    head = init_random_head(cfg, seed=3)
    with torch.no_grad():  # a head with a sharper, non-uniform output than the 0.02 init
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return target, Drafter(head, target)


def start_drafter(target, drafter, prompt):
    with torch.inference_mode():
        cache = target.new_cache(len(prompt))
        out = target(torch.tensor(prompt)[None], torch.arange(len(prompt))[None], cache)
        token = int(out.logits[0, -1].argmax())
        drafter.reset(len(prompt) + 1024)
        state = drafter.extend(torch.tensor(prompt[1:] + [token]), out.features[0])
    return token, state


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(total=st.integers(1, 60), depth=st.integers(1, 6), top_k=st.integers(1, 10),
       max_nodes=st.integers(1, 80), prompt_seed=st.integers(0, 10_000))
def test_dynamic_tree_invariants(tiny_drafter, total, depth, top_k, max_nodes, prompt_seed):
    target, drafter = tiny_drafter
    g = torch.Generator().manual_seed(prompt_seed)
    prompt = torch.randint(0, 96, (1 + prompt_seed % 9,), generator=g).tolist()
    with single_thread():
        token, state = start_drafter(target, drafter, prompt)
        committed = drafter.committed
        with torch.inference_mode():
            t = drafter.draft(token, state, TreeConfig("eagle2", total_tokens=total, depth=depth, top_k=top_k),
                              max_nodes)
            root_lp = torch.log_softmax(target.lm_head(state.root_hidden).float(), -1)
    # The draft's tentative slots are gone; the committed context is untouched.
    assert drafter.committed == committed == len(prompt)
    assert drafter.cache.length == committed
    pool = top_k + (depth - 1) * top_k * top_k  # candidates the expansion produces
    assert t.size == min(total, max_nodes, 1 + pool)
    assert int(t.tokens[0]) == token
    par = t.parents.tolist()
    assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, t.size))
    assert int(t.depth.max()) <= depth
    if t.size == 1:
        return
    vals = t.values.tolist()
    assert vals[0] == 0.0
    for i in range(1, t.size):
        assert vals[i] <= vals[par[i]], "value rises along a path"
    for kids in t.children:  # top-k children are distinct tokens
        toks = [int(t.tokens[k]) for k in kids]
        assert len(set(toks)) == len(toks) and len(kids) <= top_k
    for i in t.children[0]:  # a depth-1 node's value is its draft log-probability
        assert vals[i] == pytest.approx(float(root_lp[int(t.tokens[i])]), abs=1e-4)
    # Depth-1 nodes are the best root candidates, in rank order.
    first = [int(t.tokens[k]) for k in t.children[0]]
    assert first == root_lp.topk(len(first)).indices.tolist()


def test_static_tree_from_drafter(tiny_drafter):
    target, drafter = tiny_drafter
    with single_thread():
        token, state = start_drafter(target, drafter, [5, 17, 3, 88, 41])
        with torch.inference_mode():
            t = drafter.draft(token, state, TreeConfig("eagle"), 1000)
            root_lp = torch.log_softmax(target.lm_head(state.root_hidden).float(), -1)
            small = drafter.draft(token, state, TreeConfig("eagle"), 7)
    lay = static_layout(EAGLE1_CHOICES)
    assert t.size == 26 and t.parents.tolist() == lay.parents and t.depth.tolist() == lay.depth
    assert [int(t.tokens[k]) for k in t.children[0]] == root_lp.topk(4).indices.tolist()
    assert drafter.cache.length == drafter.committed == 5
    # Near the context limit the static tree is cut to a prefix of the layout.
    assert small.size == 7 and small.parents.tolist() == lay.parents[:7]
    assert small.tokens.tolist() == t.tokens.tolist()[:7]
