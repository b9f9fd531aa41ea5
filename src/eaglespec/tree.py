"""Draft trees: the Tree dataclass and the pure parts of building one.

Node 0 is the root: the last generated token, not yet in the target's KV cache. Every other node
is a drafted continuation of its parent. Nodes are ordered parents-before-children, so a tree's
tokens can be scored in one forward pass with `mask` (each node sees its ancestors and itself)
and `depth` (position = context length + depth).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .files import read_text_limited

MAX_CHOICES_BYTES = 1 << 20


@dataclass
class Tree:
    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, -1 for the root
    depth: torch.Tensor  # [N] long, 0 for the root
    mask: torch.Tensor  # [N, N] bool: mask[i, j] = j is an ancestor of i or i itself
    paths: list[list[int]]  # root-to-leaf node indices
    children: list[list[int]]  # children of each node, in draft-rank order
    # Draft distribution each node's token was *sampled* from, [N, V]; None for top-k drafts
    # (deterministic), which verification treats as q(x) = 1 (EAGLE-2).
    draft_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None  # [N] cumulative draft log-probability (eagle2)

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def positions(self, context_length: int) -> torch.Tensor:
        return self.depth + context_length

    @classmethod
    def from_parents(cls, tokens: list[int] | torch.Tensor, parents: list[int] | torch.Tensor,
                     draft_probs: torch.Tensor | None = None, values: torch.Tensor | None = None) -> "Tree":
        tokens_t = torch.as_tensor(tokens, dtype=torch.long)
        par = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
        n = len(par)
        if n == 0 or par[0] != -1 or any(not (0 <= p < i) for i, p in enumerate(par) if i):
            raise ValueError(f"parents must start with -1 and point to earlier nodes, got {par}")
        depth = [0] * n
        mask = torch.zeros(n, n, dtype=torch.bool)
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(n):
            mask[i, i] = True
            if i:
                p = par[i]
                depth[i] = depth[p] + 1
                mask[i] |= mask[p]
                children[p].append(i)
        paths = []
        for leaf in (i for i in range(n) if not children[i]):
            path = [leaf]
            while par[path[-1]] != -1:
                path.append(par[path[-1]])
            paths.append(path[::-1])
        return cls(tokens_t, torch.tensor(par), torch.tensor(depth), mask, paths, children, draft_probs, values)


def chain(tokens: list[int]) -> Tree:
    """A single path (vanilla decoding is the chain of just the root)."""
    return Tree.from_parents(tokens, [-1] + list(range(len(tokens) - 1)))


@dataclass
class StaticLayout:
    """An EAGLE-1 choices list as a tree of ranks: node i is child number rank[i] of parent[i]."""

    parents: list[int]
    ranks: list[int]
    depth: list[int]
    choices: list[list[int]] = field(default_factory=list)

    @property
    def max_depth(self) -> int:
        return max(self.depth)


def static_layout(choices: list[list[int]]) -> StaticLayout:
    """Order the choices (by depth, then rank path) and link each to its parent path."""
    ordered = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if any(len(c) == 0 or min(c) < 0 for c in ordered):
        raise ValueError("every tree choice must be a non-empty list of child ranks >= 0")
    index = {(): 0}
    parents, ranks, depth = [-1], [0], [0]
    for c in ordered:
        if c[:-1] not in index:
            raise ValueError(f"tree choice {list(c)} has no parent path {list(c[:-1])} in the list")
        index[c] = len(parents)
        parents.append(index[c[:-1]])
        ranks.append(c[-1])
        depth.append(len(c))
    return StaticLayout(parents, ranks, depth, [list(c) for c in ordered])


# Sampled drafts (T > 0): how often a node's r-th child, drawn from the head's q without
# replacement after children 0..r-1 were drawn and rejected, is accepted (speculative sampling's
# min(1, p/q) round on what is left of p and q). Counted in verification with the shipped head
# on 30 MT-bench first turns at T=1, depths 0-2 (scripts/sibling_acceptance.py; README "Session
# 25: sampled trees"): rank 0 0.49-0.50, rank 1 0.21-0.29, rank 2 0.12-0.17, rank 3 0.08-0.12.
SAMPLED_ACCEPT = (0.5, 0.22, 0.14, 0.1)


def sampled_layout(total_tokens: int, depth: int, top_k: int,
                   accept: tuple[float, ...] = SAMPLED_ACCEPT) -> list[list[int]]:
    """The fixed tree shape for drafts sampled from q (EAGLE-2's reranked tree depends on the
    drafted values, and verification is exact for sampled drafts only when the shape does not):
    the total_tokens - 1 paths most likely to be accepted, a child of rank r reached with
    prod(1 - accept[j], j < r) * accept[r] (the last entry repeats), at most `depth` deep and
    `top_k` children per node. Children are added rank by rank, so siblings are always ranks
    0..m-1: verification tries them in that order, removing each rejected draft from q, which is
    how they were drawn. top_k 1 gives the chain of min(total_tokens - 1, depth) nodes."""
    def reach(r: int) -> float:
        miss = 1.0
        for j in range(r):
            miss *= 1.0 - accept[min(j, len(accept) - 1)]
        return miss * accept[min(r, len(accept) - 1)]

    paths: list[list[int]] = []
    frontier = [(-reach(0), (0,))]  # a heap of (-value, path): each node's next sibling and first child
    while frontier and len(paths) < total_tokens - 1:
        neg, path = heapq.heappop(frontier)
        paths.append(list(path))
        if path[-1] + 1 < top_k:
            heapq.heappush(frontier, (neg / reach(path[-1]) * reach(path[-1] + 1), path[:-1] + (path[-1] + 1,)))
        if len(path) < depth:
            heapq.heappush(frontier, (neg * reach(0), path + (0,)))
    return paths


def siblings_in_rank_order(layout: StaticLayout) -> bool:
    """Whether every node of rank r > 0 has a sibling of rank r - 1, so the layout can hold
    siblings drawn without replacement (the r-th draw is rank r, and verification tries siblings
    in rank order, removing each rejected one from q). sampled_layout's always do; a hand-made
    EAGLE-1 list such as [[0], [2]] does not."""
    have = {tuple(c) for c in layout.choices}
    return all(c[-1] == 0 or c[:-1] + (c[-1] - 1,) in have for c in have)


def truncate_layout(layout: StaticLayout, size: int) -> StaticLayout:
    """The first `size` nodes (parents come first, so any prefix is a tree): used near the
    context limit."""
    return StaticLayout(layout.parents[:size], layout.ranks[:size], layout.depth[:size], layout.choices[: size - 1])


def load_choices(path: str | Path) -> list[list[int]]:
    """A JSON file holding a list of paths, e.g. [[0], [1], [0, 0]]."""
    try:  # bounded: the largest accepted tree (1023 paths of depth <= 64) is far below 1 MiB
        data = json.loads(read_text_limited(path, MAX_CHOICES_BYTES))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"--tree-choices {path}: unreadable JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(c, list) and all(isinstance(x, int) for x in c) for c in data):
        raise ValueError(f"--tree-choices {path}: expected a list of lists of ints, e.g. [[0], [1], [0, 0]]")
    static_layout(data)  # validate the structure now, not mid-generation
    return data


def rerank(values: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, keep: int) -> torch.Tensor:
    """EAGLE-2 rerank: the `keep` best candidates by value, returned parents-before-children.

    values, parents, depth: [M] over candidate nodes (parents index candidates, -1 = root).
    A child's value never exceeds its parent's (log-probabilities add up), so the best set is
    closed under taking parents, provided ties go to the shallower node: sort by (value desc,
    depth asc, index asc).
    """
    m = values.numel()
    keep = min(keep, m)
    # Stable lexicographic order: sort by index, then depth, then value (each stable).
    order = torch.arange(m)
    order = order[torch.sort(depth[order], stable=True).indices]
    order = order[torch.sort(values[order], descending=True, stable=True).indices]
    chosen = order[:keep]
    # Parents before children: depth first, then original index (parents are created earlier).
    key = depth[chosen] * (m + 1) + chosen
    return chosen[torch.argsort(key)]
