"""Counter-based random numbers: a uniform per (request seed, step, node, purpose).

A request's draws then depend only on its own seed and progress, never on which other requests
share its batch or on how many draws they made (a shared torch.Generator would couple them).
The mixer is SplitMix64's finaliser on int64 tensors (wrap-around arithmetic), on any device.
"""

from __future__ import annotations

import torch

from ..kernels import ops_kernel

_MASK63 = (1 << 63) - 1

# Purposes: separate streams for the accept tests, the bonus / plain draws and sampled drafts
# (at most 3: a purpose shares the node's two low bits).
ACCEPT = 1
BONUS = 2
DRAFT = 3


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def uniforms(seed: torch.Tensor, step: torch.Tensor, node: torch.Tensor, purpose: int) -> torch.Tensor:
    """U[0, 1) in float64, one per element of `node`.

    seed, step: [B] int64; node: [B] or [B, K] int64 -> [B] or [B, K]. On a CPU one kernel call
    (csrc/sampling.cpp, the same bits).
    """
    if (node.device.type == "cpu" and node.dtype == seed.dtype == step.dtype == torch.long
            and node.dim() in (1, 2) and seed.shape == step.shape == node.shape[:1]):
        ops = ops_kernel()
        if ops is not None:
            return ops.uniforms_rows(seed, step, node, purpose)
    if node.dim() == 2:
        seed, step = seed[:, None], step[:, None]
    x = _mix(_mix(_mix(seed) ^ step) ^ (node * 4 + purpose))
    return _srl(x, 11).double() * (1.0 / (1 << 53))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V] (rows sum to ~1), u [B] -> token ids [B].

    Tokens with zero probability are never drawn, rounding included (the search runs over the
    cumulative sum and is clamped to the last token that has mass). On a CPU one kernel call
    (csrc/sampling.cpp, draw_rows) gives the same index: these ops took ~0.3 ms a row there."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 and probs.shape[1]:
        ops = ops_kernel()
        if ops is not None:
            return ops.draw_rows(probs, u.double())
    cdf = probs.double().cumsum(-1)
    target = u * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    last = (probs > 0).long().cumsum(-1).argmax(-1)  # last index with mass
    idx = torch.minimum(idx, last)
    # searchsorted may land on a zero-mass token only through equal cdf values; step forward.
    return torch.where(torch.gather(probs, 1, idx[:, None])[:, 0] > 0, idx, last)
