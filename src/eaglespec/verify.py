"""Verification: which drafted tokens the target accepts, exactly losslessly.

Greedy: follow the child that equals the target's argmax at its parent; the target's argmax at
the last accepted node is the bonus token.

Sampling (multi-round speculative sampling over siblings): at a node with target distribution
p, try its children in draft order:
  - top-k drafts (deterministic, q(x) = 1 as in EAGLE-2): accept x with probability p(x); on
    rejection set p(x) = 0 and renormalise;
  - sampled drafts (drawn without replacement from q): accept with min(1, p(x)/q(x)); on
    rejection p <- norm(max(0, p - q)), q(x) <- 0, q <- norm(q).
If every child is rejected the bonus token is drawn from what is left of p. Either way the
emitted token at each position is distributed exactly as p.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import SamplingConfig
from .sampling import probabilities
from .spec.rng import draw
from .tree import Tree


@dataclass
class Acceptance:
    nodes: list[int]  # accepted tree nodes, root (0) first: the KV slots to keep
    tokens: list[int]  # accepted drafted tokens (excluding the root, which was emitted before)
    bonus: int  # the target's own next token after the last accepted node

    @property
    def length(self) -> int:
        """Drafted tokens accepted (tau counts length + 1: the bonus token is free)."""
        return len(self.tokens)


def verify_greedy(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """logits: [N, V], the target's logits at each tree node."""
    preds = logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    node, nodes, accepted = 0, [0], []
    while True:
        want = preds[node]
        nxt = next((c for c in tree.children[node] if tokens[c] == want), None)
        if nxt is None:
            return Acceptance(nodes, accepted, want)
        node = nxt
        nodes.append(node)
        accepted.append(want)


def verify_sampling(tree: Tree, logits: torch.Tensor, cfg: SamplingConfig,
                    generator: torch.Generator | None, *,
                    uniform: Callable[[int, str], float] | None = None) -> Acceptance:
    """logits: [N, V]; tree.draft_probs [N, V] (row i: q that i's children were drawn from) or None.

    uniform(node, purpose): when given, replaces `generator` as the source of randomness: the
    accept test for child c uses uniform(c, 'accept') and the bonus is an inverse-CDF draw with
    uniform(final_node, 'bonus'), so the batched verifier can be checked against this one exactly.
    """
    tokens = tree.tokens.tolist()
    node, nodes, accepted = 0, [0], []
    while True:
        p = probabilities(logits[node], cfg)
        q = None if tree.draft_probs is None else tree.draft_probs[node].float().clone()
        nxt = None
        for c in tree.children[node]:
            x = tokens[c]
            r = float(torch.rand((), generator=generator)) if uniform is None else uniform(c, "accept")
            if q is None:
                if r < float(p[x]):
                    nxt = c
                    break
                p[x] = 0.0
            else:
                if q[x] > 0 and r < min(1.0, float(p[x] / q[x])):
                    nxt = c
                    break
                p = torch.clamp(p - q, min=0.0)
                q[x] = 0.0
                qs = q.sum()
                if qs > 0:
                    q = q / qs
            ps = p.sum()
            if ps <= 0:  # cannot happen in exact arithmetic; rounding must not crash a run
                break
            p = p / ps
        if nxt is None:
            if p.sum() <= 0:
                p = probabilities(logits[node], cfg)
            if uniform is None:
                bonus = int(torch.multinomial(p, 1, generator=generator))
            else:
                u = torch.tensor([uniform(node, "bonus")], dtype=torch.float64)
                bonus = int(draw(p[None], u)[0])
            return Acceptance(nodes, accepted, bonus)
        node = nxt
        nodes.append(node)
        accepted.append(tokens[node])


def verify(tree: Tree, logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> Acceptance:
    if cfg.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, cfg, generator)
