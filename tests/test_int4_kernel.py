"""The integer kernels (eaglespec.kernels): W4A8 int4 (csrc/int4_gemm.cpp) and W8A8 int8
(csrc/int8_gemm.cpp, the LM head and the int8 mode), each in the build this CPU takes (AVX512-VNNI
or AVX2). Each is bitwise equal to a torch reference of the same operations, row-invariant, close
to the float weights; the AVX2 build equals the AVX512 one where both run; and the fallbacks (the
`INT4_KERNEL` / `INT8_KERNEL` switches, `EAGLESPEC_KERNELS=0`, a failed build, shapes they do not
take)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglespec import kernels, quant
from eaglespec.quant import Int4Linear, Int4Weights, Int8Linear, int4_from_float, quantize_rows_int8

WHY = "cannot run here (neither AVX512-VNNI nor AVX2, no compiler, or EAGLESPEC_KERNELS=0); torch's kernel is used instead"
needs_int4_kernel = pytest.mark.skipif(kernels.int4_kernel() is None, reason="the int4 kernel " + WHY)
needs_int8_kernel = pytest.mark.skipif(kernels.int8_kernel() is None, reason="the int8 kernel " + WHY)

# The default model's linear shapes (out, in): fused qkv, o, fused gate_up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] -> (a [M, G, 32] int8 values as floats, d [M, G]): csrc/common.h's rounding."""
    m, k = x.shape
    xg = x.float().view(m, k // quant.GROUP, quant.GROUP)
    d = xg.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (xg * inv[..., None]).round(), d  # round: half to even


def reference(x: torch.Tensor, w: Int4Weights) -> torch.Tensor:
    """The int4 kernel's arithmetic in torch: x bf16 [M, K] -> bf16 [M, N]. Every fp32 operation is
    one IEEE-rounded elementwise op in the kernel's order, so the results can be compared bitwise."""
    m, k = x.shape
    g = k // quant.GROUP
    a, d = quantize_activations(x)
    c = d * a.sum(-1)  # the sum is an exact integer
    s = torch.einsum("mgk,ngk->mng", a.double(), w.q.view(-1, g, quant.GROUP).double()).float()  # exact
    scale, zero8 = kernels.int4_kernel_params(w.scale, w.zero)  # [N, G] each, fp16 values
    acc = torch.zeros(m, w.q.shape[0])
    for j in range(g):  # groups in order
        acc = acc + (s[:, :, j] * (scale[:, j] * d[:, j, None]) + zero8[:, j] * c[:, j, None])
    return acc.bfloat16()


def weights(shape: tuple[int, int], seed: int) -> Int4Weights:
    g = torch.Generator().manual_seed(seed)
    return int4_from_float(torch.randn(*shape, generator=g) * 0.05)


@needs_int4_kernel
@pytest.mark.parametrize("shape", SHAPES + [(16, 32)])
def test_kernel_equals_reference_bitwise(shape):
    w = weights(shape, 0)
    lin = Int4Linear(w, None, torch.bfloat16, kernel="vnni")
    assert lin.kernel == "vnni"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, shape[1], generator=g).bfloat16()
    x[3, :32] = 0  # an all-zero group: activation scale 0
    x[5, 40:45] = 1e4  # outliers: the group's other values round to 0
    assert torch.equal(lin(x), reference(x, w))


