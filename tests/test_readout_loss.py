"""The fused, chunked readout loss equals the plain torch formula in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglespec.train import readout_loss as rl


def plain(x, w, prob, top, rows, w_cls, w_tv):
    """The loss as plain autograd ops over the whole [M, Vd] matrix."""
    p = prob if rows is None else prob[rows]
    t = top if rows is None else top[rows]
    logq = F.linear(x, w).log_softmax(-1)
    cls = -(p * logq).sum(-1).mean()
    tv = 0.5 * (p - logq.exp()).abs().sum(-1).mean()
    acc = (logq.argmax(-1) == t).float().mean()
    return w_cls * cls + w_tv * tv, cls, tv, acc


def problem(m: int, n_prob: int, seed: int, vocab: int = 300, h: int = 24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    w = torch.randn(vocab, h, generator=g) * 0.5
    z = torch.randn(n_prob, vocab, generator=g) * 2
    return x, w, z.softmax(-1), z.argmax(-1)


@pytest.mark.parametrize("w_tv,train_w,subset", [(0.0, False, False), (0.5, False, True), (0.2, True, False),
                                                 (0.7, True, True)])
def test_value_and_gradients_equal_the_plain_formula(monkeypatch, w_tv, train_w, subset):
    monkeypatch.setattr(rl, "CHUNK", 64)  # several chunks and a padded last one
    n_prob = 230
    rows = torch.randperm(n_prob, generator=torch.Generator().manual_seed(1))[:150] if subset else None
    x, w, prob, top = problem(n_prob if rows is None else rows.numel(), n_prob, seed=3)
    if rows is not None:  # the target's argmax is reachable for some rows, so acc is not 0
        x[:40] = w[top[rows[:40]]] * 3
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_(train_w)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_(train_w)
    got = rl.readout_loss(xa, wa, prob, top, rows, 0.1, w_tv)
    want = plain(xb, wb, prob, top, rows, 0.1, w_tv)
    for a, b in zip((got.loss, got.cls, got.tv, got.acc), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert 0 < float(got.acc) < 1 if subset else True
    (got.loss * 3.0).backward()  # backward scales by the incoming gradient
    (want[0] * 3.0).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-7)
    if train_w:
        torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-4, atol=1e-7)
    else:
        assert wa.grad is None
    assert not (got.cls.requires_grad or got.tv.requires_grad or got.acc.requires_grad)


def test_tv_weight_zero_keeps_tv_out_of_the_gradient():
    x, w, prob, top = problem(40, 40, seed=4)
    grads = []
    for w_tv in (0.0, 1.0):
        xr = x.clone().requires_grad_()
        rl.readout_loss(xr, w, prob, top, None, 0.1, w_tv).loss.backward()
        grads.append(xr.grad)
    assert not torch.allclose(grads[0], grads[1])
    xr = x.clone().requires_grad_()
    plain(xr, w, prob, top, None, 0.1, 0.0)[0].backward()
    torch.testing.assert_close(grads[0], xr.grad, rtol=1e-4, atol=1e-7)


def test_no_gradient_work_without_grad(monkeypatch):
    x, w, prob, top = problem(30, 30, seed=5)
    products = []
    real = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a: products.append(1) or real(*a))
    x.requires_grad_()
    rl.readout_loss(x, w, prob, top, None, 0.1, 0.2)
    assert len(products) == 1  # the gradient's product (this test would see it)
    with torch.no_grad():
        got = rl.readout_loss(x, w, prob, top, None, 0.1, 0.2)
    assert not got.loss.requires_grad
    assert len(products) == 1  # none under no_grad
    torch.testing.assert_close(got.loss, plain(x, w, prob, top, None, 0.1, 0.2)[0].detach())
