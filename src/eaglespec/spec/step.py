"""One draft-verify cycle for B rows: the only hot path, shared by vanilla and speculative decoding.

    propose a tree per row (vanilla: the root alone)  ->  one target forward over [B, N] nodes
    ->  verify (greedy or sampling, per row)  ->  keep each row's accepted path in the target cache
    ->  commit the accepted (token, feature) pairs to the draft head  ->  the bonus token is the new root

The "feature" is what the head reads from the target forward (`head.target_features`): the final
normed hidden state for EAGLE-1/2, the hidden states entering three chosen layers for EAGLE-3.

All state lives in tensors on the model's device (`RowState`); the step never reads a tensor back
to the host. Its caller copies the small result (emitted tokens and counts) once per step.
Shapes depend only on (B, N, view lengths), which the caller fixes (exact on CPU, capacity-wide for
CUDA graphs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..kernels import pinned_ops
from ..kv_cache import RowKVCache, row_attention_mask
from ..model import Transformer, causal_mask
from .propose import Proposer
from .sampling import RowSampling
from .tree import BatchAcceptance, BatchTree
from .verify import sample_rows, verify


@dataclass
class RowState:
    """Everything a running row carries between steps (all [B, ...] on the device)."""

    root: torch.Tensor  # [B] newest token: emitted, not yet in the target cache
    limit: torch.Tensor  # [B] context window: tree nodes stay at positions < limit
    step: torch.Tensor  # [B] steps this row's request has taken (seeds its random numbers)
    target_cache: RowKVCache
    draft_cache: RowKVCache | None = None
    root_hidden: torch.Tensor | None = None  # [B, H] draft head output at the root pair

    def rows(self, stop: int) -> "RowState":
        """Rows 0..stop-1 as views (updates go through to this state)."""
        return RowState(self.root[:stop], self.limit[:stop], self.step[:stop], self.target_cache.rows(0, stop),
                        None if self.draft_cache is None else self.draft_cache.rows(0, stop),
                        None if self.root_hidden is None else self.root_hidden[:stop])


@dataclass
class StepTimes:
    draft_s: float = 0.0  # propose + commit
    verify_s: float = 0.0  # target forward + verify + cache compaction


def hidden_layers(proposer: Proposer | None) -> tuple[int, ...]:
    """The target layers whose entering hidden states the head reads (EAGLE-3), else none."""
    return () if proposer is None else tuple(proposer.head.target_layers or ())


def root_tree(root: torch.Tensor) -> BatchTree:
    """Vanilla decoding's tree: each row's root alone."""
    b = root.shape[0]
    dev = root.device
    return BatchTree(root[:, None], torch.full((b, 1), -1, dtype=torch.long, device=dev),
                     torch.zeros(b, 1, dtype=torch.long, device=dev), torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
                     torch.ones(b, 1, dtype=torch.bool, device=dev), 0)


class SpecStep:
    """Advance B rows by one cycle. proposer None = vanilla decoding (a one-node tree)."""

    def __init__(self, target: Transformer, proposer: Proposer | None = None) -> None:
        self.target, self.proposer = target, proposer
        self.layers = hidden_layers(proposer)

    @property
    def budget(self) -> int:
        return 1 if self.proposer is None else self.proposer.budget

    @property
    def max_children(self) -> int:
        return 0 if self.proposer is None else self.proposer.max_children

    @property
    def path_width(self) -> int:
        return 1 if self.proposer is None else self.proposer.max_depth + 1

    def views(self, longest: int) -> tuple[int, int, int]:
        """Attention view lengths (target, propose, commit) for rows whose committed length is at
        most `longest`."""
        scratch = 0 if self.proposer is None else self.proposer.scratch
        return longest + self.budget, longest + scratch, longest + self.path_width

    def __call__(self, s: RowState, sampling: RowSampling, longest: int, times: StepTimes | None = None,
                 sync=None, exact: bool = True) -> BatchAcceptance:
        """One cycle over the rows of `s`; `longest` bounds every row's committed target length.

        exact: `longest` is exactly the longest row's length (False when views are held at a fixed
        width for CUDA graphs). sync: called between phases when timing (torch.cuda.synchronize)."""
        with pinned_ops():  # the kernels' switches read once a step, not once an op (drafting too)
            return self._cycle(s, sampling, longest, times, sync, exact)

    def _cycle(self, s: RowState, sampling: RowSampling, longest: int, times: StepTimes | None, sync,
               exact: bool) -> BatchAcceptance:
        view_t, view_p, view_c = self.views(longest)
        t0 = time.perf_counter()
        t_len = s.target_cache.lengths.clone()  # [B] context before the tree
        if self.proposer is None:
            tree = root_tree(s.root)
        else:
            room = (s.limit - t_len).clamp(min=1)
            tree = self.proposer.propose(s.draft_cache, s.root, s.root_hidden, room, view_p, sampling, s.step)
        if sync:
            sync()
        t1 = time.perf_counter()
        b, n = tree.tokens.shape
        slots = t_len[:, None] + torch.arange(n, device=t_len.device)
        s.target_cache.prepare(slots, view_t)
        if n == 1 and b == 1 and exact:
            mask = None  # one token that sees exactly the whole view: SDPA's fastest path
        else:
            mask = row_attention_mask(t_len, t_len, tree.ancestors, view_t)
        out = self.target(tree.tokens, tree.positions(t_len), s.target_cache, mask, hidden_layers=self.layers)
        acc = verify(tree, out.logits, sampling, s.step, max_children=self.max_children)
        s.target_cache.keep(t_len, acc.path, acc.count)
        if sync:
            sync()
        t2 = time.perf_counter()
        if self.proposer is not None:
            feats = self.proposer.head.target_features(out)  # [B, N, F]
            feats = torch.gather(feats, 1, acc.path[:, :, None].expand(-1, -1, feats.shape[-1]))  # [B, D+1, F]
            s.root_hidden.copy_(self.proposer.commit(s.draft_cache, s.draft_cache.lengths.clone(), acc.emitted,
                                                     feats, acc.count, view_c))
        s.root.copy_(acc.bonus)
        s.step.add_(1)
        if sync:
            sync()
        if times is not None:
            times.draft_s += (t1 - t0) + (time.perf_counter() - t2)
            times.verify_s += t2 - t1
        return acc


@torch.inference_mode()
def prefill_row(target: Transformer, proposer: Proposer | None, s: RowState, row: int, prompt: list[int],
                sampling: RowSampling, chunk: int = 512, start: int = 0) -> int:
    """Run a prompt into row `row` (chunked), draw its first token, commit its draft pairs.

    sampling: the one-row RowSampling of this request. start: the row's caches already hold the
    prompt's first `start` positions (a reused prefix: target slots 0..start-1 and draft pairs
    0..start-1, the pair at t being (prompt[t + 1], f[t])); only the rest is run, 0 <= start < n.
    Returns the first token (host int: the caller streams it)."""
    dev = target.device
    n = len(prompt)
    if not 0 <= start < n:
        raise ValueError(f"a reused prefix must leave a prompt token to run: start {start}, prompt {n}")
    tc = s.target_cache.rows(row, row + 1)
    ids = torch.tensor(prompt, device=dev)[None]
    feats = []
    logits = None
    for a in range(start, n, chunk):
        e = min(n, a + chunk)
        tc.prepare(torch.arange(a, e, device=dev)[None], e)
        out = target(ids[:, a:e], torch.arange(a, e, device=dev)[None], tc, causal_mask(a, e - a, dev),
                     logits_for="last" if e == n else "none", hidden_layers=hidden_layers(proposer))
        if proposer is not None:
            feats.append(proposer.head.target_features(out))  # [1, e - a, F]
        logits = out.logits
    tc.lengths.fill_(n)
    step = s.step[row:row + 1]
    step.zero_()
    first = sample_rows(logits[:, -1], sampling, step)
    step.add_(1)
    s.root[row] = first[0]
    if proposer is not None:
        dc = s.draft_cache.rows(row, row + 1)
        dc.lengths.fill_(start)
        shifted = torch.cat((ids[:, 1:], first[:, None]), dim=1)  # pairs (x[t+1], f[t])
        features = torch.cat(feats, dim=1)  # [1, n - start, F]: positions start..n-1
        for a in range(start, n, chunk):
            e = min(n, a + chunk)
            h = proposer.commit(dc, dc.lengths.clone(), shifted[:, a:e], features[:, a - start:e - start],
                                torch.tensor([e - a], device=dev), e)
        s.root_hidden[row] = h[0]
    return int(first[0])
