"""csrc's bf16 CPU ops (eaglespec.kernels.ops_kernel): the decode attention
(attention.kernel_attention), RMSNorm and RoPE the target runs at inference. Accurate against
fp32 / torch references, row-invariant over batch rows, heads, masks and cache views
(test_row_invariance.py checks trees and the whole model), and optional: with EAGLESPEC_KERNELS=0
the torch ops take their place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglespec.attention import attend, grouped_attention, kernel_attention
from eaglespec.kernels import attention_amx, ops_kernel
from eaglespec.model import RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(ops_kernel() is None, reason="the attention kernel could not be built here")


@pytest.fixture(params=["vector", "amx"])
def path(request, monkeypatch):
    """Each attention test runs on both of the kernel's implementations (AMX where the CPU has it)."""
    monkeypatch.setenv("EAGLESPEC_AMX", "1" if request.param == "amx" else "0")
    if request.param == "amx" and not attention_amx():
        pytest.skip("no AMX-BF16 tiles here")
    return request.param


def reference(q, k, v, mask):
    """fp32 softmax attention of the bf16 inputs (mask [B, T, S] or None)."""
    g = q.shape[1] // k.shape[1]
    m = None if mask is None else mask[:, None]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                          v.float().repeat_interleave(g, 1), attn_mask=m)


@pytest.mark.parametrize("b,nh,nkv,t,s,hd", [(1, 9, 3, 1, 1, 64), (1, 9, 3, 1, 513, 64), (2, 4, 4, 7, 100, 128),
                                             (3, 8, 2, 16, 40, 256), (1, 4, 1, 64, 300, 16)])
def test_matches_fp32_reference(b, nh, nkv, t, s, hd, path):
    g = torch.Generator().manual_seed(s + hd)
    q = torch.randn(b, nh, t, hd, generator=g).bfloat16()
    # keys and values as the cache holds them: views into a longer buffer
    k, v = (torch.randn(b, nkv, s + 9, hd, generator=g).bfloat16()[:, :, :s] for _ in range(2))
    mask = torch.rand(b, t, s, generator=g) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    for m in (None, mask):
        got = kernel_attention(q, k, v, None if m is None else m[:, None])
        # bf16 output: half an ulp (2^-9 relative) of rounding, plus fp32 sums
        torch.testing.assert_close(got.float(), reference(q, k, v, m), atol=1e-2, rtol=8e-3)


