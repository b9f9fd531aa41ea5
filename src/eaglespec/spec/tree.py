"""Draft trees for B rows as tensors, and the result of verifying them.

Node 0 of every row is the root: the newest token, not yet in the target's KV cache. Nodes are
ordered parents-before-children (parents[b, i] < i), so any prefix of a row's nodes is a tree
and `valid` can cut a row short near its context limit. Siblings are tried in node order (the
draft's rank order) by sampling verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import Tree


@dataclass
class BatchTree:
    tokens: torch.Tensor  # [B, N] long; node 0 = root
    parents: torch.Tensor  # [B, N] long; -1 at the root, parents[b, i] < i elsewhere
    depth: torch.Tensor  # [B, N] long; 0 at the root
    ancestors: torch.Tensor  # [B, N, N] bool: [b, i, j] = j is an ancestor of i, or i itself
    valid: torch.Tensor  # [B, N] bool: padding / cut-off nodes are never accepted (prefix-closed)
    max_depth: int  # deepest node any row can hold (host int: sizes the accepted path)
    # Distribution each node's children were *sampled* from, [B, N, V] fp32; None for top-k drafts,
    # which verification treats as q(x) = 1 (EAGLE-2).
    draft_probs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def size(self) -> int:
        """N, the node budget per row (padding included)."""
        return int(self.tokens.shape[1])

    def positions(self, context_lengths: torch.Tensor) -> torch.Tensor:
        """[B] committed lengths -> [B, N] position ids (nodes at one depth share a position)."""
        return context_lengths[:, None] + self.depth

    @classmethod
    def from_trees(cls, trees: list[Tree], budget: int | None = None) -> "BatchTree":
        """Stack host-built trees (the reference drafter's), padding each to `budget` nodes."""
        n = budget or max(t.size for t in trees)
        b = len(trees)
        tokens = torch.zeros(b, n, dtype=torch.long)
        parents = torch.zeros(b, n, dtype=torch.long)
        valid = torch.zeros(b, n, dtype=torch.bool)
        for r, t in enumerate(trees):
            s = t.size
            tokens[r, :s] = t.tokens
            parents[r, :s] = t.parents
            parents[r, s:] = 0  # padding hangs off the root and is never valid
            valid[r, :s] = True
        probs = None
        if any(t.draft_probs is not None for t in trees):
            v = next(t.draft_probs for t in trees if t.draft_probs is not None).shape[-1]
            probs = torch.zeros(b, n, v)
            for r, t in enumerate(trees):
                if t.draft_probs is not None:
                    probs[r, : t.size] = t.draft_probs.float()
        depth, anc = ancestors_from_parents(parents)
        return cls(tokens, parents, depth, anc, valid, int(depth.max()), probs)

    def to(self, device: torch.device | str) -> "BatchTree":
        return BatchTree(self.tokens.to(device), self.parents.to(device), self.depth.to(device),
                         self.ancestors.to(device), self.valid.to(device), self.max_depth,
                         None if self.draft_probs is None else self.draft_probs.to(device))


def ancestors_from_parents(parents: torch.Tensor, max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, N] (root -1, parents[b, i] < i) -> (depth [B, N], ancestors [B, N, N] bool).

    anc(i) = {i} | anc(parent(i)); iterating that rule d times is exact for nodes up to depth d,
    so `max_depth` rounds (N - 1 if unknown) give the closure with no Python walk over nodes.
    """
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    par = parents.clamp(min=0)
    is_root = parents < 0
    anc = eye.clone()
    depth = torch.zeros(b, n, dtype=torch.long, device=parents.device)
    rounds = (n - 1) if max_depth is None else max_depth
    idx = par[:, :, None].expand(b, n, n)
    for _ in range(rounds):
        inherited = torch.gather(anc, 1, idx) & ~is_root[:, :, None]
        anc = eye | inherited
        depth = torch.where(is_root, 0, torch.gather(depth, 1, par) + 1)
    return depth, anc


@dataclass
class BatchAcceptance:
    path: torch.Tensor  # [B, D + 1] accepted node ids, root first; padded with the last accepted node
    count: torch.Tensor  # [B] nodes kept, root included (= accepted drafts + 1 = tokens emitted)
    emitted: torch.Tensor  # [B, D + 1] accepted drafted tokens then the bonus token at count - 1
    bonus: torch.Tensor  # [B] the target's own token after the last accepted node


def acceptance_from_path(tree: BatchTree, path: torch.Tensor, count: torch.Tensor,
                         bonus: torch.Tensor) -> BatchAcceptance:
    """Fill `emitted` from a path: tokens at path[1:count], then the bonus token."""
    b, width = path.shape
    cols = torch.arange(width, device=path.device)[None]
    nxt = torch.gather(tree.tokens, 1, torch.cat((path[:, 1:], path[:, -1:]), dim=1))
    emitted = torch.where(cols == (count - 1)[:, None], bonus[:, None], nxt)
    return BatchAcceptance(path, count, emitted, bonus)
