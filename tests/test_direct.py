"""The decoder layer's direct CPU path (eaglespec/direct.py): the module path's bits, and where it
applies (the rest runs the modules)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_config, tiny_model

from eaglespec import direct, kernels
from eaglespec.direct import DirectLayer, plan_layer
from eaglespec.kv_cache import RowKVCache, row_attention_mask
from eaglespec.quant import quantize_model

pytestmark = pytest.mark.skipif(kernels.ops_kernel() is None or kernels.int4_kernel() is None,
                                reason="the package's CPU kernels did not build here")


def quant_model(mode: str, arch: str = "llama"):
    # head_dim 32 (the fused RoPE write's unit), widths the kernels take
    cfg = tiny_config(arch, hidden=64, inter=128, heads=2, kv_heads=1, vocab=96)
    return quantize_model(tiny_model(cfg, dtype=torch.bfloat16), mode)


@pytest.fixture
def direct_calls(monkeypatch):
    """Counts the layer calls the direct path took (a plan that returned an output), with the
    one-call stack of all layers off (its own tests are below)."""
    monkeypatch.setattr(direct, "STACK", False)
    taken = []
    run = DirectLayer.run

    def counted(self, *args):
        out = run(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(DirectLayer, "run", counted)
    return taken


def prefill_then_tree(model, prefill: int = 7):
    """Two rows: a causal prefill, then a 5-node tree whose nodes see only their ancestors.
    Returns (prefill logits, tree logits, k, v) after both forwards."""
    cfg = model.config
    rows, cap = 2, prefill + 8
    cache = RowKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cap, rows, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    zero = torch.zeros(rows, dtype=torch.long)
    tokens = torch.randint(0, cfg.vocab_size, (rows, prefill), generator=g)
    slots = torch.arange(prefill).expand(rows, -1)
    cache.prepare(slots, prefill)
    causal = torch.ones(rows, prefill, prefill, dtype=torch.bool).tril()
    with torch.no_grad():
        first = model(tokens, slots, cache, row_attention_mask(zero, zero, causal, prefill)[:, None]).logits
        parents = [-1, 0, 0, 1, 2]
        anc = torch.eye(5, dtype=torch.bool)
        for i, p in enumerate(parents):
            if p >= 0:
                anc[i] |= anc[p]
        depth = anc.sum(-1) - 1
        start = torch.full((rows,), prefill)
        cache.prepare(prefill + torch.arange(5).expand(rows, -1), prefill + 5)
        mask = row_attention_mask(start, start, anc.expand(rows, -1, -1), prefill + 5)[:, None]
        tree_tokens = torch.randint(0, cfg.vocab_size, (rows, 5), generator=g)
        second = model(tree_tokens, (prefill + depth).expand(rows, -1), cache, mask).logits
    return first, second, cache.k.clone(), cache.v.clone()


@pytest.mark.parametrize("mode", ["int4", "int8", "int8a16"])
def test_direct_path_gives_the_module_paths_bits(mode, monkeypatch, direct_calls):
    if mode == "int8a16" and kernels.int8_a16_kernel() is None:
        pytest.skip("the W8A16 kernel needs AVX512-VNNI")
    if mode == "int8" and kernels.int8_kernel() is None:
        pytest.skip("the int8 kernel did not build here")
    model = quant_model(mode)
    assert all(lay.direct_plan() is not None for lay in model.layers)
    on = prefill_then_tree(model)
    assert direct_calls and all(direct_calls)  # every layer call went direct
    direct_calls.clear()
    monkeypatch.setattr(direct, "DIRECT", False)
    off = prefill_then_tree(model)
    assert not direct_calls
    for a, b in zip(on, off):
        assert torch.equal(a, b)


def test_a_block_beyond_the_decode_attention_runs_the_modules(monkeypatch, direct_calls):
    """A prefill longer than attention.DECODE_ROWS goes to SDPA: the plan declines before writing."""
    model = quant_model("int4")
    from eaglespec import attention

    monkeypatch.setattr(attention, "DECODE_ROWS", 5)
    on = prefill_then_tree(model, prefill=6)
    assert direct_calls.count(False) == 2 and direct_calls.count(True) == 2  # prefill declined, tree direct
    monkeypatch.setattr(direct, "DIRECT", False)
    off = prefill_then_tree(model, prefill=6)
    for a, b in zip(on, off):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mixtral", "gemma3"])
def test_layers_the_plan_does_not_cover(arch):
    """Biases, q/k norms, experts, sandwich norms and GeGLU keep their modules."""
    model = quant_model("int4", arch)
    assert all(plan_layer(lay) is None for lay in model.layers)


def test_float_layers_have_no_plan_and_fp32_never_asks():
    assert plan_layer(quantize_model(tiny_model(tiny_config(hidden=64, inter=128, heads=2, kv_heads=1),
                                                dtype=torch.bfloat16), "none").layers[0]) is None
    fp32 = tiny_model(tiny_config(hidden=64, inter=128, heads=2, kv_heads=1))
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        fp32(tokens, torch.arange(3)[None], fp32.new_cache(3))
    assert fp32.layers[0]._direct is None  # fp32 never plans


def test_a_swapped_module_is_planned_again():
    model = quant_model("int4")
    layer = model.layers[0]
    first = layer.direct_plan()
    assert layer.direct_plan() is first  # planned once
    w = layer.mlp.w_down
    layer.mlp.w_down = copy.copy(w)
    second = layer.direct_plan()
    assert second is not None and second is not first
    layer.mlp.w_down = torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    assert layer.direct_plan() is None


@pytest.fixture
def stack_runs(monkeypatch):
    """Counts the forwards that ran all layers as one LayerStack call (direct.run_stack's results)."""
    taken = []
    run = direct.run_stack

    def counted(*args, **kwargs):
        out = run(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(direct, "run_stack", counted)
    return taken


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_the_layer_stack_gives_the_per_layer_paths_bits(mode, monkeypatch, stack_runs):
    """All layers in one C++ call (csrc/layer_stack.cpp) against the per-layer direct path and the
    modules: the same logits and KV caches for a causal prefill and a tree."""
    if mode == "int8" and kernels.int8_kernel() is None:
        pytest.skip("the int8 kernel did not build here")
    model = quant_model(mode)
    stacked = prefill_then_tree(model)
    assert stack_runs == [True, True]
    monkeypatch.setattr(direct, "STACK", False)
    per_layer = prefill_then_tree(model)
    monkeypatch.setattr(direct, "DIRECT", False)
    modules = prefill_then_tree(model)
    assert stack_runs == [True, True]  # the other two arms never asked
    for a, b, c in zip(stacked, per_layer, modules):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_layer_stack_keeps_the_hidden_states_eagle3_reads(monkeypatch, stack_runs):
    """hidden_layers split the stack into runs; each kept state is the layer loop's."""
    model = quant_model("int4")
    cfg = model.config
    outs = []
    for stack in (True, False):
        monkeypatch.setattr(direct, "STACK", stack)
        cache = RowKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, 1, torch.bfloat16)
        cache.prepare(torch.arange(4)[None], 4)
        causal = torch.ones(1, 4, 4, dtype=torch.bool).tril()
        zero = torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            outs.append(model(torch.tensor([[3, 1, 4, 1]]), torch.arange(4)[None], cache,
                              row_attention_mask(zero, zero, causal, 4)[:, None], hidden_layers=(0, 1)))
    assert stack_runs == [True]
    assert sorted(outs[0].hidden) == [0, 1]
    for i in (0, 1):
        assert torch.equal(outs[0].hidden[i], outs[1].hidden[i])
    assert torch.equal(outs[0].logits, outs[1].logits)


def test_the_layer_stack_declines_what_a_layer_would(monkeypatch, stack_runs):
    """A block over attention.DECODE_ROWS declines before writing (the layers then run their
    modules); a swapped module builds a new stack; models with sliding windows never ask."""
    from eaglespec import attention

    model = quant_model("int4")
    monkeypatch.setattr(attention, "DECODE_ROWS", 5)
    on = prefill_then_tree(model, prefill=6)
    assert stack_runs == [False, True]
    monkeypatch.setattr(direct, "DIRECT", False)
    off = prefill_then_tree(model, prefill=6)
    for a, b in zip(on, off):
        assert torch.equal(a, b)
    monkeypatch.setattr(direct, "DIRECT", True)
    first = model._stack[1]
    model.layers[1].mlp.w_down = copy.copy(model.layers[1].mlp.w_down)
    prefill_then_tree(model)
    assert model._stack[1] is not first and model._stack[1] is not None
    gemma = quant_model("int4", "gemma3")
    prefill_then_tree(gemma)
    assert stack_runs == [False, True, False, True]  # (prefill of 7 > 5 rows); gemma never reached run_stack