def test_rows_heads_and_batch_rows_are_independent(path):
    """Each (row, head, token) alone over its visible keys compacted gives the same bits."""
    g = torch.Generator().manual_seed(0)
    b, nh, nkv, t, s, hd = 2, 6, 2, 5, 70, 64
    q = torch.randn(b, nh, t, hd, generator=g).bfloat16()
    k, v = (torch.randn(b, nkv, s, hd, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(b, t, s, generator=g) < 0.5
    mask[..., 3] = True
    full = kernel_attention(q, k, v, mask[:, None])
    for i in range(b):
        for j in range(t):
            vis = mask[i, j].nonzero().flatten()
            alone = kernel_attention(q[i:i + 1, :, j:j + 1], k[i:i + 1, :, vis], v[i:i + 1, :, vis], None)
            assert torch.equal(alone, full[i:i + 1, :, j:j + 1]), (i, j)


@pytest.mark.parametrize("contexts", [(37, 37), (64, 50), (100, 3), (16, 0)])
def test_tokens_sharing_a_context_are_each_the_same_bits_alone(contexts, path):
    """The kernel loads the context every token of a row sees once for all of them (a tree over a
    long context); each token's output must still equal that token alone over its keys. Rows with
    different context lengths (not multiples of 16), a token that sees less, and tree nodes."""
    g = torch.Generator().manual_seed(sum(contexts))
    b, nh, nkv, t, hd = len(contexts), 9, 3, 9, 64
    s = max(contexts) + t + 5
    q = torch.randn(b, nh, t, hd, generator=g).bfloat16()
    k, v = (torch.randn(b, nkv, s, hd, generator=g).bfloat16() for _ in range(2))
    mask = torch.zeros(b, t, s, dtype=torch.bool)
    for i, ctx in enumerate(contexts):
        mask[i, :, :ctx] = True
        for j in range(t):  # node j's ancestors in a binary tree, then itself
            a = j
            while True:
                mask[i, j, ctx + a] = True
                if a == 0:
                    break
                a = (a - 1) // 2
    if contexts[0] > 20:
        mask[0, 4, 18] = False  # a hole in one token's context: the part all tokens share ends there
    full = kernel_attention(q, k, v, mask[:, None])
    for i in range(b):
        for j in range(t):
            vis = mask[i, j].nonzero().flatten()
            alone = kernel_attention(q[i:i + 1, :, j:j + 1], k[i:i + 1, :, vis], v[i:i + 1, :, vis], None)
            assert torch.equal(alone, full[i:i + 1, :, j:j + 1]), (i, j)


def test_a_two_dimensional_mask_is_shared_by_the_batch(path):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 6, 32, generator=g).bfloat16()
    k, v = (torch.randn(3, 2, 20, 32, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(6, 20, generator=g) < 0.5
    mask[:, 0] = True
    assert torch.equal(kernel_attention(q, k, v, mask), kernel_attention(q, k, v, mask.expand(3, 1, 6, 20)))


def test_the_two_implementations_differ_only_in_rounding(monkeypatch):
    """Where the CPU has AMX-BF16, kernel_attention takes the tile path unless EAGLESPEC_AMX=0;
    the two compute different bits (bf16 weights on tiles) within the accuracy both are held to,
    and the tile path refuses a head_dim it cannot take."""
    if not attention_amx():
        pytest.skip("no AMX-BF16 tiles here")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 9, 9, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 3, 300, 64, generator=g).bfloat16() for _ in range(2))
    tiles = kernel_attention(q, k, v, None)
    monkeypatch.setenv("EAGLESPEC_AMX", "0")
    vector = kernel_attention(q, k, v, None)
    assert not torch.equal(tiles, vector)
    torch.testing.assert_close(tiles.float(), vector.float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="head_dim a multiple of 32"):
        ops_kernel().decode_attention(q[..., :48], k[..., :48], v[..., :48], None, 0.125, True)


def test_calls_it_cannot_take_go_elsewhere(monkeypatch):
    q = torch.randn(1, 2, 1, 24).bfloat16()  # head_dim not a multiple of 16
    k = v = torch.randn(1, 2, 5, 24).bfloat16()
    assert kernel_attention(q, k, v, None) is None
    assert kernel_attention(q.float(), k.float(), v.float(), None) is None
    torch.testing.assert_close(attend(q, k, v, None).float(), reference(q, k, v, None), atol=1e-2, rtol=1e-2)
    # EAGLESPEC_KERNELS=0: the torch ops, the same answer to bf16 rounding
    monkeypatch.setenv("EAGLESPEC_KERNELS", "0")
    assert ops_kernel() is None
    q, k, v = torch.randn(1, 4, 1, 64).bfloat16(), torch.randn(1, 2, 9, 64).bfloat16(), torch.randn(1, 2, 9, 64).bfloat16()
    assert torch.equal(attend(q, k, v, None), grouped_attention(q, k, v, None))


def test_rms_norm_and_rope_match_torch():
    """Within a bf16 rounding of the torch ops (their sums run in another order; rope is computed
    in fp32 and rounded once instead of three times)."""
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(576, 1e-5).bfloat16()
    norm.weight.data = (1 + torch.randn(576, generator=g) * 0.2).bfloat16()
    x = (torch.randn(3, 5, 576, generator=g) * 3).bfloat16()
    qkv = torch.randn(2, 7, 16 * 64, generator=g).bfloat16()
    q = qkv.view(2, 7, 16, 64).transpose(1, 2)  # a strided view, as the attention passes it
    pos = torch.arange(7)[None].expand(2, 7) + 40
    freqs = pos.float()[..., None] / 10000 ** (torch.arange(0, 64, 2) / 64)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().bfloat16()[:, None], emb.sin().bfloat16()[:, None]
    want_norm, want_rope = norm(x), apply_rotary(q, cos, sin)  # grad enabled: torch's ops
    with torch.no_grad():
        got_norm, got_rope = norm(x), apply_rotary(q, cos, sin)
    assert got_norm.shape == want_norm.shape and got_rope.shape == want_rope.shape
    torch.testing.assert_close(got_norm.float(), want_norm.float(), rtol=8e-3, atol=1e-3)
    # rope rounds once: within half a bf16 ulp of the fp32 result (torch's three roundings can
    # land a few ulps away where the two products nearly cancel)
    qf, half = q.float(), 32
    exact = qf * cos.float() + torch.cat([-qf[..., half:], qf[..., :half]], -1) * sin.float()
    torch.testing.assert_close(got_rope.float(), exact, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(want_rope.float(), exact, rtol=0.1, atol=0.02)
    assert not torch.equal(got_norm, want_norm) or not torch.equal(got_rope, want_rope), "the kernels did not run"


def test_rope_rounds_to_nearest_even_bit_for_bit():
    """The kernels' vector rounding to bf16 (vec.h bf16_bits) is torch's, ties and infinities
    included: rope's fp32 result (no fused multiply-adds) rounded by torch equals the kernel's bits.
    NaN stays NaN (the kernel writes c10's 0x7fc0; torch's vector path keeps the payload)."""
    if ops_kernel() is None:
        pytest.skip("the ops kernel could not be built here")
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 40, 64, generator=g).bfloat16()
    q[0, 0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    # cos = 1, sin = 0 on the first positions: outputs are the inputs' exact fp32 products, so
    # values exactly between two bf16 numbers (ties) come from the 2^-9-scaled tables below
    cos = torch.randn(1, 1, 40, 64, generator=g).bfloat16()
    sin = torch.randn(1, 1, 40, 64, generator=g).bfloat16()
    cos[..., :8, :] = 1 + 2 ** -7
    sin[..., :8, :] = 0
    got = ops_kernel().rope(q, cos, sin)
    qf, cf, sf = q.float(), cos.float(), sin.float()
    x1, x2 = qf[..., :32], qf[..., 32:]
    want = torch.cat([x1 * cf[..., :32] - x2 * sf[..., :32], x2 * cf[..., 32:] + x1 * sf[..., 32:]], -1).bfloat16()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) == 4  # the NaN input twice, inf * sin 0 twice
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_pinned_ops_read_the_environment_once(monkeypatch):
    """Inside kernels.pinned_ops() (a model forward), ops_kernel() keeps its answer from entry;
    outside, EAGLESPEC_KERNELS=0 takes effect at the next call."""
    from eaglespec import kernels

    monkeypatch.delenv("EAGLESPEC_KERNELS", raising=False)
    first = ops_kernel()
    with kernels.pinned_ops():
        monkeypatch.setenv("EAGLESPEC_KERNELS", "0")
        assert ops_kernel() is first
    assert ops_kernel() is None


def test_a_compiler_without_amx_still_builds_the_vector_paths(monkeypatch):
    """On an AMX CPU the ops build asks for the AMX flags; when that build fails (a compiler that
    cannot target AMX), the ops are built again without them instead of falling back to torch."""
    from eaglespec import kernels

    tried = []

    def fake_build(name, sources, flags):
        tried.append(flags)
        if "-mamx-tile" in flags:
            raise RuntimeError("error: unrecognized command-line option '-mamx-tile'")
        return "module"

    monkeypatch.delenv("EAGLESPEC_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_build", fake_build)
    monkeypatch.setattr(kernels, "cpu_features", lambda: {"avx512_f", "amx_tile", "amx_bf16", "avx512_bf16"})
    assert kernels.ops_kernel() == "module"
    assert "-mamx-tile" in tried[0] and "-mamx-tile" not in tried[1] and "-mavx512f" in tried[1]


def test_silu_mul_matches_torch_and_is_what_the_mlp_runs():
    """silu(gate) * up with torch's two roundings: the same bits on these inputs (the sigmoid comes
    from our exp, within an fp32 ulp or two of torch's, which bf16 rounding absorbs), row by row."""
    from eaglespec.config import ModelConfig
    from eaglespec.model import MLP

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 9, 2 * 1536, generator=g) * 4).bfloat16()
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0]).bfloat16()  # zero, and exp(-|x|) underflowing
    gate, up = x.split(1536, dim=-1)
    got = ops_kernel().silu_mul(x)
    assert got.shape == (4, 9, 1536)
    assert torch.equal(got, F.silu(gate) * up)
    assert torch.equal(ops_kernel().silu_mul(x[2:3, 4:5]), got[2:3, 4:5])  # a row alone: the same bits
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32)
    mlp = MLP(cfg).bfloat16()
    calls = []
    real = ops_kernel().silu_mul
    with torch.no_grad():
        want = mlp.w_down(F.silu(mlp.w_gate_up(x[..., :64])[..., :96]) * mlp.w_gate_up(x[..., :64])[..., 96:])
        import eaglespec.model as model_mod

        class Spy:
            def __getattr__(self, name):
                return getattr(ops_kernel(), name)

            def silu_mul(self, t):
                calls.append(t.shape)
                return real(t)

        orig = model_mod.ops_kernel
        model_mod.ops_kernel = lambda: Spy()
        try:
            out = mlp(x[..., :64])
        finally:
            model_mod.ops_kernel = orig
    assert calls == [(4, 9, 192)] and torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 37, 8192, 49152])
