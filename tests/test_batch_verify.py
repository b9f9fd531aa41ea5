"""Batched verification (eaglespec.spec.verify) against the host oracle (eaglespec.verify).

Differential tests run random padded batches through both and require identical results, the
oracle drawing its random numbers from the same counter-based uniforms through its `uniform`
hook. Statistical tests check losslessness directly (chi-square against the exact emission
distribution) and show their power on deliberately broken variants of the batched code.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from eaglespec import verify as oracle
from eaglespec.config import SamplingConfig
from eaglespec.sampling import probabilities
from eaglespec.spec import verify as bv
from eaglespec.spec.rng import ACCEPT, BONUS, uniforms
from eaglespec.spec.sampling import RowSampling
from eaglespec.spec.tree import BatchTree
from eaglespec.tree import Tree

from spec_helpers import SyncCounter, chi_square_pvalue, fixed_setup, single_thread

PASS_P = 1e-3  # a correct rule must not be rejected at this level (seeds are fixed)
FAIL_P = 1e-6  # a wrong rule must be rejected at this level
V = 12
CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4),
           SamplingConfig(temperature=1.3, top_p=0.8), SamplingConfig(temperature=0.9, top_k=6, top_p=0.7),
           SamplingConfig(temperature=0.5)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors are all per-op overhead; extra intra-op threads only fight over shared cores."""
    with single_thread():
        yield


# --- random batches ---------------------------------------------------------------------------
def random_tree(rng: random.Random, logits: torch.Tensor, size: int, with_q: bool) -> Tree:
    """A random tree over `size` nodes whose drafts are often the parent's argmax or another of its
    likely tokens (so acceptance runs of every length occur), siblings sometimes duplicated."""
    parents = [-1] + [i - 1 if rng.random() < 0.4 else rng.randrange(i) for i in range(1, size)]
    tokens = [rng.randrange(V)]
    for i in range(1, size):
        order = torch.argsort(logits[parents[i]], descending=True).tolist()
        tokens.append(order[0] if rng.random() < 0.5 else order[min(rng.randrange(5), V - 1)]
                      if rng.random() < 0.9 else rng.randrange(V))
    q = None
    if with_q:
        q = torch.softmax(torch.randn(size, V) * 2, -1) * (torch.rand(size, V) > 0.25)  # some q(x) = 0
        q[:, 0] += 1e-3  # keep every row a distribution
        q = q / q.sum(-1, keepdim=True)
    return Tree.from_parents(tokens, parents, draft_probs=q)


TEMPERATURE_ONLY = [c for c in CONFIGS if not c.top_k and c.top_p >= 1.0]  # the CPU kernel's rows


def random_batch(seed: int, with_q: bool = False, greedy_share: float = 0.0, configs=CONFIGS):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, n = rng.randint(1, 6), rng.randint(1, 14)
    logits = torch.randn(b, n, V) * 2.5  # continuous: argmax ties have probability 0
    trees = [random_tree(rng, logits[r], rng.randint(1, n), with_q) for r in range(b)]
    cfgs = [SamplingConfig(temperature=0.0, seed=rng.getrandbits(62)) if rng.random() < greedy_share
            else replace(rng.choice(configs), seed=rng.getrandbits(62)) for _ in range(b)]
    tree = BatchTree.from_trees(trees, budget=n)
    step = torch.tensor([rng.getrandbits(40) for _ in range(b)])
    return trees, tree, logits, cfgs, RowSampling.from_configs(cfgs), step


def hook(sampling: RowSampling, step: torch.Tensor, r: int):
    """The oracle's `uniform` for row r, from the same stream as the batched verifier."""
    def uniform(node: int, purpose: str) -> float:
        kind = {"accept": ACCEPT, "bonus": BONUS}[purpose]
        return float(uniforms(sampling.seed[r:r + 1], step[r:r + 1], torch.tensor([node]), kind)[0])
    return uniform


def expected_row(trees, logits, cfgs, sampling, step, r) -> oracle.Acceptance:
    t = trees[r]
    if cfgs[r].greedy:
        return oracle.verify_greedy(t, logits[r, : t.size])
    return oracle.verify_sampling(t, logits[r, : t.size], cfgs[r], None, uniform=hook(sampling, step, r))


