"""Quantised linears (`--quant`): GGUF repack exactness, closeness to the float reference, the mode
rules, and greedy tokens on the default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglespec.quant import (GROUP, Int4Linear, Int8Linear, QuantError, check_quant, greedy_exact,
                             int4_from_float, int4_from_gguf_blocks, quantize_model, resolve_quant)
from tiny import tiny_config, tiny_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="no int4 CPU kernel in this torch")


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF blocks [n, k / 32 * bytes] with random fp16 d (and m) and random nibbles."""
    rng = np.random.default_rng(seed)
    groups = k // GROUP
    d = (rng.standard_normal((n, groups)) * 0.02).astype(np.float16)
    parts = [d.view(np.uint8).reshape(n, groups, 2)]
    if kind == "Q4_1":
        m = (rng.standard_normal((n, groups)) * 0.1).astype(np.float16)
        parts.append(m.view(np.uint8).reshape(n, groups, 2))
    parts.append(rng.integers(0, 256, (n, groups, 16), dtype=np.uint8))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_repack_is_exact(kind):
    """Our codes stand for exactly the weights the gguf package dequantises, bit for bit in fp32:
    (q - 8) * d + (m + 8d) and d * q + m round the same real number once (m + 8d is exact in fp32)."""
    raw = random_blocks(kind, 24, 128)
    qtype = gguf.GGMLQuantizationType[kind]
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(24, 128)
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    w = int4_from_gguf_blocks(torch.from_numpy(raw.reshape(24, -1, block_bytes)), kind)
    assert w.q.min() >= 0 and w.q.max() <= 15
    assert torch.equal(w.dequantize(), ref)


@pytest.mark.slow
def test_default_model_blocks_repack_exactly():
    from eaglespec.weights import read_gguf, resolve_model

    try:
        src = resolve_model("smollm2-135m-instruct")
    except ValueError as e:
        pytest.skip(str(e))
    reader = read_gguf(src.path)
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    _, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
    raw = np.array(t.data)
    w = int4_from_gguf_blocks(torch.from_numpy(raw.reshape(raw.shape[0], -1, block_bytes)), t.tensor_type.name)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32))
    assert torch.equal(w.dequantize(), ref.reshape(w.q.shape))


def test_int4_linear_matches_its_dequantised_weights():
    """The kernel against x @ dequantised W^T in fp64. Tolerance: the kernel takes scale and zero
    in bf16 (relative rounding 2^-9 each) and returns bf16 (2^-9): 1% of the output scale covers
    both with room, while a wrong nibble order or zero point is off by far more."""
    g = torch.Generator().manual_seed(0)
    w = int4_from_float(torch.randn(64, 128, generator=g))
    bias = torch.randn(64, generator=g).bfloat16()
    lin = Int4Linear(w, bias, torch.bfloat16)
    x = torch.randn(5, 128, generator=g).bfloat16()
    ref = x.double() @ w.dequantize().double().t() + bias.double()
    err = (lin(x).double() - ref).abs().max()
    assert err < 0.01 * ref.abs().max()


