"""The W8A16 kernel (csrc/int8_a16_gemm.cpp, the `int8a16` mode): its VNNI and AMX paths are each
bitwise equal to a torch reference of the same operations (so to each other), row-invariant across
the AMX path's 16-row blocks and the VNNI path's 6-row blocks, close to the float product; and the
mode's wiring (Int8Linear, the AMX switch, the fallback)."""

from __future__ import annotations

import pytest
import torch

from eaglespec import kernels, quant
from eaglespec.quant import Int8Linear, quantize_rows_int8

WHY = "cannot run here (no AVX512-VNNI, no compiler, or EAGLESPEC_KERNELS=0)"
needs_kernel = pytest.mark.skipif(kernels.int8_a16_kernel() is None, reason="the W8A16 kernel " + WHY)
PATHS = ["vnni", pytest.param("amx", marks=pytest.mark.skipif(not kernels.amx_tiles(), reason="no AMX-INT8 here"))]

# The default model's linear shapes (out, in): fused qkv, o, fused gate_up, down; and tiny ones.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (16, 64), (48, 128)]
MAX_V = 32639  # 127 * 256 + 127


def reference(x: torch.Tensor, q: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: x bf16 [M, K], q int8 [N, K], wscale f32 [N] -> bf16 [M, N].
    Each fp32 operation is one IEEE-rounded elementwise op in the kernel's order."""
    xf = x.float()
    s = xf.abs().amax(-1) / MAX_V  # [M]
    inv = torch.where(s != 0, 1 / s, torch.zeros_like(s))
    v = (xf * inv[:, None]).round().clamp(-MAX_V, MAX_V).to(torch.int64)  # half to even
    h = torch.div(v + 128, 256, rounding_mode="floor")
    low = v - 256 * h
    assert h.abs().max() <= 127 and low.min() >= -128 and low.max() <= 127
    sh = (h.double() @ q.double().t()).to(torch.int64)  # exact: |sum| < 2^53
    sl = (low.double() @ q.double().t()).to(torch.int64)
    t = sh.to(torch.int32).float() * 256 + sl.to(torch.int32).float()
    return ((t * s[:, None]) * wscale[None]).bfloat16()


def int8_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.05).bfloat16()


def run(x: torch.Tensor, w: torch.Tensor, path: str) -> torch.Tensor:
    q, scales = quantize_rows_int8(w)
    codes, wscale = kernels.pack_int8(q, scales)
    return kernels.int8_a16_kernel().int8_a16_gemm(x.contiguous(), codes, wscale, path == "amx")


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_reference_bitwise(shape, path):
    w = int8_weight(shape, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(21, shape[1], generator=g) * 2
    x[3] = 0  # a zero row: scale 0, outputs 0
    x[4, 5] = 300.0  # an outlier: the rest of its row keeps 16-bit resolution
    x = x.bfloat16()
    q, scales = quantize_rows_int8(w)
    assert torch.equal(run(x, w, path), reference(x, q, scales.float()))


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
def test_rows_are_invariant_across_blocks(path):
    """A row's output alone equals it among 2..40 rows, from any starting row (AMX blocks of 16,
    VNNI blocks of 6, threads split outputs only)."""
    w = int8_weight((576, 1536), 2)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([run(x[i:i + 1], w, path) for i in range(40)])
    for start, m in ((0, 2), (0, 16), (0, 17), (3, 33), (0, 40), (7, 6), (1, 32)):
        assert torch.equal(run(x[start:start + m], w, path), alone[start:start + m]), f"{m} rows from {start}"


@needs_kernel
def test_amx_and_vnni_paths_agree_on_the_lm_head():
    if not kernels.amx_tiles():
        pytest.skip("no AMX-INT8 here")
    w = int8_weight((49152, 576), 4)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(run(x, w, "amx"), run(x, w, "vnni"))


@needs_kernel
def test_close_to_the_float_product():
    """Against x @ W^T in fp64: the int8 weights (under 0.4% of a row's largest) dominate; 16-bit
    activations add about 1e-5; 2% of the output's scale bounds it."""
    w = int8_weight((576, 1536), 6)
    bias = torch.randn(576).bfloat16()
    x = torch.randn(8, 1536).bfloat16()
    ref = x.double() @ w.double().t() + bias.double()
    lin = Int8Linear(w, bias, acts="a16")
    assert lin.kernel == "a16" and lin.amx == kernels.amx_tiles()
    assert (lin(x).double() - ref).abs().max() < 0.02 * ref.abs().max()


def test_amx_switch_and_shapes(monkeypatch):
    """EAGLESPEC_AMX=0 keeps the VNNI path; a width that is not whole 64-input blocks, or the
    torch switch, runs torch's int8 product."""
    monkeypatch.setenv("EAGLESPEC_AMX", "0")
    assert not kernels.amx_tiles()
    assert not Int8Linear(int8_weight((64, 128), 7), None, acts="a16").amx
    assert kernels.kernel_fits(64, 96) and not kernels.kernel_fits(64, 96, a16=True)
    assert Int8Linear(int8_weight((64, 96), 8), None, acts="a16").kernel == "torch"
    assert Int8Linear(int8_weight((64, 128), 8), None, kernel="torch", acts="a16").kernel == "torch"


def test_failed_build_falls_back(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("g++: error: unrecognized command-line option '-mamx-tile'")

    monkeypatch.setattr(kernels, "_build", broken)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "cpu_features", lambda: set(kernels.ISA) | set(kernels.AMX_ISA))
    monkeypatch.delenv("EAGLESPEC_KERNELS", raising=False)
    with caplog.at_level("WARNING", logger="eaglespec.kernels"):
        assert kernels.int8_a16_kernel() is None
    assert any("-mamx-tile" in r.getMessage() for r in caplog.records)
    lin = Int8Linear(int8_weight((64, 128), 9), None, acts="a16")
    assert lin.kernel == "torch" and not lin.amx
    assert lin(torch.randn(3, 128).bfloat16()).shape == (3, 64)


def test_mode_is_known_and_cpu_only():
    assert "int8a16" in quant.QUANT_MODES
    with pytest.raises(quant.QuantError, match="int8a16 runs on a CPU in bf16"):
        quant.check_quant("int8a16", "cpu", torch.float32)
