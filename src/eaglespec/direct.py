"""A decoder layer's inference path on a CPU that calls csrc's kernels directly.

Owns: `DirectLayer`, the plan of one `model.DecoderLayer` whose every piece would take the package's
bf16 CPU kernels anyway (RMSNorm, the fused q/k/v split + RoPE + cache write, decode attention,
silu_mul, int4 / int8 products), and `direct_product`, a linear module's product as one call.

Why: on a 2-core CPU a SmolLM2 decode step spent about 30% of its time outside the kernels, in
module calls, the routing checks each module repeats and the reshapes around them (measured with
`scripts/step_breakdown.py`: 18.7 ms of target forward, 13.2 ms of it in kernels). The plan
decides once what each module would decide per call, and a layer runs as ten kernel calls.

The same kernels get the same inputs, so the bits are the module path's (tests/test_direct.py
compares logits and caches for decodes and trees). Anything the plan does not cover (training,
fp32, other families' switches, biases, a kernel that did not build, a KV cache without the fused
write, a block of rows beyond the decode attention's) takes the module path, decided per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import attention, kernels

Product = Callable[[torch.Tensor], torch.Tensor]  # [M, K] contiguous -> [M, N]


def direct_product(linear: nn.Module) -> Product | None:
    """The product of an int4 / int8 linear module as one kernel call, or None where it does not
    run a package kernel or has a bias (the module path keeps those)."""
    from .quant import Int4Linear, Int8Linear

    if getattr(linear, "bias", None) is not None:
        return None
    if isinstance(linear, Int4Linear) and linear.kernel == "vnni":
        gemm, codes, params = linear._vnni.int4_gemm, linear.codes, linear.params
        return lambda x: gemm(x, codes, params)
    if isinstance(linear, Int8Linear) and linear.kernel == "vnni":
        gemm, codes, scales = linear._vnni.int8_gemm, linear.codes, linear.wscale
        return lambda x: gemm(x, codes, scales)
    if isinstance(linear, Int8Linear) and linear.kernel == "a16":
        gemm_a16, codes, scales, amx = linear._vnni.int8_a16_gemm, linear.codes, linear.wscale, linear.amx
        return lambda x: gemm_a16(x, codes, scales, amx)
    return None


Parts = tuple[int, torch.Tensor, torch.Tensor]  # (kernel address, its two weight tensors)


def product_parts(linear: nn.Module, with_bias: bool = False) -> Parts | None:
    """An int4 / W8A8 linear's product as csrc/layer_stack.cpp calls it: the kernel's address in
    its extension module and the packed weight's two tensors; None for other products (W8A16,
    whose kernel takes a fourth argument, keeps the per-layer path). with_bias: also for a linear
    with a bias (the caller adds it); else None for those."""
    from .quant import Int4Linear, Int8Linear

    if (getattr(linear, "bias", None) is not None and not with_bias) or getattr(linear, "kernel", None) != "vnni":
        return None
    if isinstance(linear, Int4Linear) and hasattr(linear._vnni, "int4_gemm_address"):
        return linear._vnni.int4_gemm_address(), linear.codes, linear.params
    if isinstance(linear, Int8Linear) and hasattr(linear._vnni, "int8_gemm_address"):
        return linear._vnni.int8_gemm_address(), linear.codes, linear.wscale
    return None


@dataclass(frozen=True)
class DirectLayer:
    """What one decoder layer's direct path reads."""

    attn_norm: torch.Tensor | None = field(repr=False)  # [H] (None: the EAGLE-1/2 draft layer has no input norm)
    mlp_norm: torch.Tensor = field(repr=False)  # [H]
    eps: float
    qkv: Product = field(repr=False)
    out: Product = field(repr=False)
    gate_up: Product = field(repr=False)
    down: Product = field(repr=False)
    n_heads: int
    n_kv: int
    head_dim: int
    parts: tuple[Parts, Parts, Parts, Parts] | None = field(default=None, repr=False)  # for `layer_stack`

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int,
            mask: torch.Tensor | None) -> torch.Tensor | None:
        """x [B, T, H] -> the layer's output [B, T, H], or None (nothing written) where this call's
        cache or shapes fall outside the plan."""
        b, t, h = x.shape
        if t > attention.DECODE_ROWS or attention.DECODE_KERNEL != "exact" or isinstance(mask, attention.ChainMask):
            return None
        write = getattr(cache, "write_rotated", None)
        ops = kernels.ops_kernel()
        if write is None or ops is None:
            return None
        rows = b * t
        x = x.reshape(rows, h)  # the residual stream as rows: no reshapes around each product
        normed = x if self.attn_norm is None else ops.rms_norm(x, self.attn_norm, self.eps)
        qkv = self.qkv(normed)  # [B*T, (nh + 2 nkv) hd]
        fused = write(layer, qkv.view(b, t, -1), cos, sin, self.n_heads, self.n_kv)
        if fused is None:
            return None  # (the cache declined before writing anything)
        q, k, v = fused  # [B, nh, T, hd], [B, nkv, S, hd] x 2
        y = attention.kernel_attention(q, k, v, mask)  # takes every call the fused write took (bf16, hd % 32)
        x = x + self.out(y.transpose(1, 2).reshape(rows, self.n_heads * self.head_dim))  # y: [B, nh, T, hd]
        x = x + self.down(ops.silu_mul(self.gate_up(ops.rms_norm(x, self.mlp_norm, self.eps))))
        return x.view(b, t, h)


