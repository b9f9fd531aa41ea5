"""Weight-only int8 drafting: close to the float head, row-invariant, output unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.draft import init_random_head
from eaglespec.runtime.engine import Engine, Request
from eaglespec.quant import Int8Linear, quantize_rows_int8
from eaglespec.spec.draft_quant import int8_head, int8_linear, int8_supported
from spec_helpers import single_thread
from tiny import tiny_config, tiny_model

pytestmark = pytest.mark.skipif(not hasattr(torch, "_weight_int8pack_mm"), reason="no int8 CPU kernel in this torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_and_row_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 48, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    lin = Int8Linear(w, b)
    x = torch.randn(3, 7, 48, generator=g).to(dtype)
    y = lin(x)
    assert y.shape == (3, 7, 96)
    ref = F.linear(x.float(), w.float(), b.float())
    # Per-row int8 rounding: error well under 1% of the output scale.
    assert (y.float() - ref).abs().max() < 0.02 * ref.abs().max()
    # A row alone gives the bits it gives in a batch (batch invariance of drafting rests on this).
    for m in (1, 2, 5):
        assert torch.equal(lin(x[0, :m]), y[0, :m])


def test_widths_the_kernel_cannot_take_stay_float():
    w = torch.randn(8, 40, dtype=torch.bfloat16)
    x = torch.randn(2, 40, dtype=torch.bfloat16)
    assert not isinstance(int8_linear(w), Int8Linear)
    assert torch.equal(int8_linear(w)(x), F.linear(x, w))
    assert isinstance(int8_linear(torch.randn(8, 48)), Int8Linear)


def test_quantize_rows_round_trip():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]])
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and q[0, 1] == -127 and torch.all(q[1] == 0)
    assert torch.allclose(q.float() * s[:, None], w, atol=1e-2)


def test_int8_head_shares_weights_and_leaves_the_head_alone():
    cfg = tiny_config(vocab=64)
    head = init_random_head(cfg, seed=3)
    q = int8_head(head)
    assert isinstance(q.fc, Int8Linear) and isinstance(q.layer.mlp.w_down, Int8Linear)
    assert isinstance(head.fc, torch.nn.Linear) and isinstance(head.layer.attn.wqkv, torch.nn.Linear)
    assert q.fc.weight is head.fc.weight and q.layer.mlp_norm is head.layer.mlp_norm


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle-2-layers"])
@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_int8_drafting_changes_nothing_but_the_drafts(method, kind):
    """Greedy output with int8 drafting equals vanilla and the float draft's (both head kinds, and
    a two-layer EAGLE-1/2 head)."""
    cfg = tiny_config(vocab=96)
    target = tiny_model(cfg, seed=5)
    head = init_random_head(cfg, seed=9, kind="eagle3" if kind == "eagle3" else "eagle", draft_vocab=40 if kind == "eagle3" else None,
                            num_layers=2 if kind == "eagle-2-layers" else 1)
    tree = TreeConfig(method, total_tokens=12, depth=4, top_k=3)
    prompts = [[3, 4, 5], list(range(10, 30))]
    with single_thread():
        outs = {}
        for name, m, int8 in (("vanilla", "vanilla", False), ("float", method, False), ("int8", method, True)):
            eng = Engine(target, head, draft_int8=int8)
            reqs = eng.run([Request(p, m, tree if m != "vanilla" else None, SamplingConfig(), 30) for p in prompts])
            outs[name] = [r.pending_tokens for r in reqs]
            if int8:
                lane = next(iter(eng.lanes.values()))
                assert isinstance(lane.proposer.head.fc, Int8Linear)
                assert isinstance(lane.proposer.head.layer.attn.wqkv, Int8Linear)
                if kind == "eagle-2-layers":
                    assert isinstance(lane.proposer.head.more[0].mlp.w_down, Int8Linear)
    assert outs["int8"] == outs["vanilla"] == outs["float"]


def test_int8_drafting_keeps_seeded_sampling_batch_invariant():
    """A sampled request drafts the same trees alone and in a batch (the kernel is row-invariant),
    so its seeded output does not depend on its neighbours."""
    cfg = tiny_config(vocab=96)
    target = tiny_model(cfg, seed=5)
    head = init_random_head(cfg, seed=9)
    tree = TreeConfig("eagle2", total_tokens=12, depth=4, top_k=3)
    prompts = [[3, 4, 5], list(range(10, 30)), [7, 7], [1, 50, 2, 60]]

    def job(i):
        return Request(prompts[i], "eagle2", tree, SamplingConfig(0.9, seed=i), 20 + 3 * i)

    with single_thread():
        alone = [Engine(target, head, draft_int8=True).run([job(i)])[0] for i in range(4)]
        together = Engine(target, head, draft_int8=True, max_batch=4).run([job(i) for i in range(4)])
    assert [r.pending for r in together] == [r.pending for r in alone]


def test_auto_int8_only_for_bf16_heads_on_cpu():
    assert int8_supported(torch.device("cpu"), torch.bfloat16)
    assert not int8_supported(torch.device("cpu"), torch.float32)


def test_int8_drafting_takes_16_bit_activations_on_amx_tiles(monkeypatch):
    """Where the W8A16 kernel runs on tiles, widths of whole 64-blocks draft with it; the rest, and
    every width without tiles (EAGLESPEC_AMX=0), keep the W8A8 kernel. Row-invariant either way."""
    from eaglespec import kernels

    w = torch.randn(32, 128, dtype=torch.bfloat16)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    lin = int8_linear(w)
    assert lin.kernel == ("a16" if kernels.amx_tiles() else "vnni" if kernels.int8_kernel() else "torch")
    assert torch.equal(lin(x[:2]), lin(x)[:2])
    assert int8_linear(torch.randn(32, 48, dtype=torch.bfloat16)).kernel != "a16"  # 48: not a 64-block
    monkeypatch.setenv("EAGLESPEC_AMX", "0")
    assert int8_linear(w).kernel != "a16"