@needs_int4_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_are_invariant_1_to_64(shape):
    """Each of 64 rows alone equals the same row computed with 1..63 others, for every M and offset."""
    lin = Int4Linear(weights(shape, 2), None, torch.bfloat16, kernel="vnni")
    x = torch.randn(64, shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    for m in range(2, 65):
        start = (7 * m) % (65 - m)  # the rows' offset in the batch varies too
        assert torch.equal(lin(x[start:start + m]), alone[start:start + m]), f"{m} rows"


@needs_int4_kernel
def test_threads_do_not_change_the_result():
    lin = Int4Linear(weights((3072, 576), 4), None, torch.bfloat16, kernel="vnni")
    x = torch.randn(9, 576).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(max(2, before))
        assert torch.equal(lin(x), one)
    finally:
        torch.set_num_threads(before)


@needs_int4_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_close_to_the_dequantised_weights(shape):
    """Against x @ dequantised W^T in fp64. The only approximations: the activations' int8 rounding
    (each element off by at most half a step, d/2 = max|x_group|/254: under 0.4% of the group's
    largest) and fp32 / bf16 rounding of the result (2^-9 relative). On random data the error is a
    random sum of those steps: 2% of the output's scale bounds it with room, while a wrong nibble
    order or zero point is off by tens of percent."""
    w = weights(shape, 5)
    bias = torch.randn(shape[0]).bfloat16()
    lin = Int4Linear(w, bias, torch.bfloat16, kernel="vnni")
    x = torch.randn(8, shape[1]).bfloat16()
    ref = x.double() @ w.dequantize().double().t() + bias.double()
    err = (lin(x).double() - ref).abs().max()
    assert err < 0.02 * ref.abs().max()


def test_switch_uses_torch():
    w = weights((64, 128), 6)
    x = torch.randn(3, 128).bfloat16()
    torch_lin = Int4Linear(w, None, torch.bfloat16, kernel="torch")
    assert torch_lin.kernel == "torch"
    old = quant.INT4_KERNEL
    try:
        quant.INT4_KERNEL = "torch"
        assert Int4Linear(w, None, torch.bfloat16).kernel == "torch"
    finally:
        quant.INT4_KERNEL = old
    ref = x.double() @ w.dequantize().double().t()
    assert (torch_lin(x).double() - ref).abs().max() < 0.01 * ref.abs().max()


def test_kernels_off_by_environment_falls_back():
    """EAGLESPEC_KERNELS=0: no kernel, Int4Linear runs torch's, and quantised layers still work
    (a fresh process: the kernel module is cached per process)."""
    code = ("import torch; from eaglespec import kernels\n"
            "from eaglespec.quant import Int4Linear, Int8Linear, int4_from_float\n"
            "assert kernels.int4_kernel() is None and kernels.int8_kernel() is None\n"
            "x = torch.randn(2, 128).bfloat16()\n"
            "lin = Int4Linear(int4_from_float(torch.randn(64, 128)), None, torch.bfloat16)\n"
            "assert lin.kernel == 'torch' and lin(x).shape == (2, 64)\n"
            "lin = Int8Linear(torch.randn(64, 128).bfloat16(), None)\n"
            "assert lin.kernel == 'torch' and lin(x).shape == (2, 64)\n")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "EAGLESPEC_KERNELS": "0", "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_pack_layout():
    """pack_int4 puts output j's code for input 4c + b (low nibble) and 16 + 4c + b (high nibble) at
    byte 4j + b of chunk c, as the kernel reads them."""
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, zero = torch.rand(n, k // 32), torch.rand(n, k // 32)
    codes, params = kernels.pack_int4(q, scale, zero)
    t, g, c, j, b = 1, 1, 2, 5, 3
    byte = int(codes[t, g, 64 * c + 4 * j + b])
    assert byte & 0xF == q[16 * t + j, 32 * g + 4 * c + b]
    assert byte >> 4 == q[16 * t + j, 32 * g + 16 + 4 * c + b]
    assert params.dtype == torch.float16
    assert params[t, g, 0, j] == scale[16 * t + j, g].half()
    assert params[t, g, 1, j] == (zero[16 * t + j, g] - 8 * scale[16 * t + j, g]).half()


def test_gguf_params_are_exact_in_fp16():
    """Q4_1 blocks hold d and m as fp16; the kernel's fp16 (scale, zero8) must be exactly (d, m)."""
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(64, 4, generator=g) * 0.02 + 1e-4).half()
    m = (-torch.rand(64, 4, generator=g) * 0.2).half()
    raw = torch.zeros(64, 4, 20, dtype=torch.uint8)
    raw[..., 0:2] = d.view(torch.uint8).view(64, 4, 2)
    raw[..., 2:4] = m.view(torch.uint8).view(64, 4, 2)
    raw[..., 4:] = torch.randint(0, 256, (64, 4, 16), generator=g, dtype=torch.uint8)
    w = quant.int4_from_gguf_blocks(raw, "Q4_1")
    scale, zero8 = kernels.int4_kernel_params(w.scale, w.zero)
    assert torch.equal(scale, d.float()) and torch.equal(zero8, m.float())


def test_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("g++: error: no such compiler\nninja: build stopped")

    monkeypatch.setattr(kernels, "_build", broken)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "cpu_features", lambda: set(kernels.ISA))
    monkeypatch.delenv("EAGLESPEC_KERNELS", raising=False)
    with caplog.at_level("WARNING", logger="eaglespec.kernels"):
        assert kernels.int4_kernel() is None
        assert kernels.int4_kernel() is None
    assert len(caplog.records) == 1 and "no such compiler" in caplog.records[0].getMessage()
    assert Int4Linear(weights((64, 128), 8), None, torch.bfloat16).kernel == "torch"
    assert Int8Linear(int8_weight((64, 128), 9), None).kernel == "torch"