def test_argmax_rows_is_torch_argmax(dtype, width):
    """The first maximum on ties, in the vector lanes, across lanes and in the tail; any shape."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(3, 6, width, generator=g).to(dtype)
    x[0, 0] = 1.0  # every column ties: 0
    if width > 20:
        x[0, 1, [3, 19, width - 1]] = 50.0  # ties in one lane, then the tail
        x[0, 2, [17, 2]] = 50.0  # ties across lanes: the lower column
        x[0, 3, width - 1] = 60.0  # the maximum in the tail alone
    got = ops_kernel().argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(-1))
    assert torch.equal(ops_kernel().argmax_rows(x[1, 2:3]), got[1, 2:3])


def test_argmax_rows_never_picks_nan_and_greedy_verification_uses_it(monkeypatch):
    from eaglespec.spec.verify import greedy_tokens

    x = torch.tensor([[1.0, float("nan"), 3.0, 2.0] * 8, [float("nan")] * 32])
    assert ops_kernel().argmax_rows(x).tolist() == [2, 0]
    logits = torch.randn(2, 5, 1000).bfloat16()
    assert torch.equal(greedy_tokens(logits), logits.float().argmax(-1))
    monkeypatch.setenv("EAGLESPEC_KERNELS", "0")  # the torch op, the same answer
    assert torch.equal(greedy_tokens(logits), logits.float().argmax(-1))


def test_draft_attention_takes_the_kernel_at_inference_and_flash_under_autograd(monkeypatch):
    """exact=False (draft heads): our kernel outside autograd (fastest at drafting sizes), the flash
    kernel while training, so gradients flow."""
    q = torch.randn(1, 4, 3, 64).bfloat16()
    k, v = torch.randn(1, 2, 20, 64).bfloat16(), torch.randn(1, 2, 20, 64).bfloat16()
    mask = torch.rand(1, 1, 3, 20) < 0.7
    mask[..., 0] = True
    with torch.no_grad():
        got = attend(q, k, v, mask, exact=False)
    assert torch.equal(got, kernel_attention(q, k, v, mask))
    qg = q.clone().requires_grad_()
    out = attend(qg, k, v, mask, exact=False)
    assert out.requires_grad
    torch.testing.assert_close(out.detach().float(), got.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,k", [(8192, 4), (8192, 1), (37, 5), (16, 16), (49152, 10)])
def test_topk_logprobs_is_log_softmax_then_topk(dtype, width, k):
    """Drafting's top-k: log_softmax's values (to a few fp32 ulps), the same tokens; equal logits
    (frequent in bf16) rank by index, lower first, where torch's order is unspecified."""
    g = torch.Generator().manual_seed(width + k)
    x = (torch.randn(3, 4, width, generator=g) * 3).to(dtype)
    x[0, 0, [9, 5]] = 50.0
    vals, idx = ops_kernel().topk_logprobs(x, k)
    want_vals, want_idx = F.log_softmax(x.float(), dim=-1).topk(k, dim=-1)
    assert vals.dtype == torch.float32 and idx.dtype == torch.long and idx.shape == (3, 4, k)
    torch.testing.assert_close(vals, want_vals, atol=1e-5, rtol=1e-6)
    picked = x.gather(-1, idx)
    assert torch.equal(picked, x.gather(-1, want_idx))  # the same values: any difference is a tie
    assert bool(((picked[..., 1:] < picked[..., :-1]) | (idx[..., 1:] > idx[..., :-1])).all())
    assert idx[0, 0, :2].tolist() == [5, 9][:k]
    v1, i1 = ops_kernel().topk_logprobs(x[1, 2:3], k)  # a row alone: the same bits
    assert torch.equal(v1, vals[1, 2:3]) and torch.equal(i1, idx[1, 2:3])


