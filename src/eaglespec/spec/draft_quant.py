"""Weight-only int8 for the draft head's products on a CPU.

Drafting is a chain of small products (4 rows per tree row at each depth) whose cost is reading the
weights: on the default CPU the head's layers and its 8,192-row LM head are read once per depth
(about 80 MB a step in bf16), from memory rather than cache because the target's forward in
between evicts them. Per-output-channel int8 halves those bytes, and torch's
`_weight_int8pack_mm` turns that into about 2x faster drafting (10.6 -> 5.0 ms a step, measured).

The draft only proposes: every token is still verified by the target, so output is unchanged;
only which tokens are proposed can move at near-ties. The int8 kernel is used for every product,
however many rows: it is row-invariant (a row's result does not depend on the others), so a
request drafts the same tree alone or in a batch, which keeps seeded sampling batch-invariant.
Switching kernels by row count would break that. Where AMX tiles run, the products take 16-bit
activations (the W8A16 kernel: a row's result is again one exact integer sum), and larger trees
and batches draft cheaply (`scripts/draft_acts_ab.py`, the (8, 3, 4) tree: about the same alone,
3.3-3.6 ms a step; in batches of 4, 6.4-7.2 -> 4.6-5.1 ms a request-step). Elsewhere the W8A8 VNNI kernel runs, and
above about 12 rows (batches of 3-4 and more) the bf16 kernel would draft faster (measured: 16
rows 1.3 vs 1.7 ms for the 8,192-row LM head, 64 rows 2.2 vs 5.6 ms); `Engine(draft_int8=False)`
is the switch for large batches there.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..draft import Head
from ..quant import Int8Linear, int8_fits


def _acts(in_features: int) -> str:
    """The int8 products' activations: 16-bit (the W8A16 kernel) where it runs on AMX tiles and
    the width fits its 64-wide blocks, else 8-bit (the W8A8 VNNI kernel). On tiles a product of
    16 rows costs about what 4 do, so larger trees and batches draft cheaply (measured, 16 rows:
    gate/up 63 against 188 us, the LM head 312 against 463; 4 rows: within 15%)."""
    from ..kernels import amx_tiles

    return "a16" if in_features % 64 == 0 and amx_tiles() else "a8"


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Int8Linear where the kernel fits the shape, else the plain float product."""
    if int8_fits(weight.shape[1]):
        return Int8Linear(weight, bias, keep_weight=True, acts=_acts(weight.shape[1]))
    return lambda x: F.linear(x, weight, bias)


def _swap(module: nn.Module, names: list[str]) -> nn.Module:
    """A shallow copy of `module` with the named Linear children replaced by Int8Linear."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    for name in names:
        lin = module._modules[name]
        if int8_fits(lin.in_features):
            out._modules[name] = Int8Linear(lin.weight, lin.bias, keep_weight=True, acts=_acts(lin.in_features))
    return out


def int8_head(head: Head) -> Head:
    """The head with int8 products, sharing every original tensor (the head itself is untouched)."""
    def swap_layer(lay: nn.Module) -> nn.Module:
        out = _swap(lay, [])
        out._modules["attn"] = _swap(lay.attn, ["wqkv", "wo"])
        out._modules["mlp"] = _swap(lay.mlp, ["w_gate_up", "w_down"])
        return out

    out = _swap(head, ["fc"])
    out._modules["layer"] = swap_layer(head.layer)
    if "more" in head._modules:  # an EAGLE-1/2 head's layers 1..
        out._modules["more"] = nn.ModuleList(swap_layer(lay) for lay in head.more)
    return out


def int8_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Where int8 drafting pays: a CPU with a bf16 head. With fp32 activations torch's kernel is
    several times slower than the float product (measured: 15.5 vs 3.2 ms, 4 x 576 by 8,192)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and hasattr(torch, "_weight_int8pack_mm")
