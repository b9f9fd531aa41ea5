"""Batched verification: which drafted tokens the target accepts, for B rows at once.

Owns the tensor counterparts of `eaglespec.verify` (the host reference, kept as the oracle that
tests compare against): greedy acceptance, multi-round speculative sampling over siblings (q = 1
rule for top-k drafts, p/q rule for sampled drafts), the per-row choice between the two, and the
plain per-row draw of the first token after the prefill.

Random numbers come from `spec.rng.uniforms(seed, step, node, purpose)`, so a row's result depends
on its own request only, never on the batch. Nothing here reads a tensor back to the host or
makes a data-dependent shape: the only Python loops run over host bounds (tree depth, sibling
rank), so a whole step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ..kernels import ops_kernel
from .rng import ACCEPT, BONUS, draw, uniforms
from .sampling import RowSampling, row_probabilities
from .tree import BatchAcceptance, BatchTree, acceptance_from_path


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension (the first maximum on ties, like argmax). On a CPU the
    package's row kernel (csrc/pointwise.cpp; NaNs never win): torch took 0.7 ms for 16 x 49k
    logits, in bf16 or fp32. Else max().indices, 4x faster than argmax on bf16 CPU tensors."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32) and logits.shape[-1]:
        ops = ops_kernel()
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.max(-1).indices


def _at(x: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...], node [B] -> x[b, node[b]]: [B, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), node]


def _path_to(tree: BatchTree, node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """node [B] -> (path [B, D + 1]: its ancestors root first, padded with node; count [B])."""
    b, n = tree.tokens.shape
    width = tree.max_depth + 1
    # An ancestor at depth d goes to column d; everything else to a spare column, dropped after.
    cols = torch.where(_at(tree.ancestors, node), tree.depth, width)  # [B, N]
    src = torch.arange(n, device=node.device).expand(b, n)
    path = node[:, None].repeat(1, width + 1).scatter(1, cols, src)[:, :width]
    return path, _at(tree.depth, node) + 1


def verify_greedy(tree: BatchTree, logits: torch.Tensor) -> BatchAcceptance:
    """logits [B, N, V]: the target's logits at every node. Accept the longest run of drafts that
    equal the target's argmax at their parent; the argmax at the last accepted node is the bonus.

    On a CPU one kernel call (csrc/pointwise.cpp, verify_greedy_rows) walks each row from the root
    instead: the same result (tests/test_batch_verify.py), 0.6 ms less per step."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32) and logits.shape[-1]:
        ops = ops_kernel()
        if ops is not None:
            return BatchAcceptance(*ops.verify_greedy_rows(logits, tree.tokens, tree.parents, tree.valid,
                                                           tree.max_depth + 1))
    b, n = tree.tokens.shape
    idx = torch.arange(n, device=logits.device)
    preds = greedy_tokens(logits)  # [B, N]
    par = tree.parents.clamp(min=0)
    match = tree.valid & (idx > 0) & (tree.tokens == preds.gather(1, par))  # [B, N]
    # The oracle follows the *first* matching child: a later sibling with the same token is never
    # reached. Drafters give siblings distinct tokens; this keeps both equal on any input anyway.
    same = (par[:, :, None] == par[:, None, :]) & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
    shadowed = (same & match[:, None, :] & (idx[None, :] < idx[:, None])).any(-1)  # [B, N]
    ok = (match & ~shadowed) | (idx == 0)
    accepted = ~(tree.ancestors & ~ok[:, None, :]).any(-1)  # [B, N]: ok all the way from the root
    # Accepted nodes form one chain from the root: take its deepest node (lowest index on a tie).
    best = torch.where(accepted, tree.depth * n + (n - 1 - idx), -1).argmax(-1)  # [B]
    path, count = _path_to(tree, best)
    return acceptance_from_path(tree, path, count, preds.gather(1, best[:, None])[:, 0])


