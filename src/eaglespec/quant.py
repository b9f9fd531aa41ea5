"""Quantised linear layers for the target on a CPU: the `--quant` modes and their kernels.

Decoding a small model on a CPU is bound by reading its weights (270 MB a token in bf16 for the
default model). The modes:
- `int4`: 4-bit weights in groups of 32 along the input, w = (q - 8) * scale + zero, run by the
  package's W4A8 kernel (csrc/int4_gemm.cpp: activations int8 per group of 32, integer products
  with AVX512-VNNI, or AVX2 with the same bits) where it builds, else torch's
  `_weight_int4pack_mm_for_cpu`. A GGUF's Q4_0 / Q4_1 blocks are repacked as they are (Q4_1's
  w = d * q + m is scale d, zero m + 8d; Q4_0's w = d * (q - 8) is zero 0); float checkpoints are
  quantised on load (asymmetric min/max per group).
- `int8`: per-output-row symmetric int8, run by the package's W8A8 kernel (csrc/int8_gemm.cpp)
  where it builds, else `_weight_int8pack_mm`.
- `int8a16`: the same int8 weights, with each activation row rounded to 16-bit integers under one
  scale (csrc/int8_a16_gemm.cpp). A row's product is then one exact integer sum, which AMX tiles
  compute for up to 16 rows at about the cost of one: a verified tree costs little more than a
  decode. On CPUs without AMX the same numbers run on VNNI (slower than `int8` from a few rows).
  Output quality: top-1 agreement with the fp32 model 0.964 (int4 0.968, int8 0.952; README).
- `none`: the float weights in the model's dtype (in bf16 on a CPU packed once for oneDNN:
  packed.py).
- `auto`: keep a GGUF's 4-bit (int4) or 8-bit (int8; `int8a16` on a CPU with AMX-INT8) linears
  quantised; float checkpoints stay float. Only on a CPU in bf16: the kernels' fp32 paths are
  many times slower than a float matmul (measured 90-190 ms for what bf16 does in 7-29 ms), and
  their CUDA packing differs.

All these kernels are row-invariant (a row's output does not depend on the other rows computed
with it; tests/test_row_invariance.py), which is what lets a verified tree reproduce plain
decoding bit for bit. torch's cost grows with the rows (its kernels unpack the weights again for
every 4 rows); the W4A8 kernel reads each weight block once for 8 rows; `scripts/forward_cost.py`
and `scripts/int4_kernel_bench.py` print the tables.

The LM head (the tied embedding: 21% of the default model's weights) becomes per-row int8 in the
int4 and int8 modes: 4-bit output embeddings lose too much (llama.cpp keeps them 8-bit too); the
GGUF's Q8_0 groups of 32 become one scale per row, so those logits differ slightly from the file's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

QUANT_MODES = ("auto", "none", "int8", "int4", "int8a16")
INT_MODES = ("int4", "int8", "int8a16")  # the row-invariant integer modes
GROUP = 32  # weights per scale in the int4 layout (a GGUF block)
# Which kernels new Int4Linear / Int8Linear layers use: "vnni" (the package's W4A8 / W8A8 kernel
# where it builds and the shape fits, else torch's) or "torch". Read when a layer is built; for
# benchmarks and tests.
INT4_KERNEL = "vnni"
INT8_KERNEL = "vnni"


class QuantError(ValueError):
    """A quant mode that cannot run here; the message says what would."""


def int4_fits(out_features: int, in_features: int) -> bool:
    """Shapes torch's int4 CPU packing takes: input width a multiple of 64 (2 K-tiles of a group
    of 32 nibbles), output width a multiple of 16 (torch 2.13 refuses others). Every such shape
    also fits the VNNI kernel (kernels.kernel_fits)."""
    return in_features % 64 == 0 and out_features % 16 == 0


def int8_fits(in_features: int) -> bool:
    """torch 2.13's bf16 int8 kernel crashes (SIGSEGV) when the input width is not a multiple of 16."""
    return in_features % 16 == 0


@dataclass
class Int4Weights:
    """A [N, K] weight as 4-bit codes and per-group affine parameters: w = (q - 8) * scale + zero.

    q: int32 [N, K] in 0..15; scale, zero: fp32 [N, K // GROUP]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float weights these codes stand for, [N, K] fp32."""
        s = self.scale.repeat_interleave(GROUP, dim=1)
        z = self.zero.repeat_interleave(GROUP, dim=1)
        return (self.q - 8).float() * s + z


