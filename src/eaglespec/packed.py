"""bf16 linear layers with their weights packed once for oneDNN: `--quant none` on a CPU.

`F.linear` on bf16 CPU tensors hands oneDNN the plain [N, K] weight, and oneDNN reorders it into
its blocked (AVX512 / AMX) layout on every call. When a weight is read once per forward, as in
decoding, where the 135M default model streams 270 MB of weights a step, that reorder costs more
than the product: measured on a 2-core AMX Xeon, one thread, the default model's 121 products at
32 rows took 80 ms with `F.linear` and 58 ms with weights packed once (1.4x; 1.5x at 1 row, 1.1x
at 512). The product is the same oneDNN kernel on the same blocked weight: on that machine its
results were bit-identical to `F.linear` at 1 to 512 rows.

Used where `F.linear` would go to oneDNN anyway: a CPU in bf16 whose oneDNN takes bf16, and
inference only (the packed weight has no autograd; the target is frozen in training too).
Regeneration, the training feature dump and float checkpoints in bf16 (`--quant none`, or
`auto` on a safetensors checkpoint) run through it. fp32 is left alone: packing does not pay
there and would change the products the exact-mode tests rely on.
"""

from __future__ import annotations

import torch
from torch import nn

# Whether `none` mode packs its bf16 CPU linears (read when a model is loaded; for A/B scripts).
PACK_BF16 = True
ROWS_HINT = 32  # the row count oneDNN picks the blocking for; any row count runs


def packing_applies(weight: torch.Tensor) -> bool:
    """Whether `weight` would be packed: bf16 on a CPU, oneDNN with bf16 support."""
    mkldnn = torch.ops.mkldnn
    return (PACK_BF16 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T (+ b), W packed once into oneDNN's layout (an opaque tensor: no state_dict
    entry, no deepcopy, CPU only).

    keep_weight: keep the plain weight as `.weight` for code that reads it (the drafter reads the
    target's LM head; tied to the embedding, it costs nothing). Otherwise the plain weight goes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        self.weight = weight if keep_weight else None
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0:  # oneDNN refuses empty products
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, self.in_features).contiguous(), self.packed,
                                               self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace the bf16 CPU linears of `model` (a Transformer) by PackedLinear in place, the LM head
    keeping its weight; MoE routers stay plain. Returns how many were packed."""
    from .quant import layer_linears, set_submodule

    n = 0
    for path, lin in layer_linears(model):
        if packing_applies(lin.weight):
            set_submodule(model, path, PackedLinear(lin.weight, lin.bias))
            n += 1
    head = model.lm_head
    if isinstance(head, nn.Linear) and packing_applies(head.weight):
        model.lm_head = PackedLinear(head.weight, head.bias, keep_weight=True)
        n += 1
    return n