def _children(tree: BatchTree, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (kids [B, N, k]: the first k valid children of each node in index order, 0-padded;
    has [B, N, k] bool: which of them exist)."""
    n = tree.size
    idx = torch.arange(n, device=tree.tokens.device)
    is_child = (tree.parents[:, None, :] == idx[None, :, None]) & tree.valid[:, None, :]  # [B, i, j]
    kids = torch.where(is_child, idx, n).sort(-1).values[..., :k]
    has = kids < n
    return torch.where(has, kids, 0), has


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """What is left of p [B, V] after draft token x [B, 1] was rejected, before renormalising
    (q None: a top-k draft, q(x) = 1, so all of p(x) was offered; else max(0, p - q))."""
    if q is None:
        return p.scatter(1, x, 0.0)
    return (p - q).clamp(min=0.0)


def _normalised(x: torch.Tensor) -> torch.Tensor:
    """x / x.sum() per row, leaving rows with no mass as they are (as the oracle does)."""
    s = x.sum(-1, keepdim=True)
    return torch.where(s > 0, x / s, x)


def verify_sampling(tree: BatchTree, logits: torch.Tensor, sampling: RowSampling, step: torch.Tensor, *,
                    max_children: int | None = None) -> BatchAcceptance:
    """Multi-round speculative sampling, row by row exactly as `eaglespec.verify.verify_sampling`
    with its `uniform` hook fed from `uniforms(seed, step, node, purpose)`.

    logits [B, N, V]; step [B] int64, the request's step counter (fresh uniforms every step).
    max_children: a host bound on any node's number of children (the drafter knows it: its top-k
    or the static layout); None uses N - 1, always enough but a longer loop. A bound below the
    true count leaves later siblings untried: still lossless, but no longer the oracle's result.
    """
    b, n, v = logits.shape
    dev = logits.device
    k_max = n - 1 if max_children is None else min(max_children, n - 1)
    if (dev.type == "cpu" and not (sampling.any_top_k or sampling.any_top_p) and v
            and logits.dtype in (torch.bfloat16, torch.float32)):
        ops = ops_kernel()
        if ops is not None:  # temperature-only rows: each row walked in one call (csrc/sampling.cpp)
            nodes = torch.arange(n, device=dev).expand(b, n)
            q = None if tree.draft_probs is None else tree.draft_probs.float()
            out = ops.verify_sampling_rows(
                logits, tree.tokens, tree.parents, tree.valid, sampling.sampling_temperature, q,
                uniforms(sampling.seed, step, nodes, ACCEPT), uniforms(sampling.seed, step, nodes, BONUS),
                tree.max_depth + 1, k_max)
            return BatchAcceptance(*out)
    all_kids, all_has = _children(tree, k_max)
    node = torch.zeros(b, dtype=torch.long, device=dev)  # current node; the final one once done
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    final_p = torch.zeros(b, v, dtype=torch.float32, device=dev)  # what the bonus is drawn from
    for d in range(tree.max_depth + 1):
        fresh = row_probabilities(_at(logits, node), sampling)  # [B, V]
        p = fresh
        q = None if tree.draft_probs is None else _at(tree.draft_probs, node).float()
        kids, has = _at(all_kids, node), _at(all_has, node)  # [B, K]
        u = uniforms(sampling.seed, step, kids, ACCEPT)  # [B, K] float64
        moved = torch.zeros_like(done)  # accepted a child at this depth
        nxt = node
        for k in range(k_max if d < tree.max_depth else 0):
            c = kids[:, k]
            x = tree.tokens.gather(1, c[:, None])  # [B, 1]
            # Where the oracle stops early because p ran out of mass, p stays all zero here and
            # no later child can pass the test, so the outcome is the same without a flag.
            trying = ~done & has[:, k] & ~moved
            px = p.gather(1, x)[:, 0]
            # Compare in float64 with the fp32 ratio, as the oracle's float(...) does.
            if q is None:
                acc = trying & (u[:, k] < px.double())
            else:
                qx = q.gather(1, x)[:, 0]
                ratio = torch.where(qx > 0, px / qx, 0.0).double().clamp(max=1.0)
                acc = trying & (qx > 0) & (u[:, k] < ratio)
            rej = (trying & ~acc)[:, None]
            left = _residual(p, q, x)
            if q is not None:  # after p's residual: it uses q before x is removed
                q = torch.where(rej, _normalised(q.scatter(1, x, 0.0)), q)
            p = torch.where(rej, _normalised(left), p)
            nxt = torch.where(acc, c, nxt)
            moved |= acc
        # Rows that accepted no child stop here: the bonus comes from what is left of p (fresh p at
        # a leaf; fresh p too if rounding left no mass, which would otherwise be unsampleable).
        stop = ~done & ~moved
        rest = torch.where(p.sum(-1, keepdim=True) <= 0, fresh, p)
        final_p = torch.where(stop[:, None], rest, final_p)
        done |= stop
        node = nxt
    bonus = draw(final_p, uniforms(sampling.seed, step, node, BONUS))
    path, count = _path_to(tree, node)
    return acceptance_from_path(tree, path, count, bonus)


def verify(tree: BatchTree, logits: torch.Tensor, sampling: RowSampling, step: torch.Tensor, *,
           max_children: int | None = None) -> BatchAcceptance:
    """Greedy rows (temperature 0) verify greedily, the others by speculative sampling."""
    if sampling.all_greedy:
        return verify_greedy(tree, logits)
    sampled = verify_sampling(tree, logits, sampling, step, max_children=max_children)
    if not sampling.any_greedy:
        return sampled
    greedy = verify_greedy(tree, logits)
    g = sampling.greedy

    def pick(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.where(g.view(-1, *([1] * (a.dim() - 1))), a, s)

    return BatchAcceptance(pick(greedy.path, sampled.path), pick(greedy.count, sampled.count),
                           pick(greedy.emitted, sampled.emitted), pick(greedy.bonus, sampled.bonus))


def sample_rows(logits: torch.Tensor, sampling: RowSampling, step: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> tokens [B]: argmax for greedy rows, else a draw from the row's distribution
    (used for the first token after the prefill, with the bonus stream of node 0)."""
    greedy = greedy_tokens(logits)
    if sampling.all_greedy:
        return greedy
    u = uniforms(sampling.seed, step, torch.zeros_like(step), BONUS)
    return torch.where(sampling.greedy, greedy, draw(row_probabilities(logits, sampling), u))
