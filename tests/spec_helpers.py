"""Shared helpers for the speculative-decoding tests: an oracle drafter that is often right (for
the reference loop, and OracleProposer for the engine, with a RecordingEngine that injects it and
logs every row's steps), a recorder of verification results, exact reference distributions and a
chi-square test.

Not a conftest: import it as `from spec_helpers import ...` (tests/ is on sys.path under pytest's
default rootdir-relative import mode, like tests/tiny.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from eaglespec import generate as generate_mod
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.draft import Drafter, init_random_head
from eaglespec.generate import GenerationStats, generate_tokens
from eaglespec.model import Transformer
from eaglespec.runtime.engine import Engine, Lane, Request
from eaglespec.sampling import probabilities
from eaglespec.spec.propose import Proposer
from eaglespec.spec.step import SpecStep
from eaglespec.spec.tree import BatchTree, ancestors_from_parents
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


def sharp_random_head(cfg, seed: int = 0, scale: float = 0.3, num_layers: int = 1):
    """A random head whose outputs are far from uniform, so EAGLE-2's values differ a lot between
    nodes and its dynamic trees come out deep and lopsided, not only wide (a 0.02-init head gives
    near-uniform draft distributions, hence breadth-first trees)."""
    head = init_random_head(cfg, seed=seed, num_layers=num_layers)
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


# --- shared fixtures of the verification and engine tests ---------------------------------------
def fixed_setup(cfg: SamplingConfig, vocab: int):
    """A branching tree whose drafted tokens are likely under the node's target distribution
    (so acceptances and rejections both happen often), with fixed logits [7, vocab] per node.

        0 ─┬─ 1 ─┬─ 4 ── 6
           │     └─ 5
           ├─ 2
           └─ 3
    """
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(7, vocab, generator=g) * 1.5
    probs = probabilities(logits, cfg)
    order = [torch.argsort(probs[i], descending=True).tolist() for i in range(7)]
    # Children: ranks (1, 0, 4) under the root, (0, 2) under node 1, 0 under node 4.
    tokens = [0, order[0][1], order[0][0], order[0][4], order[1][0], order[1][2], order[4][0]]
    return Tree.from_parents(tokens, [-1, 0, 0, 0, 1, 1, 4]), logits, probs


def check_stats(stats: GenerationStats, tokens: list[int], max_depth: int | None = None) -> None:
    """A run's statistics agree with its tokens (and with a tree of depth `max_depth`)."""
    assert stats.new_tokens == len(tokens)
    assert sum(stats.accept_lengths) + 1 == len(tokens)  # the first token comes from the prefill
    assert stats.steps == len(stats.accept_lengths) == len(stats.tree_sizes)
    if stats.accept_lengths:
        assert stats.tau == pytest.approx(sum(stats.accept_lengths) / len(stats.accept_lengths))
    else:
        assert stats.tau == 0.0
    assert all(a >= 1 for a in stats.accept_lengths)
    if max_depth is not None:
        assert all(a <= max_depth + 1 for a in stats.accept_lengths)
    # accepted_per_depth[d] counts steps that accepted a depth-(d+1) draft: non-increasing.
    apd = stats.accepted_per_depth
    assert all(apd[i] >= apd[i + 1] for i in range(len(apd) - 1))


