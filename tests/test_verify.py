"""Verification: greedy on hand-made trees, and lossless speculative sampling, statistically.

The statistical tests compare emitted tokens with the exact distribution (computed by
enumeration) with a Pearson chi-square test, and show their power by running the same test on
deliberately wrong acceptance rules, which it must reject.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from eaglespec import generate as generate_mod
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.sampling import probabilities
from eaglespec.tree import Tree
from eaglespec.verify import Acceptance, verify, verify_greedy, verify_sampling

from spec_helpers import (chi_square_pvalue, exact_sequence_probs, fixed_setup, oracle_drafter, run_generate,
                          single_thread)
from tiny import tiny_config, tiny_model

PASS_P = 1e-3  # a correct rule must not be rejected at this level (seeds are fixed)
FAIL_P = 1e-6  # a wrong rule must be rejected at this level


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def peaked_logits(argmaxes: list[int], vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(argmaxes) * 31 + vocab)
    x = torch.randn(len(argmaxes), vocab, generator=g)
    x[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return x


# --- greedy -----------------------------------------------------------------------------------
#   0 ─┬─ 1 (2) ─┬─ 3 (4) ── 5 (5)
#      │         └─ 4 (1)
#      └─ 2 (3)
TREE = Tree.from_parents([7, 2, 3, 4, 1, 5], [-1, 0, 0, 1, 1, 3])


@pytest.mark.parametrize("argmaxes, nodes, tokens, bonus", [
    ([2, 4, 0, 5, 0, 6], [0, 1, 3, 5], [2, 4, 5], 6),  # the whole longest path, then the bonus
    ([5, 4, 0, 5, 0, 6], [0], [], 5),  # no child of the root matches: only the bonus
    ([3, 4, 1, 5, 0, 6], [0, 2], [3], 1),  # the second child of the root
    ([2, 1, 0, 5, 3, 6], [0, 1, 4], [2, 1], 3),  # the second child at depth 2
    ([2, 4, 0, 0, 0, 6], [0, 1, 3], [2, 4], 0),  # stops inside a path
    ([2, 4, 0, 5, 0, 5], [0, 1, 3, 5], [2, 4, 5], 5),  # bonus may repeat the last token
])
def test_verify_greedy_hand_made(argmaxes, nodes, tokens, bonus):
    logits = peaked_logits(argmaxes, 8)
    acc = verify_greedy(TREE, logits)
    assert (acc.nodes, acc.tokens, acc.bonus) == (nodes, tokens, bonus)
    assert acc.length == len(tokens)
    # verify() dispatches on temperature 0.
    acc2 = verify(TREE, logits, SamplingConfig(temperature=0.0), None)
    assert (acc2.nodes, acc2.tokens, acc2.bonus) == (nodes, tokens, bonus)


def test_verify_greedy_root_only():
    acc = verify_greedy(Tree.from_parents([3], [-1]), peaked_logits([6], 8))
    assert (acc.nodes, acc.tokens, acc.bonus) == ([0], [], 6)


def test_verify_greedy_uses_the_parent_row():
    # Node 1's token matches the argmax at node 1 itself but not at the root: rejected.
    tree = Tree.from_parents([0, 4], [-1, 0])
    acc = verify_greedy(tree, peaked_logits([2, 4], 8))
    assert acc.nodes == [0] and acc.bonus == 2


# --- exact emission distributions for a fixed tree ------------------------------------------------
def emission_probs(tree: Tree, node_probs: torch.Tensor) -> dict[tuple, float]:
    """P(emitted tokens = s) for lossless verification of `tree`: the tokens follow the target
    distribution of the node they are emitted at; emission continues below a drafted child
    whose token was emitted and stops at the first token that is not a child."""
    tokens = tree.tokens.tolist()
    out: dict[tuple, float] = {}

    def walk(node: int, prefix: tuple, prob: float) -> None:
        child_of = {}
        for c in tree.children[node]:
            child_of.setdefault(tokens[c], c)
        for x, px in enumerate(node_probs[node].double().tolist()):
            if px <= 0:
                continue
            if x in child_of:
                walk(child_of[x], prefix + (x,), prob * px)
            else:
                out[prefix + (x,)] = prob * px

    walk(0, (), 1.0)
    return out


def emitted(acc: Acceptance) -> tuple:
    return tuple(acc.tokens) + (acc.bonus,)


V = 10


SETTINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4),
            SamplingConfig(temperature=1.0, top_p=0.8)]


def verify_no_zeroing(tree, logits, cfg, generator):
    """WRONG: accepts x with probability p(x) but does not remove x from p on rejection."""
    tokens = tree.tokens.tolist()
    node, nodes, acc = 0, [0], []
    while True:
        p = probabilities(logits[node], cfg)
        nxt = next((c for c in tree.children[node] if float(torch.rand((), generator=generator)) < float(p[tokens[c]])),
                   None)
        if nxt is None:
            return Acceptance(nodes, acc, int(torch.multinomial(p, 1, generator=generator)))
        node = nxt
        nodes.append(node)
        acc.append(tokens[node])


def verify_first_child(tree, logits, cfg, generator):
    """WRONG: always accepts the first child."""
    node, nodes, acc = 0, [0], []
    while tree.children[node]:
        node = tree.children[node][0]
        nodes.append(node)
        acc.append(int(tree.tokens[node]))
    bonus = int(torch.multinomial(probabilities(logits[node], cfg), 1, generator=generator))
    return Acceptance(nodes, acc, bonus)


def sample_fixed(rule, tree, logits, cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    return Counter(emitted(rule(tree, logits, cfg, g)) for _ in range(n))


@pytest.mark.parametrize("cfg", SETTINGS, ids=["t1", "t0.7-topk4", "topp0.8"])
def test_verify_sampling_topk_drafts_lossless(cfg):
    tree, logits, probs = fixed_setup(cfg, V)
    expected = emission_probs(tree, probs)
    assert abs(sum(expected.values()) - 1) < 1e-6
    counts = sample_fixed(verify_sampling, tree, logits, cfg, 8_000, seed=7)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert df >= 10
    assert pval > PASS_P, (stat, df)
    # Drafts were accepted at every depth (the test looked at the interesting cases).
    assert max(len(s) for s in counts) == 4


@pytest.mark.parametrize("wrong", [verify_no_zeroing, verify_first_child])
def test_verify_sampling_statistic_has_power(wrong):
    cfg = SETTINGS[0]
    tree, logits, probs = fixed_setup(cfg, V)
    expected = emission_probs(tree, probs)
    pval, stat, df = chi_square_pvalue(sample_fixed(wrong, tree, logits, cfg, 4_000, seed=7), expected)
    assert pval < FAIL_P, (stat, df)


# --- the p/q rule: children sampled without replacement from q -----------------------------------
def q_setup():
    """Root with 3 children drawn without replacement from q0; the first child (whatever its
    token) has 2 children drawn from q1. q differs from p: it puts mass where p has none, and
    p has mass where q has none."""
    g = torch.Generator().manual_seed(99)
    cfg = SamplingConfig(temperature=1.0, top_k=7)
    logits = torch.randn(V, V, generator=g) * 1.5  # row x: target logits after emitting token x
    root_logits = torch.randn(V, generator=g) * 1.5
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q0[int(root_logits.argmin())] += 0.3  # a token that top-k removes from p
    q0[int(root_logits.argmax())] = 0.0  # p's favourite is never drafted
    q0 = q0 / q0.sum()
    q1 = torch.softmax(torch.randn(V, generator=g), -1)
    return cfg, root_logits, logits, q0, q1


def sample_q_trees(rule, n: int, seed: int):
    """Emitted (first, second-if-the-first-child-was-accepted) tokens over n fresh trees."""
    cfg, root_logits, logits, q0, q1 = q_setup()
    g = torch.Generator().manual_seed(seed)
    template = Tree.from_parents([0] * 6, [-1, 0, 0, 0, 1, 1])
    firsts, seconds = Counter(), Counter()
    for _ in range(n):
        kids = torch.multinomial(q0, 3, replacement=False, generator=g).tolist()
        grand = torch.multinomial(q1, 2, replacement=False, generator=g).tolist()
        toks = [0] + kids + grand
        node_logits = torch.stack([root_logits, logits[kids[0]], logits[kids[1]], logits[kids[2]],
                                   logits[grand[0]], logits[grand[1]]])
        dp = torch.stack([q0, q1, q1, q1, q1, q1])
        tree = dataclasses.replace(template, tokens=torch.tensor(toks), draft_probs=dp)
        acc = rule(tree, node_logits, cfg, g)
        out = emitted(acc)
        firsts[out[0]] += 1
        if acc.nodes[1:2] == [1]:
            seconds[(out[0], out[1])] += 1
    return firsts, seconds


def q_expected(firsts: Counter, seconds: Counter):
    cfg, root_logits, logits, q0, q1 = q_setup()
    p_root = probabilities(root_logits, cfg).double()
    exp_first = {x: float(p_root[x]) for x in range(V) if p_root[x] > 0}
    # Given that the first child (token x) was accepted, the next token follows p(. | x).
    n2 = sum(seconds.values())
    by_first = Counter()
    for (x, _), c in seconds.items():
        by_first[x] += c
    exp_second = {}
    for x, c in by_first.items():
        px = probabilities(logits[x], cfg).double()
        for y in range(V):
            if px[y] > 0:
                exp_second[(x, y)] = c / n2 * float(px[y])
    return exp_first, exp_second


def verify_q_no_residual(tree, logits, cfg, generator):
    """WRONG: accepts with min(1, p/q) but falls back to the unchanged p on rejection."""
    tokens = tree.tokens.tolist()
    node, nodes, acc = 0, [0], []
    while True:
        p = probabilities(logits[node], cfg)
        q = tree.draft_probs[node]
        nxt = None
        for c in tree.children[node]:
            x = tokens[c]
            if q[x] > 0 and float(torch.rand((), generator=generator)) < min(1.0, float(p[x] / q[x])):
                nxt = c
                break
        if nxt is None:
            return Acceptance(nodes, acc, int(torch.multinomial(p, 1, generator=generator)))
        node = nxt
        nodes.append(node)
        acc.append(tokens[node])


def test_verify_sampling_pq_rule_lossless():
    firsts, seconds = sample_q_trees(verify_sampling, 10_000, seed=5)
    exp_first, exp_second = q_expected(firsts, seconds)
    p1, s1, df1 = chi_square_pvalue(firsts, exp_first)
    assert df1 >= 5 and p1 > PASS_P, (s1, df1)
    p2, s2, df2 = chi_square_pvalue(seconds, exp_second)
    assert sum(seconds.values()) > 1500 and df2 >= 10 and p2 > PASS_P, (s2, df2)


def test_verify_sampling_pq_statistic_has_power():
    firsts, seconds = sample_q_trees(verify_q_no_residual, 3_000, seed=5)
    exp_first, _ = q_expected(firsts, seconds)
    pval, stat, df = chi_square_pvalue(firsts, exp_first)
    assert pval < FAIL_P, (stat, df)


# --- end to end: speculative sampling through generate_tokens -----------------------------------
PROMPT = [1, 2, 3, 4]
NEW = 3
SMALL_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
E2E = [
    ("eagle", SamplingConfig(temperature=1.0)),
    ("eagle2", SamplingConfig(temperature=1.0)),
    ("eagle2", SamplingConfig(temperature=0.7, top_k=4)),
    ("eagle", SamplingConfig(temperature=0.9, top_p=0.8)),
]


@pytest.fixture(scope="module")
def small_target():
    cfg = tiny_config(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, inter=32)
    return tiny_model(cfg, seed=1, scale=2.0)


def tree_for(method: str) -> TreeConfig:
    if method == "eagle":
        return TreeConfig("eagle", choices=SMALL_CHOICES)
    return TreeConfig("eagle2", total_tokens=8, depth=3, top_k=3)


def sample_generate(target, method, cfg, n, seed0=0):
    drafter = oracle_drafter(target, p_oracle=1.0, noise=0.0, memo=True)
    counts, accepted = Counter(), 0
    for s in range(n):
        r = run_generate(target, PROMPT, drafter, tree=tree_for(method),
                         sampling=dataclasses.replace(cfg, seed=seed0 + s), max_new_tokens=NEW)
        assert len(r.tokens) == NEW
        counts[tuple(r.tokens)] += 1
        accepted += sum(a - 1 for a in r.stats.accept_lengths)
    return counts, accepted


@pytest.mark.parametrize("method, cfg", E2E, ids=["eagle-t1", "eagle2-t1", "eagle2-t0.7-topk4", "eagle-topp0.8"])
def test_generate_sampling_lossless(small_target, method, cfg):
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    n = 1500
    counts, accepted = sample_generate(small_target, method, cfg, n)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert df >= 15, df
    assert pval > PASS_P, (stat, df)
    # The drafts were informative: many draft tokens were accepted.
    assert accepted > 0.3 * n


@pytest.mark.parametrize("wrong, n", [(verify_no_zeroing, 500), (verify_first_child, 200)])
def test_generate_sampling_statistic_has_power(small_target, monkeypatch, wrong, n):
    cfg = SamplingConfig(temperature=1.0)
    expected = exact_sequence_probs(small_target, PROMPT, cfg, NEW)
    monkeypatch.setattr(generate_mod, "verify", lambda t, lg, c, g: wrong(t, lg, c, g))
    counts, _ = sample_generate(small_target, "eagle2", cfg, n)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert pval < FAIL_P, (stat, df)


def test_exact_sequence_probs_matches_vanilla_sampling(small_target):
    """The reference itself: vanilla sampling through generate_tokens fits it (and the
    statistic rejects the reference of a different temperature)."""
    cfg = SamplingConfig(temperature=1.0)
    counts = Counter()
    for s in range(800):
        r = run_generate(small_target, PROMPT, None, sampling=dataclasses.replace(cfg, seed=s), max_new_tokens=NEW)
        counts[tuple(r.tokens)] += 1
    assert chi_square_pvalue(counts, exact_sequence_probs(small_target, PROMPT, cfg, NEW))[0] > PASS_P
    other = exact_sequence_probs(small_target, PROMPT, SamplingConfig(temperature=0.8), NEW)
    assert chi_square_pvalue(counts, other)[0] < FAIL_P