def plan_layer(layer: nn.Module) -> DirectLayer | None:
    """The direct plan of a `model.DecoderLayer`, or None where a piece would not take the kernels
    (the layer then always runs its modules)."""
    from .model import MLP, RMSNorm

    attn, mlp = layer.attn, layer.mlp
    norm_in = layer.attn_norm
    if not isinstance(mlp, MLP) or mlp.act is not F.silu or mlp.inter % 16:
        return None  # MoE, GeGLU
    if attn.q_norm is not None or attn.q_scale != 1.0 or attn.hd % 32:
        return None  # q/k norms, Gemma's query scale; the fused RoPE write wants whole 32-wide halves
    if not isinstance(layer.post_attn_norm, nn.Identity) or not isinstance(layer.post_mlp_norm, nn.Identity):
        return None  # sandwich norms
    norms = [layer.mlp_norm] + ([] if isinstance(norm_in, nn.Identity) else [norm_in])
    if not all(isinstance(n, RMSNorm) and n.weight.dtype == torch.bfloat16 and n.eps == layer.mlp_norm.eps
               for n in norms) or layer.mlp_norm.weight.shape[0] % 16:
        return None
    linears = (attn.wqkv, attn.wo, mlp.w_gate_up, mlp.w_down)
    products = [direct_product(m) for m in linears]
    if any(p is None for p in products):
        return None
    parts = tuple(product_parts(m) for m in linears)
    return DirectLayer(
        attn_norm=None if isinstance(norm_in, nn.Identity) else norm_in.weight,
        mlp_norm=layer.mlp_norm.weight, eps=layer.mlp_norm.eps,
        qkv=products[0], out=products[1], gate_up=products[2], down=products[3],
        n_heads=attn.n_heads, n_kv=attn.n_kv, head_dim=attn.hd,
        parts=None if any(p is None for p in parts) else parts)


def layer_stack(plans: list[DirectLayer | None]):
    """The layers' plans as one csrc/layer_stack.cpp `LayerStack` (all of them run in one call), or
    None where a layer has no plan or a product the stack cannot call, or the kernel is missing."""
    ops = kernels.ops_kernel()
    if ops is None or not hasattr(ops, "LayerStack") or any(p is None or p.parts is None for p in plans):
        return None
    stack = ops.LayerStack()
    for p in plans:
        (qf, qa, qb), (of, oa, ob), (gf, ga, gb), (df, da, db) = p.parts
        stack.add(p.attn_norm, p.mlp_norm, p.eps, qf, qa, qb, of, oa, ob, gf, ga, gb, df, da, db, p.n_heads, p.n_kv)
    return stack


def run_stack(stack, plans: list[DirectLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
              mask: torch.Tensor | None, hidden_layers: tuple[int, ...] = ()
              ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """Every layer of `stack` over x [B, T, H] in one call (hidden states entering `hidden_layers`
    kept, as the layer loop keeps them), or None, before anything is written, where a layer's
    `DirectLayer.run` would decline: the same conditions, checked once for all layers.
    mask: [T, S], [B, 1, T, S] or None, shared by every layer."""
    b, t, h = x.shape
    if t > attention.DECODE_ROWS or attention.DECODE_KERNEL != "exact":
        return None
    views = getattr(cache, "stack_views", None)
    hd = plans[0].head_dim
    got = None if views is None else views(cos, hd)
    if got is None:
        return None
    k, v, slots, view = got
    mask, scale, amx = attention.kernel_attention_args(mask, b, t, view, hd)
    rows = x.reshape(b * t, h)
    hidden: dict[int, torch.Tensor] = {}
    first = 0
    for stop in sorted(i for i in hidden_layers if 0 <= i < len(plans)) + [len(plans)]:
        rows = stack.run(rows, b, t, cos, sin, k, v, slots, view, mask, scale, amx, first, stop)
        if stop < len(plans):
            hidden[stop] = rows.view(b, t, h)
        first = stop
    return rows.view(b, t, h), hidden


def layer_modules(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The submodules a plan depends on, by identity (a layer whose modules were swapped is planned
    again)."""
    attn, mlp = layer._modules["attn"], layer._modules["mlp"]
    return (attn, mlp, layer._modules["attn_norm"], layer._modules["mlp_norm"],
            attn._modules["wqkv"], attn._modules["wo"], mlp._modules.get("w_gate_up"), mlp._modules.get("w_down"))


# Whether decoder layers take the direct path where it applies (A/B scripts and the per-module
# timings of scripts/step_breakdown.py turn it off), and whether a model whose layers all have a
# plan runs them as one `layer_stack` call (tests of the per-layer path and A/B scripts turn it off).
DIRECT = True
STACK = True
