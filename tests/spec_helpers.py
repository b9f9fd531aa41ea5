"""Shared helpers for the speculative-decoding tests: an oracle drafter that is often right,
a recorder of verification results, exact reference distributions and a chi-square test.

Not a conftest: import it as `from spec_helpers import ...` (tests/ is on sys.path under pytest's
default rootdir-relative import mode, like tests/tiny.py).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import Counter
from dataclasses import dataclass, field

import torch

from eaglespec import generate as generate_mod
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.draft import Drafter, init_random_head
from eaglespec.generate import GenerationStats, generate_tokens
from eaglespec.model import Transformer
from eaglespec.sampling import probabilities
from eaglespec.tree import Tree


# --- an informative draft --------------------------------------------------------------------
class OracleDrafter(Drafter):
    """A Drafter whose trees have the real drafter's shape but tokens chosen from the *target*.

    The shape comes from the wrapped Drafter (so the draft cache, static-tree truncation and the
    dynamic tree all run for real); the tokens are then replaced. With probability `p_oracle` a
    step is an "oracle" step: child number r of a node gets the target's r-th most likely next
    token at that node (computed with a separate, freshly cached forward of the target over the
    context and the tree so far), except that each node is replaced by a random token with
    probability `noise`. Otherwise every drafted token is random. So the rank-0 path is the
    target's greedy continuation: long accepted runs occur, and so do short ones.
    """

    def __init__(self, head, target: Transformer, seed: int = 0, p_oracle: float = 0.5, noise: float = 0.15,
                 memo: bool = False) -> None:
        super().__init__(head, target)
        self.rng = random.Random(seed)
        self.p_oracle, self.noise = p_oracle, noise
        # memo: remember trees per (context, tree settings); only for the deterministic oracle
        # (p_oracle 1, noise 0), where a tree is a function of the context. Saves time in the
        # statistical tests, which revisit the same few contexts thousands of times.
        assert not memo or (p_oracle == 1.0 and noise == 0.0)
        self.memo: dict | None = {} if memo else None
        self.prompt: list[int] = []
        self.context: list[int] = []  # tokens in the target cache + the root (newest token)
        self.oracle_steps = 0

    def start(self, prompt_ids: list[int]) -> None:
        """Call before generate_tokens: the first prompt token is not part of any draft pair."""
        self.prompt = list(prompt_ids)

    def reset(self, max_len: int) -> None:
        super().reset(max_len)
        self.context = self.prompt[:1]

    def extend(self, tokens: torch.Tensor, features: torch.Tensor):
        self.context.extend(int(t) for t in tokens.tolist())
        return super().extend(tokens, features)

    def draft(self, root_token: int, state, tree_cfg: TreeConfig, max_nodes: int) -> Tree:
        if self.memo is not None:
            key = (tuple(self.context), tree_cfg.method, tree_cfg.total_tokens, tree_cfg.depth, tree_cfg.top_k,
                   tuple(map(tuple, tree_cfg.choices)), max_nodes)
            if key not in self.memo:
                self.memo[key] = self._draft(root_token, state, tree_cfg, max_nodes)
            return self.memo[key]
        return self._draft(root_token, state, tree_cfg, max_nodes)

    def _draft(self, root_token: int, state, tree_cfg: TreeConfig, max_nodes: int) -> Tree:
        shape = super().draft(root_token, state, tree_cfg, max_nodes)
        assert self.context and self.context[-1] == root_token, "context tracking is off"
        assert self.cache.length == self.committed == len(self.context) - 1
        n = shape.size
        if n == 1:
            return shape
        vocab = self.target.config.vocab_size
        tokens = [root_token] + [self.rng.randrange(vocab) for _ in range(n - 1)]
        if self.rng.random() >= self.p_oracle:
            return Tree.from_parents(tokens, shape.parents)
        self.oracle_steps += 1
        return Tree.from_parents(self.oracle_tokens(tokens, shape), shape.parents)

    def oracle_tokens(self, tokens: list[int], shape: Tree) -> list[int]:
        """Assign the tokens depth by depth: one target forward per depth over the context and
        the whole tree (nodes deeper than the current depth are placeholders that no node of
        the current depth attends to)."""
        context = self.context[:-1]
        ctx, n = len(context), shape.size
        parents = shape.parents.tolist()
        depth = shape.depth.tolist()
        cache = self.target.new_cache(ctx + n)
        with torch.inference_mode():
            self.target(torch.tensor(context)[None], torch.arange(ctx)[None], cache, logits_for="none")
        mask = torch.ones(n, ctx + n, dtype=torch.bool)
        mask[:, ctx:] = shape.mask
        tokens = list(tokens)
        for d in range(1, max(depth) + 1):
            level = [i for i in range(n) if depth[i] == d and self.rng.random() >= self.noise]
            if not level:
                continue
            cache.truncate(ctx)
            with torch.inference_mode():
                out = self.target(torch.tensor(tokens)[None], shape.positions(ctx)[None], cache, mask)
            logits = out.logits[0]
            for i in level:
                order = torch.argsort(logits[parents[i]], descending=True, stable=True).tolist()
                tokens[i] = order[shape.children[parents[i]].index(i) % len(order)]
        return tokens


def sharp_random_head(cfg, seed: int = 0, scale: float = 0.3):
    """A random head whose outputs are far from uniform, so EAGLE-2's values differ a lot between
    nodes and its dynamic trees come out deep and lopsided, not only wide (a 0.02-init head gives
    near-uniform draft distributions, hence breadth-first trees)."""
    head = init_random_head(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 12345)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return head


def oracle_drafter(target: Transformer, seed: int = 0, p_oracle: float = 0.5, noise: float = 0.15,
                   memo: bool = False) -> OracleDrafter:
    return OracleDrafter(sharp_random_head(target.config, seed=seed + 1), target, seed, p_oracle, noise, memo)


@contextlib.contextmanager
def single_thread():
    """Tiny models are all per-op overhead; extra intra-op threads only fight over shared cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# --- running and recording -------------------------------------------------------------------
