"""bf16 linears packed once for oneDNN (`--quant none` on a CPU): the same products as F.linear,
used by load_model where they apply, and a target built of them decodes like the plain one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eaglespec import packed
from eaglespec.packed import PackedLinear, pack_linears, packing_applies
from eaglespec.quant import quantize_model
from tiny import logits_of, tiny_config, tiny_model

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not packing_applies(torch.zeros(1, 1, dtype=BF16)),
                                reason="oneDNN here does not take bf16 (no packing to test)")


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_product_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(BF16)
    b = torch.randn(96, generator=g).to(BF16) if bias else None
    x = torch.randn(3, rows, 64, generator=g).to(BF16)
    got, want = PackedLinear(w, b)(x), nn.functional.linear(x, w, b)
    assert got.shape == want.shape == (3, rows, 96) and got.dtype == BF16
    # The same oneDNN kernel on the same blocking: bit-identical where measured (AMX Xeon); one
    # bf16 rounding step apart at most anywhere. A wrong layout would be off by O(1).
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


def test_non_contiguous_input():
    w = torch.randn(48, 32).to(BF16)
    x = torch.randn(4, 64).to(BF16)[:, ::2]  # a strided view, like a split's piece
    torch.testing.assert_close(PackedLinear(w, None)(x).float(), nn.functional.linear(x, w).float(),
                               rtol=2 ** -7, atol=2 ** -7)


def test_quantize_none_packs_bf16_cpu_only(monkeypatch):
    cfg = tiny_config(tie=True)
    bf = quantize_model(tiny_model(cfg, dtype=BF16).to(BF16), "none")
    kinds = {type(m).__name__ for n, m in bf.layers.named_modules() if n.endswith(("wqkv", "wo", "w_gate_up", "w_down"))}
    assert kinds == {"PackedLinear"}
    assert isinstance(bf.lm_head, PackedLinear) and bf.lm_head.weight is bf.embed.weight  # the drafter reads it
    assert not any(k.endswith("packed") for k in bf.state_dict())  # opaque tensors stay out of state_dict

    fp = quantize_model(tiny_model(cfg), "none")  # fp32: the exact mode's products are untouched
    assert not any(isinstance(m, PackedLinear) for m in fp.modules())
    monkeypatch.setattr(packed, "PACK_BF16", False)
    off = tiny_model(cfg).to(BF16)
    assert pack_linears(off) == 0 and not any(isinstance(m, PackedLinear) for m in off.modules())


def test_packed_target_decodes_like_plain():
    """A bf16 tiny target, packed against plain: prefill logits, then greedy vanilla decoding and
    eagle2 through the engine (tree rows and a qkv bias through the packed products)."""
    from eaglespec.config import TreeConfig
    from eaglespec.draft import init_random_head
    from eaglespec.runtime.engine import Request
    from spec_helpers import RecordingEngine, run_generate

    cfg = tiny_config(arch="qwen2")  # qkv bias: the packed product with a bias
    plain = tiny_model(cfg, seed=3).to(BF16)
    pk = tiny_model(cfg, seed=3).to(BF16)
    assert pack_linears(pk) == 4 * cfg.num_layers + 1
    ids = torch.tensor([[5, 17, 33, 2, 71, 8, 40]])
    torch.testing.assert_close(logits_of(pk, ids).float(), logits_of(plain, ids).float(), rtol=2 ** -6, atol=2 ** -6)
    prompt = ids[0].tolist()
    ref = run_generate(plain, prompt, max_new_tokens=24, eos_ids=[]).tokens
    assert run_generate(pk, prompt, max_new_tokens=24, eos_ids=[]).tokens == ref
    head = init_random_head(cfg, seed=9).to(BF16)
    (req,) = RecordingEngine(pk, head).run([Request(prompt, "eagle2", TreeConfig("eagle2", total_tokens=12, depth=4,
                                                                                   top_k=4), max_new_tokens=24)])
    assert req.error is None and len(req.pending_tokens) == 24
