"""Row invariance: a row's output is bitwise the same alone or computed with up to 63 other rows or
tree nodes. Greedy speculative output equals vanilla in bf16 (quant int4 / int8 / int8a16) because of this."""

from __future__ import annotations

import pytest
import torch

from eaglespec import attention
from eaglespec.attention import DECODE_ROWS, grouped_attention, kernel_attention
from eaglespec.kernels import attention_amx, cpu_features, ops_kernel
from eaglespec.model import RMSNorm, apply_rotary
from eaglespec.quant import Int4Linear, Int8Linear, int4_from_float, quantize_model
from tiny import tiny_config, tiny_model

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="no int4 CPU kernel in this torch")

# The default model's linear shapes (out, in) and its LM head's.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["int4", "int8", "int8a16"])
def test_quantised_linear_rows_are_invariant(shape, kind):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) * 0.05
    lin = (Int4Linear(int4_from_float(w), None, torch.bfloat16) if kind == "int4"
           else Int8Linear(w.bfloat16(), None, acts="a16" if kind == "int8a16" else "a8"))
    x = torch.randn(64, shape[1], generator=g).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
    for m in (2, 3, 7, 8, 15, 16, 17, 31, 33, 64):
        assert torch.equal(lin(x[:m]), alone[:m]), f"{kind} {shape}: {m} rows"


def test_lm_head_rows_are_invariant():
    g = torch.Generator().manual_seed(1)
    head = Int8Linear((torch.randn(49152, 576, generator=g) * 0.05).bfloat16(), None)
    x = torch.randn(24, 576, generator=g).bfloat16()
    alone = torch.cat([head(x[i:i + 1]) for i in range(24)])
    assert torch.equal(head(x), alone)


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, n] bool ancestor matrix (node 0 the root; a node sees itself and its ancestors)."""
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        parent = int(torch.randint(0, i, (1,), generator=g)) if i else -1
        anc[i] = anc[parent] if parent >= 0 else anc[i]
        anc[i, i] = True
    return anc


def needs_kernel(which: str, monkeypatch) -> None:
    """which: "ours" (csrc's vector path), "amx" (its AMX tile path, where this CPU has one) or "torch"."""
    if which in ("ours", "amx") and ops_kernel() is None:
        pytest.skip("the attention kernel could not be built here (no compiler, or EAGLESPEC_KERNELS=0)")
    monkeypatch.setenv("EAGLESPEC_AMX", "1" if which == "amx" else "0")
    if which == "amx" and not attention_amx():
        pytest.skip("no AMX-BF16 tiles here")


@pytest.mark.parametrize("which", ["ours", "amx", "torch"])
@pytest.mark.parametrize("context", [5, 130, 700])
def test_tree_attention_equals_each_node_alone(context, which, monkeypatch):
    """A tree node attends over the committed context plus its ancestors, with other nodes masked
    between them and unused view slots after: its output equals the one-token call over its own
    path laid out contiguously (how plain decoding sees it). In bf16, the default dtype; fp32's
    matrix-vector kernel differs from its matrix kernel (its exactness is token-level, tested
    end to end)."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(context)
    needs_kernel(which, monkeypatch)
    if which == "torch" and "avx512_f" not in cpu_features():
        # Measured on an AVX2-only EPYC: a node's scores depend on its column in torch's bf16
        # product; attention.exact_attention_here() (and so greedy_exact) says so there.
        pytest.skip("torch's bf16 products are not row-invariant on CPUs without AVX-512")
    attend = grouped_attention if which == "torch" else kernel_attention
    nh, nkv, hd, n, pad = 9, 3, 64, DECODE_ROWS, 11
    k_ctx, v_ctx = (torch.randn(1, nkv, context, hd, generator=g).to(dtype) for _ in range(2))
    k_tree, v_tree = (torch.randn(1, nkv, n, hd, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, nh, n, hd, generator=g).to(dtype)
    anc = random_tree(n, g)
    junk = torch.randn(1, nkv, pad, hd, generator=g).to(dtype)  # slots past the view's live part
    k = torch.cat([k_ctx, k_tree, junk], 2)
    v = torch.cat([v_ctx, v_tree, junk], 2)
    mask = torch.cat([torch.ones(n, context, dtype=torch.bool), anc, torch.zeros(n, pad, dtype=torch.bool)], 1)
    full = attend(q, k, v, mask[None, None])
    for size in (1, 2, 17, n):  # the tree's first `size` nodes scored together
        part = attend(q[:, :, :size], k, v, mask[None, None, :size])
        assert torch.equal(part, full[:, :, :size])
    for i in range(n):
        path = torch.nonzero(anc[i]).flatten()  # ancestors in depth order, then the node
        alone = attend(q[:, :, i:i + 1], torch.cat([k_ctx, k_tree[:, :, path]], 2),
                       torch.cat([v_ctx, v_tree[:, :, path]], 2), None)
        assert torch.equal(alone, full[:, :, i:i + 1]), f"node {i}"


@pytest.mark.parametrize("which", ["ours", "torch"])
def test_rmsnorm_and_rope_rows_are_invariant(which, monkeypatch):
    """Inference takes csrc's ops (no autograd), training torch's; both per row."""
    needs_kernel(which, monkeypatch)
    norm = RMSNorm(576, 1e-5).bfloat16()
    x = torch.randn(64, 576).bfloat16()
    q = torch.randn(1, 9, 64, 64).bfloat16()
    cos, sin = torch.randn(2, 1, 1, 64, 64).bfloat16()
    with torch.set_grad_enabled(which == "torch"):
        assert torch.equal(norm(x), torch.cat([norm(x[i:i + 1]) for i in range(64)]))
        rope = apply_rotary(q, cos, sin)
        for i in (0, 5, 63):
            assert torch.equal(apply_rotary(q[:, :, i:i + 1], cos[:, :, i:i + 1], sin[:, :, i:i + 1]), rope[:, :, i:i + 1])


@pytest.mark.parametrize("which", ["ours", "amx", "torch"])
@pytest.mark.parametrize("mode", ["int4", "int8", "int8a16"])
def test_tree_forward_equals_decoding_each_path(mode, which, monkeypatch):
    """The whole target in bf16: logits of a random 20-node tree scored in one forward equal,
    bit for bit, each node's logits when its path is decoded one token at a time. head_dim 32,
    so the AMX path takes it where there is one."""
    needs_kernel(which, monkeypatch)
    monkeypatch.setattr(attention, "DECODE_KERNEL", "torch-exact" if which == "torch" else "exact")
    cfg = tiny_config(hidden=64, inter=128, heads=2, kv_heads=1, vocab=96)
    model = quantize_model(tiny_model(cfg, dtype=torch.bfloat16), mode)
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 96, (1, 9), generator=g)
    n = 20
    anc = random_tree(n, g)
    tokens = torch.randint(0, 96, (1, n), generator=g)
    depth = anc.sum(1) - 1
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(ctx, torch.arange(9)[None], cache, logits_for="none")
        mask = torch.cat([torch.ones(n, 9, dtype=torch.bool), anc], 1)[None]
        tree = model(tokens, (9 + depth)[None], cache, mask=mask).logits[0]
        for i in range(n):
            path = torch.nonzero(anc[i]).flatten()
            c = model.new_cache(64)
            model(ctx, torch.arange(9)[None], c, logits_for="none")
            for j, node in enumerate(path.tolist()):
                out = model(tokens[:, node:node + 1], torch.tensor([[9 + j]]), c)
            assert torch.equal(out.logits[0, -1], tree[i]), f"node {i}"