@dataclass
class Run:
    tokens: list[int]
    stats: GenerationStats
    acceptances: list = field(default_factory=list)


def run_generate(target: Transformer, prompt: list[int], drafter: Drafter | None = None, **kw) -> Run:
    """generate_tokens collected into one list, with its stats."""
    if isinstance(drafter, OracleDrafter):
        drafter.start(prompt)
    stats = GenerationStats()
    out: list[int] = []
    for chunk in generate_tokens(target, prompt, drafter=drafter, stats=stats, **kw):
        assert chunk, "generate_tokens yielded an empty chunk"
        out.extend(chunk)
    return Run(out, stats)


class VerifyRecorder:
    """Wraps eaglespec.generate.verify (install with monkeypatch) and keeps every Acceptance."""

    def __init__(self, inner=None) -> None:
        self.inner = inner or generate_mod.verify
        self.log: list = []

    def __call__(self, tree, logits, cfg, gen):
        acc = self.inner(tree, logits, cfg, gen)
        self.log.append(acc)
        return acc

    def take(self) -> list:
        out, self.log = self.log, []
        return out


# --- exact reference distributions -----------------------------------------------------------
@torch.inference_mode()
def exact_sequence_probs(target: Transformer, prompt: list[int], cfg: SamplingConfig, length: int) -> dict[tuple, float]:
    """P(first `length` generated tokens = s) under plain sampling with `cfg`, for every s with
    P > 0, computed by enumerating continuations (one batched forward per length)."""
    probs = {(): 1.0}
    for _ in range(length):
        seqs = [s for s, p in probs.items() if p > 0]
        batch = torch.tensor([prompt + list(s) for s in seqs])
        b, t = batch.shape
        cache = target.new_cache(t, batch_size=b)
        logits = target(batch, torch.arange(t)[None].expand(b, t), cache, logits_for="last").logits[:, -1]
        p_next = probabilities(logits, cfg).double()
        new: dict[tuple, float] = {}
        for s, row in zip(seqs, p_next):
            for tok in torch.nonzero(row > 0).flatten().tolist():
                new[s + (tok,)] = probs[s] * float(row[tok])
        probs = new
    return probs


# --- statistics --------------------------------------------------------------------------------
def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square_pvalue(observed: Counter, expected_probs: dict, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson chi-square goodness of fit. Cells whose expected count is below `min_expected`
    are pooled into one cell (and the pool itself joins the smallest cell if still too small).
    An observation outside the support gives p-value 0. Returns (p_value, statistic, df)."""
    n = sum(observed.values())
    if any(c > 0 and expected_probs.get(k, 0.0) <= 0 for k, c in observed.items()):
        return 0.0, math.inf, 0
    cells: list[tuple[float, float]] = []  # (observed, expected)
    pool_o = pool_e = 0.0
    for k, p in expected_probs.items():
        e = n * p
        if e >= min_expected:
            cells.append((observed.get(k, 0), e))
        else:
            pool_o += observed.get(k, 0)
            pool_e += e
    if pool_e > 0:
        if pool_e >= min_expected or not cells:
            cells.append((pool_o, pool_e))
        else:
            cells.sort(key=lambda c: c[1])
            o, e = cells[0]
            cells[0] = (o + pool_o, e + pool_e)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return chi2_sf(stat, df), stat, df
