"""The head's readout loss against the target's distribution, fused and taken in row chunks.

For M scored positions the readout's logits are an [M, Vd] matrix (Vd = 12,288 for the shipped
head: 170 MB in fp32 at M = 3,500). Written as plain torch ops, the cross-entropy and the total
variation each allocate several such matrices, and on a CPU every fresh allocation of that size is
mapped and page-faulted anew: profiled on one core, those elementwise ops took ~40% of a TTT
step, as long as the matmuls. Here the logits live one chunk of rows at a time (a few MB, reused)
and the gradient of the scalar loss with respect to the readout input x (and the LM-head weight,
when it is trained) is formed in the same pass, so backward only scales it.

Per row, with q = softmax(z), z = x W^T, and p the target's distribution (rows sum to 1):
  CE  = -sum_j p_j log q_j                  dCE/dz = q - p
  TV  = 0.5 * sum_j |p_j - q_j|             dTV/dz = 0.5 * q * (s - sum_j s_j q_j),  s = sign(q - p)
(sign(0) = 0, as autograd's abs). The loss returned is w_cls * mean CE + w_tv * mean TV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 256  # rows per chunk on a CPU: a fixed matmul shape (oneDNN caches a primitive per shape), ~12 MB of logits
DEVICE_CHUNK = 4096  # on a GPU, where allocations are cached and small products leave it idle


@dataclass
class ReadoutLoss:
    loss: torch.Tensor  # w_cls * cls + w_tv * tv, differentiable in x (and w when it requires grad)
    cls: torch.Tensor  # mean cross-entropy to p, detached
    tv: torch.Tensor  # mean total variation 0.5 * sum|p - q| (one minus a sampled draft's acceptance), detached
    acc: torch.Tensor  # share of rows whose argmax is the target's (`top`), detached


def readout_loss(x: torch.Tensor, w: torch.Tensor, prob: torch.Tensor, top: torch.Tensor, rows: torch.Tensor | None,
                 w_cls: float, w_tv: float) -> ReadoutLoss:
    """x [M, H] the readout's input, w [Vd, H] the LM-head rows, prob [N, Vd] fp32 the target's
    distribution and top [N] its argmax; rows [M] long: which of prob's rows each x row is scored
    against (None: M == N, in order). The product runs in product_dtype(w)."""
    # inside forward grad mode is always off, and needs_input_grad holds even under no_grad
    grad = torch.is_grad_enabled()
    loss, cls, tv, acc = _Fused.apply(x, w, prob, top, rows, float(w_cls), float(w_tv), grad)
    return ReadoutLoss(loss, cls, tv, acc)


def product_dtype(w: torch.Tensor) -> torch.dtype:
    """The dtype a product with LM-head rows w runs in: w's own, except a bf16 w on a CPU without
    native bf16 matmul (a bf16 target there runs the integer kernels), which is multiplied in
    fp32: torch's emulated bf16 products made a TTT step 11x slower on an AVX2 EPYC (README,
    "Session 17")."""
    from ..api import cpu_has_native_bf16

    if w.dtype == torch.bfloat16 and w.device.type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return w.dtype


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, prob, top, rows, w_cls, w_tv, grad):
        m = x.shape[0]
        want_x, want_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        wm = w.to(product_dtype(w))
        cls_sum = torch.zeros((), dtype=torch.float64, device=x.device)
        tv_sum, hits = cls_sum.clone(), torch.zeros((), dtype=torch.long, device=x.device)
        gx = torch.empty(m, x.shape[1], dtype=torch.float32, device=x.device) if want_x else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=x.device) if want_w else None
        xm = x.detach().to(wm.dtype)
        chunk = CHUNK if x.device.type == "cpu" else DEVICE_CHUNK
        for a in range(0, m, chunk):
            n = min(chunk, m - a)
            xc = xm[a:a + n]
            # [chunk, Vd]: a padded last chunk keeps the one shape
            z = F.linear(F.pad(xc, (0, 0, 0, chunk - n)) if n < chunk else xc, wm)[:n].float()
            logq = z.log_softmax(-1)
            if rows is None:  # step 0 scores every row in order: views, no copies
                p, t = prob[a:a + n], top[a:a + n]  # [n, Vd], [n]
            else:
                p, t = prob.index_select(0, rows[a:a + n]), top.index_select(0, rows[a:a + n])
            # Rows summed in fp32, the rows' sums in fp64: a float64 sum of the whole [n, Vd] product
            # would first copy it to float64 (two such copies took 6% of a stage's head step).
            cls_sum += -(p * logq).sum(-1).sum(dtype=torch.float64)
            hits += (logq.argmax(-1) == t).sum()
            q = logq.exp_()  # logq is not needed past here
            diff = q - p
            tv_sum += 0.5 * diff.abs().sum(-1).sum(dtype=torch.float64)
            if not (want_x or want_w):
                continue
            g = diff * w_cls  # d(w_cls * CE)/dz
            if w_tv:
                s = diff.sign_()
                g += (s - (s * q).sum(-1, keepdim=True)).mul_(q).mul_(0.5 * w_tv)
            g = g.to(wm.dtype)  # [n, Vd]
            if want_x:
                gx[a:a + n] = torch.mm(g, wm).float()
            if want_w:
                gw += torch.mm(g.t(), xc).float()
        ctx.save_for_backward(gx, gw)
        ctx.m, ctx.x_dtype, ctx.w_dtype = m, x.dtype, w.dtype
        cls, tv = (cls_sum / m).float(), (tv_sum / m).float()
        acc = hits.float() / m
        ctx.mark_non_differentiable(cls, tv, acc)
        return w_cls * cls + w_tv * tv, cls, tv, acc

    @staticmethod
    def backward(ctx, g_loss, *_):
        gx, gw = ctx.saved_tensors
        scale = g_loss / ctx.m  # the loss is a mean over rows
        dx = None if gx is None else (gx * scale).to(ctx.x_dtype)
        dw = None if gw is None else (gw * scale).to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None