def test_int4_from_float_error_is_within_half_a_step():
    w = torch.randn(16, 64)
    q = int4_from_float(w)
    step = q.scale.repeat_interleave(GROUP, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_mode_rules():
    assert resolve_quant("auto", "cpu", torch.bfloat16, "Q4_1") == "int4"
    assert resolve_quant("auto", "cpu", torch.bfloat16, "Q4_0") == "int4"
    assert resolve_quant("auto", "cpu", torch.bfloat16, "Q8_0", amx=False) == "int8"
    assert resolve_quant("auto", "cpu", torch.bfloat16, "Q8_0", amx=True) == "int8a16"  # AMX: trees cost little
    assert resolve_quant("auto", "cpu", torch.bfloat16, "Q4_1", amx=True) == "int4"
    assert resolve_quant("auto", "cpu", torch.bfloat16, None) == "none"  # safetensors stay float
    assert resolve_quant("auto", "cpu", torch.bfloat16, "Q6_K") == "none"
    assert resolve_quant("auto", "cpu", torch.float32, "Q4_1") == "none"  # the kernels' fp32 path is slow
    assert resolve_quant("auto", "cuda", torch.bfloat16, "Q4_1") == "none"
    assert resolve_quant("int8", "cpu", torch.bfloat16, None) == "int8"
    with pytest.raises(QuantError, match="bf16"):
        check_quant("int4", "cpu", torch.float32)
    with pytest.raises(QuantError, match="CPU"):
        check_quant("int8", "cuda", torch.bfloat16)
    with pytest.raises(QuantError, match="one of"):
        check_quant("int3", "cpu", torch.bfloat16)


def quant_tiny():
    cfg = tiny_config(hidden=64, inter=128, heads=4, kv_heads=2, vocab=96)
    return tiny_model(cfg, dtype=torch.bfloat16)


def test_greedy_exact_needs_row_invariant_attention(monkeypatch):
    """Without the package's attention kernel, a CPU without AVX-512 (whose torch bf16 products
    are not row-invariant) withdraws the claim; with AVX-512 the torch fallback keeps it."""
    from eaglespec import kernels

    model = quantize_model(quant_tiny(), "int4")
    monkeypatch.setattr(kernels, "ops_kernel", lambda: None)
    monkeypatch.setattr(kernels, "cpu_features", lambda: {"avx2", "f16c"})
    assert not greedy_exact(model)
    monkeypatch.setattr(kernels, "cpu_features", lambda: {"avx2", "avx512_f"})
    assert greedy_exact(model)


@pytest.mark.parametrize("mode", ["int4", "int8", "int8a16"])
def test_quantize_model_swaps_linears_and_stays_close(mode):
    ref = quant_tiny()
    model = quantize_model(quant_tiny(), mode)
    kind = Int4Linear if mode == "int4" else Int8Linear
    assert isinstance(model.layers[0].mlp.w_down, kind) and isinstance(model.lm_head, Int8Linear)
    assert model.lm_head.weight.dtype == torch.bfloat16  # the drafter still reads the float head
    assert model.layers[0].mlp.w_down.__dict__.get("weight") is None  # the float layer weights are freed
    assert model.quant == mode and greedy_exact(model) and not greedy_exact(ref)
    # a linear left float (a width no kernel takes) withdraws the claim
    odd = quant_tiny()
    odd.layers[0].mlp.w_down = torch.nn.Linear(120, 64, bias=False, dtype=torch.bfloat16)
    assert not greedy_exact(quantize_model(odd, mode))
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None]
    with torch.inference_mode():
        a = ref(tokens, pos, ref.new_cache(16)).logits.float()
        b = model(tokens, pos, model.new_cache(16)).logits.float()
    # 4-bit groups of 32 on random weights: logits move by a few percent of their scale.
    assert (a - b).abs().max() < 0.15 * a.abs().max()


def test_load_model_refuses_quant_on_fp32():
    from eaglespec.weights import load_model

    with pytest.raises(QuantError):
        load_model("smollm2-135m-instruct", torch.float32, quant="int4")


def greedy_ids(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    cache = model.new_cache(len(prompt) + n + 1)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, logits_for="last")
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[ids[-1]]]), torch.tensor([[len(ids) - 1]]), cache)
    return ids[len(prompt):]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int4", "int8", "int8a16"])
def test_default_model_greedy_tokens_match_the_float_reference(mode):
    """Teacher-forced on the fp32 reference's own greedy continuation: logits stay within the mode's
    error (measured max |delta logit| 1.45 for int4, 1.87 for int8: per-row int8 of 4-bit weights
    is coarser than the file's groups of 32; with the VNNI kernels, which also round activations
    to int8 per group of 32, 1.52 and 2.23; with the C++ RMSNorm and RoPE too, 2.04 for int4, so
    both modes now allow 2.5, about 2% of these logits' range), and wherever the reference's top two logits are
    more than one logit apart (about half the positions: this small model's margins are narrow)
    the quantised model picks the same token."""
    from eaglespec.api import EagleSpec

    try:
        ref = EagleSpec.load(dtype="fp32", quant="none")
    except ValueError as e:
        pytest.skip(str(e))
    model = EagleSpec.load(dtype="bf16", quant=mode).target
    tolerance = 2.5
    checked = total = 0
    for prompt in ("Why is the sky blue?", "Write a haiku about the sea.", "What is 17 times 23?"):
        ids = ref.encode(prompt)[1]
        cont = greedy_ids(ref.target, ids, 24)
        seq = torch.tensor([ids + cont])
        pos = torch.arange(seq.shape[1])[None]
        with torch.inference_mode():
            lr = ref.target(seq, pos, ref.target.new_cache(seq.shape[1])).logits[0, len(ids) - 1:-1].float()
            lq = model(seq, pos, model.new_cache(seq.shape[1])).logits[0, len(ids) - 1:-1].float()
        assert (lq - lr).abs().max() < tolerance
        top2 = lr.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1.0
        assert torch.equal(lq.argmax(-1)[clear], lr.argmax(-1)[clear])
        checked += int(clear.sum())
        total += len(cont)
    assert checked >= total // 3