class SyncCounter:
    """Counts host round trips: calls of the Tensor methods that copy a value to the host (each
    one a device sync on CUDA), patched with monkeypatch until it undoes them."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, orig):
        def counted(t, *a, **kw):
            self.calls.append(name)
            return orig(t, *a, **kw)
        return counted


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


# --- the engine with a test proposer ---------------------------------------------------------------
def oracle_tree_tokens(target: Transformer, context: list[int], tokens: list[int], parents: list[int],
                       rng: random.Random, noise: float) -> list[int]:
    """OracleDrafter.oracle_tokens for a tree given as (tokens, parents): child number r of a node
    gets the target's r-th most likely next token at that node, each node left as it is with
    probability `noise`. context: the tokens before the root (what the target cache holds)."""
    shape = Tree.from_parents(tokens, parents)
    ctx, n = len(context), shape.size
    depth = shape.depth.tolist()
    cache = target.new_cache(ctx + n)
    with torch.inference_mode():
        target(torch.tensor(context)[None], torch.arange(ctx)[None], cache, logits_for="none")
    mask = torch.ones(n, ctx + n, dtype=torch.bool)
    mask[:, ctx:] = shape.mask
    tokens = list(tokens)
    for d in range(1, max(depth) + 1):
        level = [i for i in range(n) if depth[i] == d and rng.random() >= noise]
        if not level:
            continue
        cache.truncate(ctx)
        with torch.inference_mode():
            logits = target(torch.tensor(tokens)[None], shape.positions(ctx)[None], cache, mask).logits[0]
        for i in level:
            order = torch.argsort(logits[parents[i]], descending=True, stable=True).tolist()
            tokens[i] = order[shape.children[parents[i]].index(i) % len(order)]
    return tokens


class TrackingProposer(Proposer):
    """The real batched Proposer, plus a host-side record of every row (tests only: it reads
    tensors back every call).

    contexts[row]: the tokens in the row's target cache, then its root (the newest token). Kept by
    wrapping `commit`: the pairs (x[t+1], f[t]) it commits are the tokens after x[0], which the
    lane supplies when it admits a request (`start_row`). Rows holding no request have none.
    Every propose checks the engine's own state against it (root token, committed length) and
    records each row's number of valid nodes and the tokens drafted at valid nodes.
    on_propose(row, context, tree, b), if set, sees each live row's real proposal (row b of tree)."""

    def __init__(self, head, target: Transformer, tree_cfg: TreeConfig) -> None:
        super().__init__(head, target, tree_cfg)
        self.contexts: dict[int, list[int]] = {}
        self.valid: dict[int, int] = {}  # live row -> valid nodes of the newest tree
        self.drafted: set[int] = set()  # tokens at valid non-root nodes of every tree of a live row
        self.proposals = 0
        self.on_propose = None

    def start_row(self, row: int, held: list[int]) -> None:
        """A request enters `row`, whose draft cache already holds the pairs before held[-1] (a
        reused prefix; held = the prompt's first token alone when nothing is reused)."""
        self.contexts[row] = list(held)

    def end_row(self, row: int) -> None:
        self.contexts.pop(row, None)

    @staticmethod
    def _first_row(cache) -> int:
        # The engine hands over views of rows start.. of its one RowKVCache (RowKVCache.rows):
        # `lengths` is a slice of a 1-D tensor, so its storage offset is the first row's index.
        return cache.lengths.storage_offset()

    def commit(self, cache, committed, tokens, features, count, view_len):
        hidden = super().commit(cache, committed, tokens, features, count, view_len)
        row0 = self._first_row(cache)
        toks, cnt, com = tokens.tolist(), count.tolist(), committed.tolist()
        for b in range(len(toks)):
            ctx = self.contexts.get(row0 + b)
            if ctx is None:
                continue
            assert com[b] == len(ctx) - 1, ("draft cache out of step with the row's tokens", row0 + b)
            ctx.extend(toks[b][: cnt[b]])
        return hidden

    def propose(self, cache, root_token, root_hidden, room, view_len, sampling=None, step=None):
        tree = super().propose(cache, root_token, root_hidden, room, view_len, sampling, step)
        row0 = self._first_row(cache)
        roots, lengths = root_token.tolist(), cache.lengths.tolist()
        valid = tree.valid.sum(1).tolist()
        live = {}
        self.valid = {}
        for b in range(len(roots)):
            ctx = self.contexts.get(row0 + b)
            if ctx is None:
                continue
            assert ctx[-1] == roots[b] and lengths[b] == len(ctx) - 1, ("row state is off", row0 + b)
            live[b] = ctx
            self.valid[row0 + b] = valid[b]
            if self.on_propose is not None:
                self.on_propose(row0 + b, ctx, tree, b)
        self.proposals += 1
        tree = self.retoken(tree, live, valid)
        tokens = tree.tokens.tolist()
        for b in live:
            self.drafted.update(tokens[b][1: valid[b]])
        return tree

    def retoken(self, tree: BatchTree, live: dict[int, list[int]], valid: list[int]) -> BatchTree:
        """Hook: replace the drafted tokens of live rows (b -> context). The real ones here."""
        return tree


