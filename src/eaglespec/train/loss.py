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

from ..attention import ChainMask
from ..draft import DraftHead
from ..kv_cache import KVCache
from ..model import Transformer
from .readout_loss import product_dtype, readout_loss

ROW_BUCKET = 512  # see eagle_loss: bounded set of matmul shapes


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long (right-padded)
    features: torch.Tensor  # [B, T, H]
    loss_mask: torch.Tensor  # [B, T] bool, already False on padding
    # [B, T, F] what the head reads as target features when they are not `features` (EAGLE-3: the
    # hidden states entering its target layers, concatenated); None: `features`.
    inputs: torch.Tensor | None = None


@dataclass
class Sample:
    """One training sequence, as a store serves it."""

    tokens: torch.Tensor  # [T] long
    features: torch.Tensor  # [T, H] the target's final (normed) features
    loss_mask: torch.Tensor  # [T] bool
    inputs: torch.Tensor | None = None  # [T, F] the head's feature input when not `features` (EAGLE-3)


@dataclass
class LossParts:
    total: torch.Tensor  # what backward runs on: sum over steps of decay^s * (w_reg * reg_s + w_cls * cls_s + w_tv * tv_s)
    reg: torch.Tensor  # step 0's terms (today's loss), detached
    cls: torch.Tensor
    acc: torch.Tensor  # top-1 agreement with the target's argmax over the draft vocabulary (step 0)
    positions: int  # scored positions of step 0
    per_step: torch.Tensor | None = None  # [N, 4] (reg, cls, acc, tv) of each unrolled step, detached
    tv: torch.Tensor | None = None  # step 0's total variation 0.5 * sum|p - q|, detached (logged whatever w_tv)