def assert_row(acc, r: int, want: oracle.Acceptance) -> None:
    c = int(acc.count[r])
    got = (acc.path[r, :c].tolist(), acc.emitted[r, : c - 1].tolist(), int(acc.bonus[r]))
    assert got == (want.nodes, want.tokens, want.bonus)
    assert int(acc.emitted[r, c - 1]) == want.bonus
    assert (acc.path[r, c:] == want.nodes[-1]).all()  # padded with the last accepted node


# --- differential: batched == oracle ----------------------------------------------------------
@pytest.mark.parametrize("mode", ["greedy", "greedy-torch", "q1", "pq", "mixed", "q1-temperature", "pq-temperature",
                                  "q1-temperature-torch"])
def test_matches_oracle(mode, monkeypatch):
    """greedy: the CPU kernel (verify_greedy_rows) where it builds; -torch: the torch ops that run
    elsewhere (CUDA), forced here by turning the kernels off; -temperature: only temperature-only
    rows, which the CPU kernel (verify_sampling_rows) takes whole."""
    if mode.endswith("-torch"):
        monkeypatch.setenv("EAGLESPEC_KERNELS", "0")
    counts = Counter()
    for seed in range(150):
        trees, tree, logits, cfgs, sampling, step = random_batch(
            seed, with_q=mode.startswith("pq"),
            greedy_share={"greedy": 1.0, "greedy-torch": 1.0, "mixed": 0.5}.get(mode, 0.0),
            configs=TEMPERATURE_ONLY if "temperature" in mode else CONFIGS)
        if mode.startswith("greedy"):
            acc = bv.verify_greedy(tree, logits)
        elif mode == "mixed":
            acc = bv.verify(tree, logits, sampling, step)
        else:  # no bound, a loose one, the tight one
            tight = max(len(c) for t in trees for c in t.children)
            acc = bv.verify_sampling(tree, logits, sampling, step, max_children=[None, tree.size, tight][seed % 3])
        assert acc.path.shape == acc.emitted.shape == (tree.batch_size, tree.max_depth + 1)
        for r in range(tree.batch_size):
            assert_row(acc, r, expected_row(trees, logits, cfgs, sampling, step, r))
            counts[int(acc.count[r])] += 1
    assert set(range(1, 5)) <= set(counts), counts  # accepted runs of lengths 0..3 at least


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_greedy_duplicate_siblings_follow_the_first(kernels, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_KERNELS", kernels)
    # Nodes 1 and 2 both carry the root's argmax; only node 2 has a (matching) child. The oracle
    # takes node 1, the first match, and stops there.
    tree = Tree.from_parents([0, 3, 3, 5], [-1, 0, 0, 2])
    logits = torch.full((4, V), -1.0)
    logits[[0, 1, 2, 3], [3, 7, 5, 6]] = 5.0
    want = oracle.verify_greedy(tree, logits)
    acc = bv.verify_greedy(BatchTree.from_trees([tree]), logits[None])
    assert want.nodes == [0, 1]
    assert_row(acc, 0, want)


def test_exhausted_residual_falls_back_to_fresh_p():
    # q = p under top-k, and the first child's token is outside the top-k: q(x) = 0 rejects it and
    # leaves max(0, p - q) = 0, so the oracle stops trying children (the second, which q = p would
    # accept for sure, is never tried) and draws the bonus from fresh p. Lossless all the same.
    cfg = SamplingConfig(temperature=1.0, top_k=3, seed=4)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    order = torch.argsort(logits[0], descending=True).tolist()
    tree = Tree.from_parents([0, order[-1], order[0]], [-1, 0, 0], draft_probs=probabilities(logits, cfg))
    b = 64
    sampling, step = RowSampling.from_configs([cfg] * b), torch.arange(b)
    acc = bv.verify_sampling(BatchTree.from_trees([tree] * b), logits.expand(b, -1, -1), sampling, step)
    assert (acc.count == 1).all()
    assert set(acc.bonus.tolist()) == set(order[:3])
    for r in range(b):
        assert_row(acc, r, oracle.verify_sampling(tree, logits, cfg, None, uniform=hook(sampling, step, r)))


@pytest.mark.parametrize("with_q", [False, True])
def test_batch_invariance(with_q):
    for seed in range(40):
        trees, tree, logits, cfgs, sampling, step = random_batch(1000 + seed, with_q, greedy_share=0.3)
        acc = bv.verify(tree, logits, sampling, step)
        for r, t in enumerate(trees):  # the row alone, unpadded, with its own RowSampling flags
            alone = bv.verify(BatchTree.from_trees([t]), logits[r:r + 1, : t.size],
                              RowSampling.from_configs([cfgs[r]]), step[r:r + 1])
            c = int(acc.count[r])
            assert int(alone.count[0]) == c
            assert alone.path[0, :c].tolist() == acc.path[r, :c].tolist()
            assert alone.emitted[0, :c].tolist() == acc.emitted[r, :c].tolist()


# --- statistical losslessness ------------------------------------------------------------------
N_DRAWS = 20_000


def emission_probs(tree: Tree, probs: torch.Tensor) -> dict[tuple, float]:
    """Exact P(emitted tokens = s) under lossless verification: each token follows its node's
    target distribution; emission continues below the (first) child carrying that token."""
    out: dict[tuple, float] = {}

    def walk(node: int, prefix: tuple, prob: float) -> None:
        child_of: dict[int, int] = {}
        for c in tree.children[node]:
            child_of.setdefault(int(tree.tokens[c]), c)
        for x, px in enumerate(probs[node].double().tolist()):
            if px > 0 and x in child_of:
                walk(child_of[x], prefix + (x,), prob * px)
            elif px > 0:
                out[prefix + (x,)] = prob * px

    walk(0, (), 1.0)
    return out


def emitted_counts(acc) -> Counter:
    return Counter(tuple(row[:c]) for row, c in zip(acc.emitted.tolist(), acc.count.tolist()))


def q1_counts(cfg: SamplingConfig, seed: int = 3) -> tuple[Counter, dict]:
    tree, logits, probs = fixed_setup(cfg, V)
    sampling = RowSampling.from_configs([replace(cfg, seed=seed)] * N_DRAWS)
    batch = BatchTree.from_trees([tree] * N_DRAWS)
    acc = bv.verify_sampling(batch, logits.expand(N_DRAWS, -1, -1), sampling, torch.arange(N_DRAWS))
    return emitted_counts(acc), emission_probs(tree, probs)


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=["t1", "t0.7-topk4", "t1.3-topp0.8"])
def test_q1_rule_lossless(cfg):
    counts, expected = q1_counts(cfg)
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert df >= 10 and pval > PASS_P, (stat, df)
    assert max(len(s) for s in counts) == 4  # drafts were accepted down to the deepest leaf
    first = Counter()
    for s, c in counts.items():
        first[s[0]] += c
    p0 = probabilities(fixed_setup(cfg, V)[1][0], cfg).double()
    assert chi_square_pvalue(first, {x: float(p0[x]) for x in range(V) if p0[x] > 0})[0] > PASS_P