def test_misfit_shapes_use_torch(monkeypatch):
    """A layer the VNNI kernel does not take runs torch's. Every shape torch's packing takes fits
    the VNNI kernel too (quant.int4_fits), so the misfit is simulated."""
    for n, k in SHAPES + [(16, 64), (48, 192)]:
        assert quant.int4_fits(n, k) <= kernels.kernel_fits(n, k)
    assert not kernels.kernel_fits(72, 128) and not kernels.kernel_fits(64, 48)
    monkeypatch.setattr(kernels, "kernel_fits", lambda n, k: False)
    lin = Int4Linear(weights((64, 128), 7), None, torch.bfloat16, kernel="vnni")
    assert lin.kernel == "torch" and lin(torch.randn(3, 128).bfloat16()).shape == (3, 64)


def reference_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's arithmetic in torch (q int8 [N, K], scales fp32 [N]), op for op."""
    g = x.shape[1] // quant.GROUP
    a, d = quantize_activations(x)
    s = torch.einsum("mgk,ngk->mng", a.double(), q.view(-1, g, quant.GROUP).double()).float()  # exact
    acc = torch.zeros(x.shape[0], q.shape[0])
    for j in range(g):
        acc = acc + s[:, :, j] * d[:, j, None]
    return (acc * scales).bfloat16()


HEAD = (49152, 576)  # the default model's LM head


def int8_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


@needs_int8_kernel
@pytest.mark.parametrize("shape", SHAPES + [HEAD, (16, 32)])
def test_int8_kernel_equals_reference_bitwise(shape):
    w = int8_weight(shape, 10)
    lin = Int8Linear(w, None, kernel="vnni")
    assert lin.kernel == "vnni"
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(11)).bfloat16()
    x[1, :32] = 0
    x[2, 40:45] = -1e4
    q, scales = quantize_rows_int8(w)
    assert torch.equal(lin(x), reference_int8(x, q, scales))


@needs_int8_kernel
@pytest.mark.parametrize("shape", SHAPES + [HEAD])
def test_int8_rows_are_invariant_1_to_64(shape):
    lin = Int8Linear(int8_weight(shape, 12), None, kernel="vnni")
    x = torch.randn(64, shape[1], generator=torch.Generator().manual_seed(13)).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    for m in range(2, 65):
        start = (7 * m) % (65 - m)
        assert torch.equal(lin(x[start:start + m]), alone[start:start + m]), f"{m} rows"


@needs_int8_kernel
def test_int8_close_to_the_float_weights_and_switch():
    """Against x @ W^T in fp64 (the bf16 weights before int8): the weights' and the activations'
    rounding (each under 0.4% of its row's / group's largest) and bf16 output; 3% of the output's
    scale bounds it with room (measured about 1.1% on these shapes). The torch kernel (switch)
    meets the same bound."""
    w = int8_weight((576, 1536), 14)
    bias = torch.randn(576).bfloat16()
    x = torch.randn(8, 1536).bfloat16()
    ref = x.double() @ w.double().t() + bias.double()
    old = quant.INT8_KERNEL
    try:
        quant.INT8_KERNEL = "torch"
        assert Int8Linear(w, bias).kernel == "torch"
    finally:
        quant.INT8_KERNEL = old
    for kernel in ("vnni", "torch"):
        lin = Int8Linear(w, bias, kernel=kernel)
        assert lin.kernel == kernel
        assert (lin(x).double() - ref).abs().max() < 0.03 * ref.abs().max()


@pytest.mark.skipif(kernels.gemm_flags("int4", kernels.cpu_features()) != kernels.FLAGS,
                    reason="the AVX512-VNNI build does not run here (an AVX2-only CPU tests its own build "
                           "against the torch references above)")
def test_avx2_build_equals_the_avx512_build():
    """Built both ways on a CPU that runs both: the same bits for every row count (the AVX2 path
    is what CPUs without AVX-512 run)."""
    g = torch.Generator().manual_seed(21)
    w4 = weights((960, 576), 22)
    codes4, params4 = kernels.pack_int4(w4.q, w4.scale, w4.zero)
    q8, s8 = quantize_rows_int8(int8_weight((1024, 576), 23))
    codes8, wscale8 = kernels.pack_int8(q8, s8)
    x = torch.randn(37, 576, generator=g).bfloat16()
    x[3, :32] = 0
    x[5, 40:45] = 1e4
    for kind, args in (("int4", (codes4, params4)), ("int8", (codes8, wscale8))):
        wide = getattr(kernels, f"{kind}_kernel")()
        narrow = kernels._build(f"eaglespec_{kind}_avx2", kernels.SOURCES[kind], kernels.AVX2_FLAGS)
        fn = f"{kind}_gemm"
        for rows in (1, 3, 8, 37):
            assert torch.equal(getattr(narrow, fn)(x[:rows], *args), getattr(wide, fn)(x[:rows], *args)), (kind, rows)
