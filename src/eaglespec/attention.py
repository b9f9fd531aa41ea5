"""Attention over the KV cache: which kernel scores which calls, and why.

Three kernels:
- `F.scaled_dot_product_attention` for long blocks of new tokens (prefill chunks, training),
  where its blocked flash kernel is fastest.
- for decode-shaped calls (one token, a draft tree, a few rows) in bf16 on a CPU, our C++ kernel
  (csrc/attention.cpp, built on first use by eaglespec.kernels): each (row, head, token) over its
  visible keys in slot order, one fixed sequence of float operations, so row-invariant by
  construction. A dozen torch ops cost ~10 us of dispatch each where the arithmetic of one query
  is about a microsecond; the kernel is 4-6x faster than `grouped_attention` at 128-1000 keys.
- `grouped_attention` for decode-shaped calls where the kernel cannot run (fp32, no compiler,
  `EAGLESPEC_KERNELS=0`): two plain matrix products per key/value head. On a CPU torch's flash
  kernel costs ~0.5 ms per call for a single query over 512 keys (its tiles are sized for long
  query blocks), 5x the two products: about 12 ms of a 30-layer decode step on the default model
  (measured, `scripts/forward_cost.py`).

`grouped_attention` is also what makes a tree node's output equal, bit for bit, to the same token
decoded alone (tests/test_row_invariance.py): the query heads sharing a key/value head are rows of
one product, a masked key contributes an exact 0 to every sum, and the products' kernels
accumulate each output along the keys in order, so neither the number of rows computed together
nor masked slots between a node's keys change its result. The flash kernel splits the keys into
blocks whose bounds depend on the call's shape, so it gives no such guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels

# Calls with at most this many new tokens per row take `grouped_attention` (trees and decode);
# longer ones (prefill chunks) take the flash kernel. A node's exactness needs the target's
# decode and verify calls on the same side of this bound: trees are far smaller.
DECODE_ROWS = 64


BLOCK = 64  # keys per block of the canonical reduction


@dataclass
class _Tail:
    """Where each node's gathered blocks come from and go to."""

    index: torch.Tensor  # [B, T, W] slot of the node's logical key at each place (Sp: a zero slot)
    rows: torch.Tensor  # [B, nkv, T, W] the same as rows of the values flattened to [B * nkv * (Sp + 1), hd]
    blocks: int  # nt = W / BLOCK


@dataclass
class _Plan:
    """What a mask means for the canonical reduction; built once per forward (every layer gets
    the same mask object) since it costs more small ops than the attention itself."""

    mask: torch.Tensor | None
    shape: tuple[int, int, int, int]  # (B, T, S, n_kv)
    hidden: torch.Tensor | None  # [B, 1, 1, T, S] True where a score is masked
    drop: torch.Tensor | None  # [B, 1, 1, T, Sp] True where a weight is not in the in-place products
    tail: _Tail | None


# Recent plans (a model with sliding-window layers alternates between two masks per forward).
_plans: list[_Plan] = []


def _leading_true(x: torch.Tensor) -> torch.Tensor:
    """[..., S] bool -> [...] count of leading True values."""
    return x.to(torch.int32).cumprod(-1).sum(-1)