@pytest.mark.parametrize("rows,t", [(1, 1), (1, 7), (3, 5)])
def test_qkv_rope_write_is_the_separate_steps_bit_for_bit(rows, t, monkeypatch):
    """The attention layer's split + RoPE + cache write in one call: the same output and the same
    cache contents as the separate steps, for one row and for rows (a row slice of a larger cache)."""
    from eaglespec.config import ModelConfig
    from eaglespec.kv_cache import RowKVCache, row_attention_mask
    from eaglespec.model import Attention, Rotary

    cfg = ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32)
    g = torch.Generator().manual_seed(rows * 10 + t)
    attn = Attention(cfg).bfloat16()
    for p in attn.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.2).bfloat16()
    x = torch.randn(rows, t, 128, generator=g).bfloat16()
    committed = torch.tensor([3, 9, 0][:rows])
    slots = committed[:, None] + torch.arange(t)
    cos, sin = Rotary(cfg)(slots, torch.bfloat16)
    mask = row_attention_mask(committed, committed, torch.ones(rows, t, t, dtype=torch.bool).tril(), 20)[:, None]

    start = (torch.arange(2 * (rows + 1) * 2 * 24 * 32) % 7).view(2, rows + 1, 2, 24, 32).bfloat16()

    def run(fused: bool):
        cache = RowKVCache(2, 2, 32, 24, rows + 1, torch.bfloat16)
        cache.k.copy_(start)
        cache.v.copy_(start * 2)
        view = cache.rows(1, rows + 1)  # strided rows of a larger cache
        view.prepare(slots, 20)
        if not fused:
            monkeypatch.setattr(RowKVCache, "write_rotated", lambda *a: None)
        with torch.no_grad():
            out = attn(x, cos, sin, view, 1, mask)
        monkeypatch.undo()
        return out, cache

    (a, ca), (b, cb) = run(True), run(False)
    assert torch.equal(a, b) and torch.equal(ca.k, cb.k) and torch.equal(ca.v, cb.v)
    written = torch.zeros(2, rows + 1, 2, 24, 32, dtype=torch.bool)
    for r in range(rows):
        written[1, r + 1, :, slots[r]] = True
    assert bool((ca.k != start)[~written].logical_not().all()) and bool((ca.k != start)[written].any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keep_rows_is_the_indexed_copy(dtype, monkeypatch):
    """RowKVCache.keep through the kernel (keep_rows) leaves both caches bit-equal to torch's
    indexed copy, padding entries (src[j] < j, written past the new length) included, on a
    row-sliced cache too."""
    from eaglespec.kv_cache import RowKVCache

    g = torch.Generator().manual_seed(3)
    paths = torch.tensor([[0, 0, 0, 0], [0, 2, 5, 6], [0, 1, 1, 1], [0, 3, 3, 3]])  # [B, D + 1]
    start = torch.tensor([4, 9, 0, 17])
    count = torch.tensor([1, 4, 2, 2])
    caches = []
    for kernels in ("1", "0"):
        monkeypatch.setenv("EAGLESPEC_KERNELS", kernels)
        c = RowKVCache(3, 2, 32, 40, 5, dtype)
        c.k.copy_(torch.randn(c.k.shape, generator=g.manual_seed(1)))
        c.v.copy_(torch.randn(c.v.shape, generator=g.manual_seed(2)))
        c.rows(1, 5).keep(start, paths, count)
        caches.append(c)
    (a, b) = caches
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.lengths, b.lengths)
    assert a.lengths.tolist() == [0, 5, 13, 2, 19]
    fresh = torch.randn(a.k.shape, generator=g.manual_seed(1)).to(dtype)
    assert torch.equal(a.k[:, 2, :, 9 + 1], fresh[:, 2, :, 9 + 2])  # the copy happened
    assert torch.equal(a.k[:, 0], fresh[:, 0])  # rows outside the slice untouched