class OracleProposer(TrackingProposer):
    """OracleDrafter for the engine: trees of the real proposer's shape, tokens from the target.

    Per live row and step: with probability p_oracle child number r of a node gets the target's
    r-th most likely next token there (a separate target forward over the row's context and the
    tree, on the host), each node left random with probability `noise`; otherwise all drafted
    tokens are random. Nodes cut off by the window get oracle tokens too (they must never be
    accepted all the same). memo (p_oracle 1, noise 0 only): a row's tree is remembered per (context,
    valid nodes), shape included, so revisited contexts cost nothing."""

    def __init__(self, head, target: Transformer, tree_cfg: TreeConfig, seed: int = 0, p_oracle: float = 0.5,
                 noise: float = 0.15, memo: bool = False) -> None:
        super().__init__(head, target, tree_cfg)
        assert not memo or (p_oracle == 1.0 and noise == 0.0)
        self.rng = random.Random(seed)
        self.p_oracle, self.noise = p_oracle, noise
        self.memo: dict | None = {} if memo else None
        self.oracle_steps = 0

    def retoken(self, tree, live, valid):
        if tree.size == 1 or not live:
            return tree
        tokens, parents = tree.tokens.clone(), tree.parents.clone()
        n, vocab = tree.size, self.target.config.vocab_size
        for b, ctx in live.items():
            # Every node, the ones cut off by the window included: those must never be accepted,
            # even when they are the target's own tokens.
            key = (tuple(ctx), valid[b])
            if self.memo is not None and key in self.memo:
                toks, pars = self.memo[key]
            else:
                pars = parents[b].tolist()
                toks = [ctx[-1]] + [self.rng.randrange(vocab) for _ in range(n - 1)]
                if self.rng.random() < self.p_oracle:
                    self.oracle_steps += 1
                    toks = oracle_tree_tokens(self.target, ctx[:-1], toks, pars, self.rng, self.noise)
                if self.memo is not None:
                    self.memo[key] = (toks, pars)
            tokens[b] = torch.tensor(toks)
            parents[b] = torch.tensor(pars)
        # The oracle's tokens were not drawn from the head's q: verify them as top-k drafts (q = 1).
        if self.memo is None:  # the proposer's own shape
            return dataclasses.replace(tree, tokens=tokens, draft_probs=None)
        depth, ancestors = ancestors_from_parents(parents, tree.max_depth)
        return BatchTree(tokens, parents, depth, ancestors, tree.valid, tree.max_depth)


@dataclass
class StepRecord:
    """One live row's outcome in one engine step."""

    req: Request
    step: int  # the lane's step number
    t_len: int  # committed target length before the step
    count: int  # nodes the step kept (accepted drafts + 1), before any stop cut them
    valid: int  # valid tree nodes (the budget, or fewer near the window)
    path: list[int]  # accepted node ids, root first


class _RecordingStep:
    """Wraps a SpecStep and keeps its newest BatchAcceptance."""

    def __init__(self, inner: SpecStep) -> None:
        self.inner, self.last = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.last = self.inner(*args, **kwargs)
        return self.last


class RecordingLane(Lane):
    """A Lane that tells a TrackingProposer which rows hold which request and logs every live
    row's step (StepRecord)."""

    def __init__(self, engine: Engine, proposer: Proposer | None, max_batch: int) -> None:
        super().__init__(engine, proposer, max_batch)
        self.step_fn = _RecordingStep(self.step_fn)
        self.log: list[StepRecord] = []
        self.steps = 0

    def _pick_row(self, prompt: list[int]) -> tuple[int, int]:
        row, reuse = super()._pick_row(prompt)
        if isinstance(self.proposer, TrackingProposer):
            self.proposer.start_row(row, prompt[: reuse + 1])
        return row, reuse

    def retire(self, row: int) -> None:
        if isinstance(self.proposer, TrackingProposer):
            self.proposer.end_row(row)
        super().retire(row)

    def step(self) -> None:
        live = {r: self.requests[r] for r in self.active}
        before = list(self.lengths)
        super().step()
        if not live:
            return
        acc = self.step_fn.last
        self.steps += 1
        count, path = acc.count.tolist(), acc.path.tolist()
        valid = self.proposer.valid if isinstance(self.proposer, TrackingProposer) else {}
        for r, req in live.items():
            self.log.append(StepRecord(req, self.steps, before[r], count[r], valid.get(r, self.step_fn.budget),
                                       path[r][: count[r]]))


class RecordingEngine(Engine):
    """An Engine whose lanes are RecordingLanes and whose speculative lanes use
    `proposer(head, target, tree_cfg)` (default: TrackingProposer, i.e. the real drafts)."""

    def __init__(self, target: Transformer, head=None, *, proposer=None, **kw) -> None:
        super().__init__(target, head, **kw)
        self.make_proposer = proposer or TrackingProposer

    def _lane(self, req: Request) -> Lane:
        key = req.lane_key
        if key not in self.lanes:
            proposer = None if key[0] == "vanilla" else self.make_proposer(self.head, self.target, req.tree)
            self.lanes[key] = RecordingLane(self, proposer, self.max_batch)
        return self.lanes[key]

    @property
    def log(self) -> list[StepRecord]:
        return [rec for lane in self.lanes.values() for rec in lane.log]


def engine_tokens(req: Request) -> list[int]:
    """A request's output so far (Engine.run leaves every chunk pending)."""
    return req.pending_tokens


def cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    """A run's tokens up to and including the first EOS (what a run that stops at EOS emits)."""
    if eos is None or eos not in tokens:
        return tokens
    return tokens[: tokens.index(eos) + 1]
