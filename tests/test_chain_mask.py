"""attention.ChainMask: the training-time test's attention pattern, computed by query chunks over
only the keys each chunk can see, equals SDPA over every key with the dense mask (values and
gradients); the pattern is the one documented; bad shapes are refused."""

import pytest
import torch
import torch.nn.functional as F

from eaglespec import attention
from eaglespec.attention import ChainMask


def test_dense_pattern_is_the_documented_one():
    # t = 5, step 2: query p sees real pairs 0..p-2, then key p-1 of block 1 and key p of block 2
    m = ChainMask(5, 2).dense()
    assert m.shape == (5, 15)
    for p in range(5):
        seen = set(m[p].nonzero().flatten().tolist())
        want = set(range(0, p - 1)) | ({5 + p - 1} if p >= 1 else set()) | {10 + p}
        assert seen == want, p


@pytest.mark.parametrize("t, step, chunk", [(7, 1, 128), (7, 3, 2), (13, 2, 4), (3, 3, 2), (40, 3, 16), (9, 2, 9)])
def test_chunked_attention_equals_the_dense_mask(monkeypatch, t, step, chunk):
    monkeypatch.setattr(attention, "CHAIN_CHUNK", chunk)
    g = torch.Generator().manual_seed(t * 10 + step)
    b, nh, nkv, hd = 2, 6, 2, 8  # grouped heads, as the heads train
    q = torch.randn(b, nh, t, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, nkv, (step + 1) * t, hd, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, nkv, (step + 1) * t, hd, generator=g, dtype=torch.float64, requires_grad=True)
    mask = ChainMask(t, step)
    fast = mask.attend(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=True)
    torch.testing.assert_close(fast, ref)
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for a, r in zip(torch.autograd.grad(fast, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, r)
    # a key no query sees changes nothing: block 1's key t-1 belongs to query t+step-2, past the end
    if step > 1:
        k2 = k.detach().clone()
        k2[:, :, 2 * t - 1] += 100.0
        torch.testing.assert_close(mask.attend(q.detach(), k2, v.detach()), fast.detach())


def test_attend_routes_a_chain_mask_and_refuses_wrong_shapes():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 12, 8)
    out = attention.attend(q, k, k, ChainMask(4, 2), exact=False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, k, attn_mask=ChainMask(4, 2).dense()))
    with pytest.raises(ValueError, match="needs 4 queries over 12 keys"):
        ChainMask(4, 2).attend(q, k[:, :, :8], k[:, :, :8])
    with pytest.raises(ValueError, match="step >= 1"):
        ChainMask(4, 0).attend(q, k[:, :, :4], k[:, :, :4])