def test_uniforms_kernel_is_the_torch_mixer_bit_for_bit(monkeypatch):
    from eaglespec.spec.rng import ACCEPT, DRAFT, uniforms

    g = torch.Generator().manual_seed(0)
    seed = torch.randint(-(1 << 62), 1 << 62, (5,), generator=g)
    seed[0] = (1 << 63) - 1  # extremes of the wrap-around arithmetic
    step = torch.randint(0, 1 << 40, (5,), generator=g)
    for node, purpose in ((torch.randint(0, 64, (5,), generator=g), ACCEPT),
                          (torch.randint(0, 64, (5, 7), generator=g), DRAFT)):
        got = uniforms(seed, step, node, purpose)
        monkeypatch.setenv("EAGLESPEC_KERNELS", "0")
        want = uniforms(seed, step, node, purpose)
        monkeypatch.delenv("EAGLESPEC_KERNELS")
        assert got.dtype == torch.float64 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_rows_is_torch_softmax_up_to_rounding(dtype):
    """softmax(x / T) per row (temperature per leading row): within fp32 rounding of torch's,
    exactly 0 for -inf logits and far below the maximum, and what the CPU sampling paths use."""
    from eaglespec.config import SamplingConfig
    from eaglespec.sampling import probabilities
    from eaglespec.spec.sampling import RowSampling, row_probabilities

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 2, 49157, generator=g) * 4).to(dtype)  # a width with a scalar tail
    x[0, 0, 5] = float("-inf")
    x[1, 1, 7] = 1000.0  # everything else underflows
    t = torch.tensor([1.0, 0.5, 1.7])
    got = ops_kernel().softmax_rows(x, t)
    want = torch.softmax(x.float() / t[:, None, None], -1)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-9)
    assert got[0, 0, 5] == 0 and got[1, 1, 7] == 1 and (got[1, 1] > 0).sum() == 1
    rows = RowSampling.from_configs([SamplingConfig(temperature=float(v)) for v in t])
    assert torch.equal(row_probabilities(x, rows), got)
    assert torch.equal(probabilities(x[2, 1], SamplingConfig(temperature=1.7)), got[2, 1])


def test_draw_rows_is_the_inverse_cdf(monkeypatch):
    """The kernel's draw picks torch's index (the sums round differently, so a u within ~1e-12 of a
    boundary could differ: none of these) and never a zero-mass token, even for u -> 1."""
    from eaglespec.spec.rng import draw

    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(64, 1000, generator=g) * 3, -1)
    probs[:, 990:] = 0  # mass ends early: u near 1 must not land past it
    probs[::2, 100:200] = 0
    probs = probs / probs.sum(-1, keepdim=True)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2 ** -53, 0.5, 1e-300], dtype=torch.float64)
    got = draw(probs, u)
    monkeypatch.setenv("EAGLESPEC_KERNELS", "0")
    want = draw(probs, u)
    assert torch.equal(got, want)
    assert (probs.gather(1, got[:, None]) > 0).all() and int(got[1]) == int((probs[1] > 0).nonzero().max())