def _plan(mask: torch.Tensor | None, b: int, t: int, s: int, n_kv: int, dev: torch.device) -> _Plan:
    for p in _plans:
        if p.mask is mask and p.shape == (b, t, s, n_kv):
            return p
    sp = -(-s // BLOCK) * BLOCK
    if mask is None:  # every query sees every key, in place: one-token decoding
        plan = _Plan(None, (b, t, s, n_kv), None, None, None)
    else:
        visible = (mask[None, None] if mask.dim() == 2 else mask)[:, 0].expand(b, t, s)  # [B, T, S]
        rank = visible.cumsum(-1) - 1  # [B, T, S] logical place of each visible slot
        slot = torch.arange(s, device=dev)
        in_place = _leading_true(visible & (rank == slot))  # [B, T] keys already at their logical slot
        length = visible.sum(-1)  # [B, T]
        # In place: all of a node's keys when they all are, else the whole blocks before the
        # first that is not.
        shared_end = torch.where(in_place == length, length, in_place // BLOCK * BLOCK)
        drop = torch.arange(sp, device=dev) >= shared_end[..., None]  # [B, T, Sp]
        width = int((length - shared_end).max())  # host int: this path is for CPUs
        tail = None
        if width > 0:
            nt = -(-width // BLOCK)
            w = nt * BLOCK
            gathered = visible & (rank >= shared_end[..., None])
            place = torch.where(gathered, rank - shared_end[..., None], w)  # place w: dropped below
            index = torch.full((b, t, w + 1), sp, dtype=torch.long, device=dev)
            index.scatter_(2, place, slot.expand(b, t, s))
            index = index[..., :w]
            heads = torch.arange(b * n_kv, device=dev).view(b, n_kv, 1, 1) * (sp + 1)
            tail = _Tail(index, heads + index[:, None], nt)
        plan = _Plan(mask, (b, t, s, n_kv), ~visible[:, None, None], drop[:, None, None], tail)
    _plans[:] = [plan] + _plans[:3]
    return plan


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with grouped key/value heads, reduced in a canonical order.

    q: [B, nh, T, hd]; k, v: [B, nkv, S, hd]; mask: bool broadcastable to [B, 1, T, S] (True = may
    attend) or None. Returns [B, nh, T, hd] in q's dtype.

    A query's keys, in their logical order (its visible slots in increasing slot order: the
    committed context, then its tree ancestors, then itself), are cut into blocks of BLOCK keys
    from the first. Each block's weighted sum of values is one product over exactly BLOCK keys
    (unused places hold zero weights at the block's end), and the blocks' sums are added in
    fp64. The partial sums are bf16 (8 significant bits), so fp64 adds them exactly, in any
    order, unless their magnitudes span more than about 2^40 (a block weighing 10^-12 of
    another); even then the difference lies in fp64's last bit, which survives the final rounding
    to bf16 with probability about 2^-44. The normaliser is the same kind of sum. A tree node
    whose keys are not all at their logical slots (the other nodes sit between its ancestors)
    gathers its last blocks into logical order; blocks wholly in the committed context are
    computed in place for all nodes.
    So a node computes the same products on the same operands as the one-token call for that
    position, whatever else is in the call. bf16 products are row-invariant on the CPUs we
    measured (tests/test_row_invariance.py checks it wherever the tests run); fp32's are not
    (its matrix kernels change with the row count), so fp32 exactness stays token-level.
    """
    b, nh, t, hd = q.shape
    nkv, s = k.shape[1], k.shape[2]
    g = nh // nkv
    plan = _plan(mask, b, t, s, nkv, q.device)
    blocks = -(-s // BLOCK)
    sp = blocks * BLOCK
    # [B, nkv, g*T, hd]: the g query heads of one key/value head become rows of one product
    # k is a strided view into the cache's capacity. q @ k^T would make torch copy it transposed
    # (5x slower than the products); (k @ q^T)^T reads it in place: one key's score is the same
    # 64-term dot product either way.
    scores = torch.matmul(k, q.reshape(b, nkv, g * t, hd).transpose(-1, -2)).transpose(-1, -2).float()  # [B, nkv, g*T, S]
    scores = scores.mul_(hd ** -0.5).view(b, nkv, g, t, s)
    if plan.hidden is not None:
        scores = scores.masked_fill_(plan.hidden, float("-inf"))
    # torch computes the last (numel mod vector width) elements of an elementwise op with its scalar
    # function, whose exp can differ in the last bit from the vector one: padding to whole blocks
    # leaves no such tail. The weights are unnormalised: the largest is exactly 1, masked ones 0.
    scores = F.pad(scores, (0, sp - s), value=float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True)).to(v.dtype)  # [B, nkv, g, T, Sp]
    # The normaliser: bf16 weights add exactly in fp64 in any order (see the docstring).
    total = weights.sum(-1, dtype=torch.float64)  # [B, nkv, g, T]
    in_place = weights if plan.drop is None else weights.masked_fill(plan.drop, 0)
    in_place = in_place.view(b, nkv, g * t, blocks, BLOCK).transpose(2, 3)  # [B, nkv, blocks, g*T, BLOCK]
    v_zero = v.new_empty(b, nkv, sp + 1, hd)  # [B, nkv, Sp + 1, hd]: zeros past the keys
    v_zero[:, :, :s] = v  # (3x faster than F.pad of the cache's strided view)
    v_zero[:, :, s:] = 0
    parts = torch.matmul(in_place, v_zero[:, :, :sp].view(b, nkv, blocks, BLOCK, hd))  # [B, nkv, blocks, g*T, hd]
    # The blocks' bf16 sums add exactly in fp64 too: neither their order nor where a node's
    # gathered blocks go matters.
    out = parts.sum(2, dtype=torch.float64).view(b, nkv, g, t, hd)
    tail = plan.tail
    if tail is not None:
        w = tail.blocks * BLOCK
        w_tail = torch.gather(F.pad(weights, (0, 1)), 4, tail.index[:, None, None].expand(b, nkv, g, t, w))
        w_tail = w_tail.view(b, nkv, g, t, tail.blocks, BLOCK).permute(0, 1, 3, 4, 2, 5)  # [B, nkv, T, nt, g, BLOCK]
        # rows of [B * nkv * (Sp + 1), hd]: index_select copies whole rows (advanced indexing is 5x slower)
        v_tail = v_zero.reshape(-1, hd).index_select(0, tail.rows.view(-1))
        v_tail = v_tail.view(b, nkv, t, tail.blocks, BLOCK, hd)
        tail_parts = torch.matmul(w_tail, v_tail)  # [B, nkv, T, nt, g, hd]
        out += tail_parts.sum(3, dtype=torch.float64).permute(0, 1, 3, 2, 4)
    return (out / total[..., None]).to(q.dtype).view(b, nh, t, hd)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The same attention without the canonical order: one product over all keys and torch's
    softmax. Faster for trees, not row-invariant; kept to measure what exactness costs."""
    b, nh, t, hd = q.shape
    nkv, s = k.shape[1], k.shape[2]
    g = nh // nkv
    scores = torch.matmul(q.reshape(b, nkv, g * t, hd), k.contiguous().transpose(-1, -2)).float().mul_(hd ** -0.5)
    scores = scores.view(b, nkv, g, t, s)
    if mask is not None:
        scores = scores.masked_fill_(~(mask[None, None] if mask.dim() == 2 else mask)[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, nkv, g * t, s)
    return torch.matmul(probs, v.contiguous()).view(b, nh, t, hd)


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """csrc/attention.cpp's decode attention (on AMX tiles where `kernels.attention_amx()`; shapes
    as `grouped_attention`), or None where it cannot take the call (not bf16, head_dim not a
    multiple of 16, kernel not built)."""
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or q.shape[-1] % 16 or k.stride(-1) != 1:
        return None
    mod = kernels.ops_kernel()
    if mod is None:
        return None
    b, _, t, hd = q.shape
    return mod.decode_attention(q, k, v, *kernel_attention_args(mask, b, t, k.shape[2], hd))


def kernel_attention_args(mask: torch.Tensor | None, b: int, t: int, s: int, head_dim: int
                          ) -> tuple[torch.Tensor | None, float, bool]:
    """The decode attention kernel's (mask [B, T, S] as a view, scale, amx) for a call of B x T
    queries over S keys, from a mask of [T, S] or [B, 1, T, S] (or None). Shared by
    `kernel_attention` and csrc/layer_stack.cpp's caller (direct.run_stack)."""
    if mask is not None:
        mask = (mask if mask.dim() == 2 else mask[:, 0]).expand(b, t, s)
    amx = head_dim % 32 == 0 and kernels.attention_amx()  # tiles where they fit (a head_dim fixes the path for good)
    return mask, head_dim ** -0.5, amx


# Which kernel decode-shaped calls take: "exact" (ours, else grouped_attention), "torch-exact"
# (grouped_attention), "plain" or "sdpa". Only tests and benchmark scripts change it.
DECODE_KERNEL = "exact"


def exact_attention_here() -> bool:
    """Whether the exact path's attention is row-invariant on this CPU: the package's decode kernel
    where it builds (row-invariant by construction), else `grouped_attention`, whose bf16 products
    are torch's: measured row-invariant on CPUs with AVX-512, but not on an AVX2-only EPYC, where
    a node's scores depend on its column in the product (tests/test_row_invariance.py)."""
    return kernels.ops_kernel() is not None or "avx512_f" in kernels.cpu_features()


# Queries per SDPA call of ChainMask.attend: 128 ran fastest at a stage's shapes (T = 511; at the
# third unrolled step 32, 64 and 256 were 38-54% slower), few enough calls that dispatch does not matter.
CHAIN_CHUNK = 128


@dataclass(frozen=True)
class ChainMask:
    """Unrolled step `step` >= 1 of T draft chains at once (training's training-time test and
    n-alpha). The keys are step 0's T real pairs, then one block of T per later step. Query p
    belongs to the chain that left real features at p - step: it sees the real pairs 0..p - step
    and, in each block m = 1..step, the single key p - step + m (its own chain's entry).

    The dense mask makes the flash kernel score all (step + 1) T keys per query, and almost all of
    them are masked. `attend` runs the queries by chunks of CHAIN_CHUNK instead, each over just the
    keys it can see: the real prefix up to the chunk's last visible pair, plus a CHAIN_CHUNK-wide
    slice of each block. Forward and backward ran 1.8-2.2x faster than the dense mask at a stage's
    shapes (B 8, T 511, 9 heads; scripts/chain_attention_cost.py), with the same result to rounding."""

    t: int
    step: int

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The pattern as a [T, (step + 1) T] bool mask (True = seen), the reference `attend` is
        tested against: SDPA over every key with it gives the same result, slower."""
        p = torch.arange(self.t, device=device)
        blocks = [p[None, :] <= (p - self.step)[:, None]]  # real pairs up to p - step
        blocks += [p[None, :] == (p - self.step + m)[:, None] for m in range(1, self.step + 1)]
        return torch.cat(blocks, 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, nh, T, hd], k/v [B, nkv, (step + 1) T, hd] -> [B, nh, T, hd]."""
        t, s = self.t, self.step
        if q.shape[2] != t or k.shape[2] != (s + 1) * t or s < 1:
            raise ValueError(f"ChainMask(t={t}, step={s}) needs {t} queries over {(s + 1) * t} keys "
                             f"and step >= 1, got {q.shape[2]} over {k.shape[2]}")
        dev, gqa = q.device, k.shape[1] != q.shape[1]
        outs = []
        for a in range(0, t, CHAIN_CHUNK):
            e = min(a + CHAIN_CHUNK, t)
            p = torch.arange(a, e, device=dev)[:, None]  # [C, 1] this chunk's queries
            ks, vs, sees = [], [], []  # the keys the chunk reads, and which of them each query sees
            if e - s > 0:  # real pairs 0..p - s
                ks.append(k[:, :, : e - s])
                vs.append(v[:, :, : e - s])
                sees.append(torch.arange(e - s, device=dev)[None] <= p - s)
            for m in range(1, s + 1):  # block m holds the key p - s + m at slot m * t + p - s + m
                lo, hi = max(a - s + m, 0), e - s + m
                if hi > lo:
                    ks.append(k[:, :, m * t + lo: m * t + hi])
                    vs.append(v[:, :, m * t + lo: m * t + hi])
                    sees.append(torch.arange(lo, hi, device=dev)[None] == p - s + m)
            outs.append(F.scaled_dot_product_attention(q[:, :, a:e], torch.cat(ks, 2), torch.cat(vs, 2),
                                                       attn_mask=torch.cat(sees, 1), enable_gqa=gqa))
        return torch.cat(outs, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | ChainMask | None,
           exact: bool = True) -> torch.Tensor:
    """Route one attention call (shapes as `grouped_attention`; mask [T, S] or [B, 1, T, S], or a
    ChainMask, which computes the attention itself).
    exact=False (draft heads): our kernel where it takes the call outside autograd (it is also the
    fastest at these sizes: 10-35 us against the flash kernel's ~90 for a drafting depth), else
    the flash kernel, as for long blocks; never the slow torch-op fallback of the exact path."""
    if isinstance(mask, ChainMask):
        return mask.attend(q, k, v)
    small_cpu = q.shape[2] <= DECODE_ROWS and q.device.type == "cpu"
    if small_cpu and DECODE_KERNEL == "exact" and (exact or not torch.is_grad_enabled()):
        out = kernel_attention(q, k, v, mask)
        if out is not None:
            return out
    if exact and small_cpu and DECODE_KERNEL != "sdpa":
        return (plain_attention if DECODE_KERNEL == "plain" else grouped_attention)(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