def shared_accept_uniform(seed, step, node, purpose):
    """WRONG: one accept uniform for every child (a counter keyed without the node)."""
    return uniforms(seed, step, torch.zeros_like(node) if purpose == ACCEPT else node, purpose)


# WRONG variants of the batched code: retries and bonus from plain p; no renormalising after a
# rejection; one accept uniform shared by all children.
NO_RESIDUAL = ("_residual", lambda p, q, x: p)
NO_RENORM = ("_normalised", lambda x: x)


@pytest.mark.parametrize("attr, wrong, kernels", [NO_RESIDUAL + ("0",), NO_RENORM + ("0",),
                                                  ("uniforms", shared_accept_uniform, "0"),
                                                  ("uniforms", shared_accept_uniform, "1")],
                         ids=["no-residual", "no-renorm", "shared-uniform", "shared-uniform-kernel"])
def test_q1_statistic_has_power(monkeypatch, attr, wrong, kernels):
    """The broken torch pieces are seen with the kernels off (CONFIGS[0] is temperature-only, which
    the CPU kernel takes); the kernel's own inputs (its uniforms) can be broken from here too."""
    monkeypatch.setenv("EAGLESPEC_KERNELS", kernels)
    monkeypatch.setattr(bv, attr, wrong)
    counts, expected = q1_counts(CONFIGS[0])
    pval, stat, df = chi_square_pvalue(counts, expected)
    assert pval < FAIL_P, (stat, df)