class TrainKV:
    """A KV cache for training: the keys/values of every call so far, concatenated, so gradients
    flow through all unrolled steps (KVCache writes into preallocated storage, which would cut
    them). Same interface as KVCache for the head: write, advance, length."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, n_kv, T, hd] -> every key/value so far: [B, n_kv, length + T, hd]."""
        if layer in self.k:
            k, v = torch.cat((self.k[layer], k), 2), torch.cat((self.v[layer], v), 2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def advance(self, t: int) -> None:
        self.length += t


def chain_valid(scored: torch.Tensor, step: int) -> torch.Tensor:
    """Which step-`step` queries are scored. scored [B, T] bool: x[p+1] is a loss token (False on
    padding). The query at p is scored when its chain starts at a real pair (p >= step) and every
    token the chain was fed, x[p-step+1..p+1], is a loss token, as at inference, where the drafted
    tokens are the reply's own -> [B, T] bool."""
    valid = scored
    for j in range(1, step + 1):
        valid = valid & F.pad(scored[:, :-j], (j, 0))  # scored[p - j], False before 0
    return valid


def eagle_loss(head: DraftHead, target: Transformer, batch: Batch, w_cls: float = 0.1, noise: float = 0.1,
               generator: torch.Generator | None = None, ttt_steps: int = 1, decay: float = 0.8,
               w_reg: float = 1.0, w_tv: float = 0.0) -> LossParts:
    """EAGLE-1/2's loss, unrolled over `ttt_steps` (training-time test, EAGLE-3).

    Pair p is (x[p+1], f[p]) at position p, for p = 0..T-2. Step 0 is the head on the real pairs
    (causal). Step s >= 1: the query at p takes as feature its chain's step s-1 output at p - 1
    (the chain that left real features at p - s; see attention.ChainMask), with the embedding of x[p+1] as
    usual. Every step predicts the feature after its input token, f[p+1], and is scored against
    it: SmoothL1 to f[p+1] and CE to the target's distribution softmax(LMHead(f[p+1])) over the
    head's vocabulary (the next token x[p+2]), and with w_tv > 0 the total variation
    0.5 * sum|p - q| between that distribution and the head's (one minus a sampled draft's
    acceptance, sum min(p, q)), each a mean over the step's scored positions
    (chain_valid), weighted decay^s and summed. ttt_steps=1 is the plain EAGLE-1/2 loss.
    Noise goes on the real input features only. `head` needs forward(embeds, features, positions,
    cache, mask) and lm_weight(target LM head) (it may be wrapped in DistributedDataParallel).
    """
    tok, feat = batch.tokens, batch.features.float()
    b, t = tok.shape
    n = t - 1  # pairs
    inp_feat = (feat if batch.inputs is None else batch.inputs.float())[:, :-1]
    if noise > 0:
        u = torch.rand(inp_feat.shape, generator=generator, device=inp_feat.device)
        inp_feat = inp_feat + (u * 2 - 1) * noise  # U(-noise, noise)
    pos = torch.arange(n, device=tok.device).expand(b, -1)
    with torch.no_grad():
        emb = target.embed(tok[:, 1:]).float()
    core = head.module if hasattr(head, "module") else head  # DDP wraps the head
    kv = TrainKV() if ttt_steps > 1 else None
    pred = head(emb, inp_feat, pos, kv)  # [B, n, H]: step 0, predicts f[p+1]
    sel = batch.loss_mask[:, 1:]  # [B, n]
    f_true = feat[:, 1:][sel]  # [M, H]
    m = int(sel.sum())
    if m == 0:
        zero = pred.sum() * 0.0
        return LossParts(zero, zero, zero, zero.detach(), 0, tv=zero.detach())
    w = core.lm_weight(target.lm_head.weight)  # [Vd, H] the head's LM head
    if core.kind == "eagle3":
        w_reg = 0.0  # its output is a hidden state of its own, not the target's feature
        t_w = target_vocab_weight(core, target)
    else:  # the target's frozen rows: converted once for every product below, not once per step
        t_w = w = w.to(product_dtype(w))
    t_prob, t_top = target_distribution(f_true, t_w)  # [M, Vd], [M]
    total, stats, valid = None, [], sel
    for s in range(ttt_steps):
        if s > 0:
            prev = F.pad(pred[:, :-1], (0, 0, 1, 0))  # [B, n, H]: query p gets its chain's output at p - 1
            valid = chain_valid(sel, s)
            if not bool(valid.any()):
                break  # later steps score even fewer positions
            pred = core.step(emb, prev, pos, kv, ChainMask(n, s))  # own outputs: no fc fusion
        # [Ms] step 0's rows this step still scores
        rows = None if s == 0 else valid[sel].nonzero().squeeze(1)
        p_hat = pred[valid]  # [Ms, H]
        reg = F.smooth_l1_loss(p_hat, f_true if rows is None else f_true[rows]) if w_reg else p_hat.new_zeros(())
        # CE to the target's distribution, and its total variation 1 - sum(min(p, q)): what a sampled
        # draft at this depth is rejected with, logged even when not trained on (w_tv = 0), so runs
        # with and without --w-tv compare on it
        out = readout_loss(core.readout(p_hat), w, t_prob, t_top, rows, w_cls, w_tv)
        term = w_reg * reg + out.loss
        total = term if s == 0 else total + decay ** s * term
        stats.append(torch.stack([reg.detach(), out.cls, out.acc, out.tv]))
    per_step = torch.stack(stats)  # [N', 4]
    return LossParts(total, per_step[0, 0], per_step[0, 1], per_step[0, 2], m, per_step, per_step[0, 3])


@torch.no_grad()
def target_distribution(f: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary and its argmax at features f [M, H],
    with w [Vd, H] its LM-head rows: ([M, Vd] fp32, [M] long), written one row chunk at a time
    into one buffer (see readout_loss: fresh [M, Vd] temporaries are slow to map on a CPU)."""
    m = f.shape[0]
    prob = torch.empty(m, w.shape[0], dtype=torch.float32, device=f.device)
    top = torch.empty(m, dtype=torch.long, device=f.device)
    for a in range(0, m, ROW_BUCKET):
        z = _rows_linear(f[a:a + ROW_BUCKET], w).float()  # [<= ROW_BUCKET, Vd]
        top[a:a + z.shape[0]] = z.argmax(-1)
        prob[a:a + z.shape[0]] = z.softmax(-1)
    return prob, top


def target_vocab_weight(head, target: Transformer) -> torch.Tensor:
    """The target's LM-head rows for the head's draft vocabulary, in the head's order: [Vd, H].
    EAGLE-1/2 heads score with exactly these rows; an EAGLE-3 head has an LM head of its own."""
    w = target.lm_head.weight
    if head.kind != "eagle3":
        return head.lm_weight(w)
    return w[head.to_target_ids(torch.arange(head.draft_vocab, device=w.device))]


def _rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, H] @ w.T -> [M, V] in product_dtype(w), with M padded up to a multiple of ROW_BUCKET:
    with a bf16 target, oneDNN caches a primitive (with a reordered copy of w) per distinct shape,
    and M differs at nearly every step, so unpadded shapes grew the process by about 8 MB per step
    (12 GiB peak)."""
    w = w.to(product_dtype(w))
    m = x.shape[0]
    return F.linear(F.pad(x.to(w.dtype), (0, 0, 0, (-m) % ROW_BUCKET)), w)[:m]


@dataclass
class ChainCounts:
    """Chain acceptance of one or more sequences, by depth n (the head's input holds n features it
    predicted itself): greedy top-1 hits, and for each draft sharpness s the summed acceptance of a
    draft sampled from q_s = softmax(s * logits / T), sum(min(p, q_s)) with p = softmax(target
    logits / T) over the whole vocabulary (only the draft vocabulary can be drafted)."""

    hits: list[int]  # [steps]
    totals: list[int]  # [steps] scored positions
    sampled: list[list[float]]  # [steps][len(scales)]

    def add(self, other: "ChainCounts") -> "ChainCounts":
        return ChainCounts([a + b for a, b in zip(self.hits, other.hits)],
                           [a + b for a, b in zip(self.totals, other.totals)],
                           [[a + b for a, b in zip(x, y)] for x, y in zip(self.sampled, other.sampled)])

    def alphas(self) -> list[float]:
        """Greedy n-alpha."""
        return [h / t if t else 0.0 for h, t in zip(self.hits, self.totals)]

    def sampled_alphas(self, j: int) -> list[float]:
        """Sampled acceptance by depth for scale j."""
        return [row[j] / t if t else 0.0 for row, t in zip(self.sampled, self.totals)]


@torch.no_grad()
def chain_accuracy(head: DraftHead, target: Transformer, tokens: torch.Tensor, features: torch.Tensor,
                   loss_mask: torch.Tensor, steps: int = 5, inputs: torch.Tensor | None = None,
                   scales: tuple[float, ...] = (), temperature: float = 1.0) -> ChainCounts:
    """n-alpha counts for one sequence, n = 0..steps-1. tokens [T], features [T, H] (the target's
    final ones), loss_mask [T], inputs [T, F] (the head's feature input when not `features`:
    EAGLE-3). scales: draft sharpness values whose sampled acceptance at `temperature` is summed
    too (ChainCounts.sampled)."""
    t = tokens.numel() - 1  # pairs (x[p+1], f[p]) for p = 0..t-1
    if t < 1:
        return ChainCounts([0] * steps, [0] * steps, [[0.0] * len(scales) for _ in range(steps)])
    dev = tokens.device
    emb = target.embed(tokens[1:])[None].to(head.fc.weight.dtype)  # [1, t, H]
    feats = features.to(head.fc.weight.dtype)
    # The target's logits at p + 1 (full vocabulary): [t, V]. The head may be fp32 beside a bf16
    # target, so the LM head is applied in the head's dtype.
    t_logits = F.linear(feats[1:], target.lm_head.weight.to(feats.dtype))
    want = t_logits.argmax(-1)  # [t] its top-1
    w_draft = head.lm_weight(target.lm_head.weight).to(feats.dtype)
    draft_ids = head.to_target_ids(torch.arange(w_draft.shape[0], device=dev))  # [Vd] target id of each row
    # p over the draft vocabulary's ids: [t, Vd] (tokens outside it are never drafted)
    p_draft = (t_logits.float() / temperature).softmax(-1)[:, draft_ids] if scales else None
    cache = KVCache(head.cache_layers, head.config.num_kv_heads, head.config.head_dim, t * steps, 1, emb.dtype, dev)
    pos = torch.arange(t, device=dev)[None]
    p = torch.arange(t, device=dev)
    counts = ChainCounts([], [], [])
    inp = feats if inputs is None else inputs.to(feats.dtype)
    out = head(emb, inp[:-1][None], pos, cache)  # step 0: real features, causal
    for n in range(steps):
        valid = loss_mask[1:] & (p >= n)
        logits = F.linear(head.readout(out[0]), w_draft)  # [t, Vd]
        counts.hits.append(int(((draft_ids[logits.argmax(-1)] == want) & valid).sum()))
        counts.totals.append(int(valid.sum()))
        if scales:
            lv, pv = logits[valid].float(), p_draft[valid]
            counts.sampled.append([float(torch.minimum(pv, (lv * (s / temperature)).softmax(-1)).sum())
                                   for s in scales])
        else:
            counts.sampled.append([])
        if n + 1 == steps:
            break
        # step n+1: query p takes its chain's previous output (at p - 1) as feature
        prev = torch.cat([out[0, :1] * 0, out[0, :-1]], 0)[None]
        out = head.step(emb, prev, pos, cache, ChainMask(t, n + 1))  # over cache.length + t keys
    return counts


def implied_tau(alphas: list[float]) -> float:
    """Chain acceptance length from n-alpha: 1 + a0 + a0*a1 + ... (bonus token included)."""
    tau, run = 1.0, 1.0
    for a in alphas:
        run *= a
        tau += run
    return tau
