"""Temperature / top-k / top-p as pure functions on logits.

The same `probabilities` feeds vanilla sampling and speculative verification, which is what
makes speculative sampling match plain sampling: both draw from exactly this distribution.
"""

from __future__ import annotations

import torch

from .config import SamplingConfig


def cpu_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor | None:
    """softmax(logits / temperature) in fp32 by the CPU kernel (csrc/sampling.cpp), or None where
    it does not take the call (another device, another dtype, no kernel). logits [B, ..., V],
    temperature [B] fp32 > 0. Every temperature-only distribution on a CPU comes from here, so
    plain sampling and speculative verification use the same bits; torch's softmax elsewhere."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float32) or logits.dim() < 2:
        return None
    from .kernels import ops_kernel

    ops = ops_kernel()
    return None if ops is None else ops.softmax_rows(logits, temperature)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> the sampling distribution [..., V] in fp32 (temperature > 0)."""
    if not cfg.top_k and cfg.top_p >= 1.0:
        p = cpu_softmax(logits.reshape(1, -1, logits.shape[-1]), torch.tensor([float(cfg.temperature)]))
        if p is not None:
            return p.view(logits.shape)
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = sorted_x.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop_sorted = (p.cumsum(-1) - p) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """logits [V] -> token id: argmax when greedy, else a draw from `probabilities`."""
    if cfg.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits, cfg), generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