def pq_counts(seed: int = 5, top_k: int = 7) -> tuple[Counter, Counter, dict, dict]:
    """A Markov world: after token x the target's logits are L[x] and the drafter's q is Q[x]. Each
    of N_DRAWS rows drafts fresh children without replacement from q: 3 under the root, 2 under
    the first child. Returns the emitted first tokens, the (first, second) pairs where the first
    child was accepted, and their exact distributions (the second given the first)."""
    g = torch.Generator().manual_seed(99)
    cfg = SamplingConfig(temperature=1.0, top_k=top_k, seed=seed)  # top_k 0: the CPU kernel's path
    big_l, root_l = torch.randn(V, V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
    big_q, q0 = torch.softmax(torch.randn(V, V, generator=g), -1), torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q0[int(root_l.argmin())] += 0.3  # mass where top-k leaves p none
    q0[int(root_l.argmax())] = 0.0  # p's favourite is never drafted
    q0 /= q0.sum()
    kids = torch.multinomial(q0.expand(N_DRAWS, V), 3, generator=g)
    grand = torch.multinomial(big_q[kids[:, 0]], 2, generator=g)
    tokens = torch.cat((torch.zeros(N_DRAWS, 1, dtype=torch.long), kids, grand), 1)
    logits = torch.cat((root_l.expand(N_DRAWS, 1, V), big_l[tokens[:, 1:]]), 1)
    dp = torch.cat((q0.expand(N_DRAWS, 1, V), big_q[tokens[:, 1:]]), 1)
    template = Tree.from_parents([0] * 6, [-1, 0, 0, 0, 1, 1])
    tree = BatchTree.from_trees([template] * N_DRAWS)
    tree.tokens, tree.draft_probs = tokens, dp
    acc = bv.verify_sampling(tree, logits, RowSampling.from_configs([cfg] * N_DRAWS), torch.arange(N_DRAWS) + 7)
    firsts = Counter(acc.emitted[:, 0].tolist())
    via_first = (acc.count >= 2) & (acc.path[:, 1] == 1)
    seconds = Counter(map(tuple, acc.emitted[via_first, :2].tolist()))
    p0 = probabilities(root_l, cfg).double()
    exp_first = {x: float(p0[x]) for x in range(V) if p0[x] > 0}
    n2, by_first = sum(seconds.values()), Counter()
    for (x, _), c in seconds.items():
        by_first[x] += c
    exp_second = {(x, y): c / n2 * float(py) for x, c in by_first.items()
                  for y, py in enumerate(probabilities(big_l[x], cfg).double().tolist()) if py > 0}
    return firsts, seconds, exp_first, exp_second


@pytest.mark.parametrize("top_k", [7, 0], ids=["topk7-torch", "temperature-only-kernel"])
def test_pq_rule_lossless(top_k):
    firsts, seconds, exp_first, exp_second = pq_counts(top_k=top_k)
    p1, s1, df1 = chi_square_pvalue(firsts, exp_first)
    assert df1 >= 5 and p1 > PASS_P, (s1, df1)
    p2, s2, df2 = chi_square_pvalue(seconds, exp_second)
    assert sum(seconds.values()) > 3000 and df2 >= 10 and p2 > PASS_P, (s2, df2)


@pytest.mark.parametrize("attr, wrong", [NO_RESIDUAL, NO_RENORM], ids=["no-residual", "no-renorm"])
@pytest.mark.parametrize("top_k", [7, 0])
def test_pq_statistic_has_power(monkeypatch, attr, wrong, top_k):
    monkeypatch.setenv("EAGLESPEC_KERNELS", "0")  # the broken pieces are the torch path's
    monkeypatch.setattr(bv, attr, wrong)
    firsts, _, exp_first, _ = pq_counts(top_k=top_k)
    pval, stat, df = chi_square_pvalue(firsts, exp_first)
    assert pval < FAIL_P, (stat, df)


def test_greedy_kernel_is_the_torch_path_in_bf16(monkeypatch):
    """The CPU kernel and the torch ops give the same tensors, padding columns included, on bf16
    logits with many ties (the first maximum must win in both) and rows cut short by `valid`."""
    from eaglespec.kernels import ops_kernel

    if ops_kernel() is None:
        pytest.skip("the ops kernel could not be built here")
    cases = []
    for seed in range(100):
        _, tree, logits, _, _, _ = random_batch(seed, greedy_share=1.0)
        logits = (logits * 0.3).round().bfloat16()
        cases.append((tree, logits, bv.verify_greedy(tree, logits), bv.verify_greedy(tree, logits.float())))
    monkeypatch.setattr(bv, "ops_kernel", lambda: None)
    for tree, logits, got, got_fp32 in cases:
        want = bv.verify_greedy(tree, logits)
        for name in ("path", "count", "emitted", "bonus"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert torch.equal(getattr(got_fp32, name), getattr(want, name)), name


# --- no host synchronisation -------------------------------------------------------------------
def test_no_host_sync(monkeypatch):
    _, tree_q, logits_q, _, sampling_q, step_q = random_batch(9, with_q=True)
    _, tree, logits, _, sampling, step = random_batch(11, greedy_share=0.5)
    assert sampling.any_greedy and not sampling.all_greedy and sampling.any_top_k and sampling.any_top_p
    assert tree.max_depth >= 3 and tree_q.max_depth >= 3
    counter = SyncCounter(monkeypatch)
    bv.verify_greedy(tree, logits)
    bv.verify_sampling(tree, logits, sampling, step)
    bv.verify_sampling(tree_q, logits_q, sampling_q, step_q, max_children=3)
    bv.verify(tree, logits, sampling, step)
    bv.sample_rows(logits[:, 0], sampling, step)
    monkeypatch.undo()
    assert not counter.calls, counter.calls
    assert bool(torch.tensor(True))  # the probe itself works: undo restored the originals


# --- sample_rows -------------------------------------------------------------------------------
def test_sample_rows():
    torch.manual_seed(0)
    cfgs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, seed=11),
            SamplingConfig(temperature=0.8, top_k=3, seed=12), SamplingConfig(temperature=1.0, top_p=0.7, seed=11)]
    logits, step = torch.randn(4, V) * 2, torch.tensor([5, 5, 9, 6])
    sampling = RowSampling.from_configs(cfgs)
    tok = bv.sample_rows(logits, sampling, step)
    assert int(tok[0]) == int(logits[0].argmax())
    assert torch.equal(tok, bv.sample_rows(logits, sampling, step))  # reproducible per (seed, step)
    for r in range(4):  # batch-invariant
        assert int(bv.sample_rows(logits[r:r + 1], RowSampling.from_configs([cfgs[r]]), step[r:r + 1])) == int(tok[r])
    # Over many steps a sampled row follows its distribution.
    cfg = cfgs[2]
    draws = bv.sample_rows(logits[2].expand(N_DRAWS, V), RowSampling.from_configs([cfg] * N_DRAWS),
                           torch.arange(N_DRAWS))
    p = probabilities(logits[2], cfg).double()
    pval, stat, df = chi_square_pvalue(Counter(draws.tolist()), {x: float(p[x]) for x in range(V) if p[x] > 0})
    assert df == 2 and pval > PASS_P, (stat, df)


# --- CUDA: same results, no sync, capturable ----------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_sync_and_captures():
    _, tree, logits, _, sampling, step = random_batch(21, with_q=True, greedy_share=0.3)
    want = bv.verify(tree, logits, sampling, step)
    dev = torch.device("cuda")
    tree_d, logits_d, step_d = tree.to(dev), logits.to(dev), step.to(dev)
    sampling_d = RowSampling(*(getattr(sampling, f).to(dev) for f in ("temperature", "top_k", "top_p", "seed")),
                             sampling.all_greedy, sampling.any_greedy, sampling.any_top_k, sampling.any_top_p)
    bv.verify(tree_d, logits_d, sampling_d, step_d)  # warm up outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = bv.verify(tree_d, logits_d, sampling_d, step_d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for f in ("path", "count", "emitted", "bonus"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bv.verify(tree_d, logits_d, sampling_d, step_d)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = bv.verify(tree_d, logits_d, sampling_d, step_d)
    step_d.add_(1)  # new inputs in place, then replay
    graph.replay()
    torch.cuda.synchronize()
    again = bv.verify(tree, logits, sampling, step + 1)
    for f in ("path", "count", "emitted", "bonus"):
        assert torch.equal(getattr(captured, f).cpu(), getattr(again, f)), f