def int4_from_gguf_blocks(blocks: torch.Tensor, kind: str) -> Int4Weights:
    """Unpack GGUF Q4_0 / Q4_1 blocks ([N, K // 32, bytes] uint8) without requantising.

    A block is fp16 d (Q4_1: then fp16 m) and 16 bytes of nibbles: byte j holds element j in its
    low nibble and element j + 16 in its high one."""
    header = {"Q4_0": 2, "Q4_1": 4}[kind]
    n, groups, size = blocks.shape
    raw = blocks.numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
    d = torch.from_numpy(np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))
    nib = torch.from_numpy(np.ascontiguousarray(raw[..., header:size])).to(torch.int32)  # [N, G, 16]
    q = torch.cat([nib & 0xF, nib >> 4], dim=-1).reshape(n, groups * GROUP)
    if kind == "Q4_1":
        m = torch.from_numpy(np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
        zero = m + 8 * d  # exact in fp32: both are fp16 values
    else:
        zero = torch.zeros_like(d)
    return Int4Weights(q=q.contiguous(), scale=d, zero=zero)


def int4_from_float(weight: torch.Tensor) -> Int4Weights:
    """Asymmetric min/max quantisation per group of 32 input weights (float checkpoints)."""
    w = weight.detach().float()
    n, k = w.shape
    wg = w.view(n, k // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return Int4Weights(q=q, scale=scale, zero=lo + 8 * scale)


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W as `Int4Weights`, packed for one of two kernels (`self.kernel`):
    - "vnni" (eaglespec.kernels, bf16 only, N % 16 == 0, K % 32 == 0): activations rounded to int8
      per row per group of 32 (relative error up to 2^-8 of the group's largest), scale and zero
      as fp16 (exact for GGUF blocks; `kernels.int4_kernel_params`), products in fp32;
    - "torch" (`_weight_int4pack_mm_for_cpu`): bf16 activations, scale and zero rounded to bf16
      (relative 2^-9 per group).

    kernel: "vnni" or "torch"; None reads `INT4_KERNEL`. "vnni" falls back to "torch" where the
    package's kernel cannot run (see `kernels.int4_kernel`) or the shape does not fit."""

    def __init__(self, w: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernel: str | None = None) -> None:
        super().__init__()
        from eaglespec import kernels

        self.out_features, self.in_features = w.q.shape
        self.bias = bias
        self._vnni = None
        if ((kernel or INT4_KERNEL) == "vnni" and dtype == torch.bfloat16
                and kernels.kernel_fits(self.out_features, self.in_features)):
            self._vnni = kernels.int4_kernel()
        self.kernel = "torch" if self._vnni is None else "vnni"
        if self._vnni is not None:
            self.codes, self.params = kernels.pack_int4(w.q, w.scale, w.zero)
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q, 2)
        # [K // GROUP, N, 2]: the kernel's layout of (scale, zero)
        self.scale_zero = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self._vnni is not None:
            y = self._vnni.int4_gemm(x.reshape(rows, self.in_features).contiguous(), self.codes, self.params)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(rows, self.in_features), self.packed, GROUP,
                                                           self.scale_zero)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_rows_int8(weight: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scales [N]): symmetric, per output row. `rows` rows at a
    time: the fp32 intermediates of a whole 49,152-row LM head would take ~450 MB at once."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=torch.float32)
    for a in range(0, weight.shape[0], rows):
        w = weight[a:a + rows].detach().float()
        s = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q[a:a + rows] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)  # w may be the weight itself
        scales[a:a + rows] = s
    return q.to(weight.device), scales.to(weight.device)


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W as per-row symmetric int8, run by one of three kernels (`self.kernel`):
    - "vnni" (eaglespec.kernels, bf16 only, N % 16 == 0, K % 32 == 0): activations rounded to int8
      per row per group of 32, integer products, row scales in fp32;
    - "a16" (`acts="a16"`, K % 64 == 0 too): activations rounded to 16-bit integers per row,
      integer products on AMX tiles or VNNI (`self.amx`), the same bits either way;
    - "torch" (`_weight_int8pack_mm`): bf16 activations, row scales rounded to bf16.

    keep_weight: keep a reference to the float weight as `.weight` for code that reads it (the
    drafter reads the target's LM head; a tied head shares the embedding, so it costs nothing).
    kernel: "vnni" or "torch"; None reads `INT8_KERNEL` ("vnni" falls back as in Int4Linear).
    acts: "a8" (the "vnni" kernel) or "a16"."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False,
                 kernel: str | None = None, acts: str = "a8") -> None:
        super().__init__()
        from eaglespec import kernels

        self.out_features, self.in_features = weight.shape
        q, scales = quantize_rows_int8(weight)
        self._vnni, self.amx = None, False
        a16 = acts == "a16"
        if ((kernel or INT8_KERNEL) == "vnni" and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and kernels.kernel_fits(self.out_features, self.in_features, a16=a16)):
            self._vnni = kernels.int8_a16_kernel() if a16 else kernels.int8_kernel()
            self.amx = a16 and self._vnni is not None and kernels.amx_tiles()
        self.kernel = "torch" if self._vnni is None else "a16" if a16 else "vnni"
        if self._vnni is not None:
            self.codes, self.wscale = kernels.pack_int8(q, scales)
        else:
            self.q, self.scales = q, scales.to(weight.dtype)
        self.weight = weight if keep_weight else None
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).contiguous()
        if self.kernel == "a16":
            y = self._vnni.int8_a16_gemm(x2, self.codes, self.wscale, self.amx)
        elif self._vnni is not None:
            y = self._vnni.int8_gemm(x2, self.codes, self.wscale)
        else:
            y = torch._weight_int8pack_mm(x2, self.q, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def check_quant(mode: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """Refuse a mode that cannot run on this device / dtype, naming what would."""
    if mode not in QUANT_MODES:
        raise QuantError(f"--quant must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    if mode in INT_MODES and (torch.device(device).type != "cpu" or dtype != torch.bfloat16):
        raise QuantError(f"--quant {mode} runs on a CPU in bf16 (got {torch.device(device).type}, "
                         f"{str(dtype).removeprefix('torch.')}); use --quant none there")


def resolve_quant(mode: str, device: torch.device | str, dtype: torch.dtype, gguf_kind: str | None,
                  amx: bool | None = None) -> str:
    """`auto` -> a concrete mode. gguf_kind: the GGUF linears' block type (e.g. 'Q4_1'), None for
    float checkpoints. amx: whether the W8A16 kernel runs on AMX tiles here (None: ask
    kernels.amx_tiles). An 8-bit GGUF gets `int8a16` there: as fast as `int8` for a decode, much
    cheaper for a tree, and closer to the float model (README, "int8a16")."""
    check_quant(mode, device, dtype)
    if mode != "auto":
        return mode
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or gguf_kind is None:
        return "none"
    if gguf_kind in ("Q4_0", "Q4_1"):
        return "int4"
    if gguf_kind == "Q8_0":
        if amx is None:
            from . import kernels

            amx = kernels.amx_tiles()
        return "int8a16" if amx else "int8"
    return "none"


def set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def layer_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(module path, layer) for the decoder layers' nn.Linear products that a mode may replace;
    MoE routers stay float."""
    return [(f"layers.{name}", m) for name, m in model.layers.named_modules()
            if isinstance(m, nn.Linear) and not name.endswith("router")]


def quantize_model(model: nn.Module, mode: str,
                   int4_weights: dict[str, Int4Weights | Callable[[], Int4Weights]] | None = None) -> nn.Module:
    """Replace the target's linear layers (and LM head) in place for `mode` ('none', 'int8', 'int4',
    'int8a16').

    int4_weights: module path -> codes taken from the checkpoint as they are (a GGUF's blocks), or
    a function that unpacks them when their layer's turn comes (entries are removed as they are
    used, so their blocks can go);
    other linears in int4 mode are quantised from their float weights. Shapes the kernels cannot
    take stay float (tiny test models), and greedy_exact then withdraws its claim."""
    model.quant = mode
    if mode == "none":
        from .packed import pack_linears

        pack_linears(model)  # bf16 on a CPU: weights packed once for oneDNN (packed.py)
        return model
    dtype = model.dtype
    acts = "a16" if mode == "int8a16" else "a8"  # the int8 products' activations (Int8Linear)
    for path, lin in layer_linears(model):
        given = (int4_weights or {}).pop(path, None)  # popped: its blocks go once packed
        if mode == "int4" and (given is not None or int4_fits(lin.out_features, lin.in_features)):
            w = int4_from_float(lin.weight) if given is None else given() if callable(given) else given
            set_submodule(model, path, Int4Linear(w, lin.bias, dtype))
        elif int8_fits(lin.in_features) and lin.weight.device.type != "meta":
            set_submodule(model, path, Int8Linear(lin.weight, lin.bias, acts=acts))
    head = model.lm_head
    if int8_fits(head.in_features) and head.weight.device.type != "meta":
        # The tied embedding keeps its float table for lookups; only the product reads int8.
        model.lm_head = Int8Linear(head.weight, head.bias, keep_weight=True, acts=acts)
    return model


def greedy_exact(model: nn.Module) -> bool:
    """Whether greedy speculative output is guaranteed token-identical to vanilla for this target:
    fp32 (tested since the first release), or a CPU target whose linears all run the row-invariant
    int4 / int8 / int8a16 kernels (with the row-invariant decode attention, for trees up to
    attention.DECODE_ROWS nodes). bf16 `none` is not: oneDNN's bf16 product changes its blocking
    above ~14 rows for some shapes (measured: the 1536-wide down projection), so a large tree can
    round a near-tie apart."""
    if model.dtype == torch.float32:
        return True
    if model.device.type != "cpu" or getattr(model, "quant", "none") not in INT_MODES:
        return False
    # A linear the kernels could not take (an odd width, an MoE router) stays a float nn.Linear,
    # whose product is not row-invariant: then the guarantee does not hold. Nor does it where the
    # attention falls back to torch's products on a CPU where those are not row-invariant.
    from .attention import exact_attention_here

    return not any(isinstance(m, nn.Linear) for m in model.modules()) and exact_attention_here()
