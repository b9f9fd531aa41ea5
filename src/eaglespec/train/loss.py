"""EAGLE-1/2 training objective and the validation metric n-alpha.

Loss (EAGLE-1): L = SmoothL1(f^[t+1], f[t+1]) + w_cls * CE(softmax(LMHead(f[t+1])), LMHead(f^[t+1])),
on assistant positions only, with uniform noise on the input features.

With a reduced draft vocabulary (head.vocab) the CE runs over those LM-head rows only: the
target's distribution restricted to them and renormalised (a softmax over the subset's logits).

n-alpha: top-1 agreement of the draft with the target when the draft's input holds n features
it predicted itself. All chains (one starting at every position) run in parallel: the step-n
query at position p belongs to the chain that left real features at p - n; it attends to the
real pairs up to p - n and to its own chain's earlier steps (a diagonal in each step's keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..draft import DraftHead
from ..kv_cache import KVCache
from ..model import Transformer

ROW_BUCKET = 512  # see eagle_loss: bounded set of matmul shapes


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long (right-padded)
    features: torch.Tensor  # [B, T, H]
    loss_mask: torch.Tensor  # [B, T] bool, already False on padding


@dataclass
class LossParts:
    total: torch.Tensor
    reg: torch.Tensor
    cls: torch.Tensor
    acc: torch.Tensor  # top-1 agreement with the target's argmax over the draft vocabulary (step 0)
    positions: int


def eagle_loss(head: DraftHead, target: Transformer, batch: Batch, w_cls: float = 0.1, noise: float = 0.1,
               generator: torch.Generator | None = None) -> LossParts:
    tok, feat = batch.tokens, batch.features.float()
    b, t = tok.shape
    inp_feat = feat[:, :-1]
    if noise > 0:
        u = torch.rand(inp_feat.shape, generator=generator, device=inp_feat.device)
        inp_feat = inp_feat + (u * 2 - 1) * noise  # U(-noise, noise)
    pos = torch.arange(t - 1, device=tok.device).expand(b, -1)
    with torch.no_grad():
        emb = target.embed(tok[:, 1:]).float()
    pred = head(emb, inp_feat, pos, None)  # [B, T-1, H]: predicts f[t+1]
    sel = batch.loss_mask[:, 1:]
    p_hat, f_true = pred[sel], feat[:, 1:][sel]  # [M, H]
    m = int(sel.sum())
    if m == 0:
        zero = pred.sum() * 0.0
        return LossParts(zero, zero, zero, zero.detach(), 0)
    reg = F.smooth_l1_loss(p_hat, f_true)
    core = head.module if hasattr(head, "module") else head  # DDP wraps the head
    w = core.lm_weight(target.lm_head.weight)  # [Vd, H]
    # The LM-head matmuls run on M rows padded up to a multiple of ROW_BUCKET: with a bf16 target,
    # oneDNN caches a primitive (with a reordered copy of w) per distinct shape, and M differs at
    # nearly every step, so unpadded shapes grew the process by about 8 MB per step (12 GiB peak).
    pad = (0, 0, 0, (-m) % ROW_BUCKET)
    with torch.no_grad():
        t_logits = F.linear(F.pad(f_true.to(w.dtype), pad), w)[:m].float()
        t_prob = t_logits.softmax(-1)
    d_logp = F.linear(F.pad(p_hat.to(w.dtype), pad), w)[:m].float().log_softmax(-1)
    cls = -(t_prob * d_logp).sum(-1).mean()
    acc = (d_logp.argmax(-1) == t_logits.argmax(-1)).float().mean()
    return LossParts(reg + w_cls * cls, reg.detach(), cls.detach(), acc.detach(), m)


@torch.no_grad()
def chain_accuracy(head: DraftHead, target: Transformer, tokens: torch.Tensor, features: torch.Tensor,
                   loss_mask: torch.Tensor, steps: int = 5) -> tuple[list[int], list[int]]:
    """n-alpha counts for one sequence. tokens [T], features [T, H], loss_mask [T] ->
    (hits[n], totals[n]) for n = 0..steps-1."""
    t = tokens.numel() - 1  # pairs (x[p+1], f[p]) for p = 0..t-1
    if t < 1:
        return [0] * steps, [0] * steps
    dev = tokens.device
    emb = target.embed(tokens[1:])[None].to(head.fc.weight.dtype)  # [1, t, H]
    feats = features.to(head.fc.weight.dtype)
    # The target's top-1 at p + 1 (full vocabulary): [t]. The head may be fp32 beside a bf16 target,
    # so the LM head is applied in the head's dtype.
    want = F.linear(feats[1:], target.lm_head.weight.to(feats.dtype)).argmax(-1)
    w_draft = head.lm_weight(target.lm_head.weight).to(feats.dtype)
    cache = KVCache(1, head.config.num_kv_heads, head.config.head_dim, t * steps, 1, emb.dtype, dev)
    pos = torch.arange(t, device=dev)[None]
    p = torch.arange(t, device=dev)
    hits, totals = [], []
    out = head(emb, feats[:-1][None], pos, cache)  # step 0: real features, causal
    for n in range(steps):
        valid = loss_mask[1:] & (p >= n)
        pred = head.to_target_ids(F.linear(out[0], w_draft).argmax(-1))
        hits.append(int(((pred == want) & valid).sum()))
        totals.append(int(valid.sum()))
        if n + 1 == steps:
            break
        # step n+1: query p takes its chain's previous output (at p - 1) as feature
        prev = torch.cat([out[0, :1] * 0, out[0, :-1]], 0)[None]
        s = n + 1
        cols = cache.length + t
        mask = torch.zeros(t, cols, dtype=torch.bool, device=dev)
        real_cols = torch.arange(t, device=dev)
        mask[:, :t] = real_cols[None, :] <= (p - s)[:, None]  # real pairs up to p - s
        for m in range(1, s + 1):  # step m's key of this chain sits at position p - s + m
            qpos = p - s + m
            ok = qpos >= 0
            mask[p[ok], m * t + qpos[ok]] = True
        out = head(emb, prev, pos, cache, mask)
    return hits, totals


def implied_tau(alphas: list[float]) -> float:
    """Chain acceptance length from n-alpha: 1 + a0 + a0*a1 + ... (bonus token included)."""
    tau, run = 1.0, 1.0
    for a in alphas:
        run *= a
        tau += run
    return tau
