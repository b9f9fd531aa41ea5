"""Per-row sampling parameters and the batched sampling distribution.

`row_probabilities` is `eaglespec.sampling.probabilities` with temperature, top-k and top-p
given per row: a request in a batch gets exactly the distribution it would get alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..config import SamplingConfig
from ..sampling import cpu_softmax


@dataclass
class RowSampling:
    temperature: torch.Tensor  # [B] fp32; 0 = greedy
    top_k: torch.Tensor  # [B] long; 0 = no top-k filter
    top_p: torch.Tensor  # [B] fp32; 1 = no top-p filter
    seed: torch.Tensor  # [B] int64: the request's seed (random numbers are drawn per seed, step, node)
    # Host-side summaries, so the step picks its code path without reading the tensors back.
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_configs(cls, configs: list[SamplingConfig], device: torch.device | str = "cpu") -> "RowSampling":
        """One row per config; a config without a seed gets a fresh random one."""
        seeds = [c.seed if c.seed is not None else random.getrandbits(62) for c in configs]
        return cls(
            temperature=torch.tensor([float(c.temperature) for c in configs], dtype=torch.float32, device=device),
            top_k=torch.tensor([int(c.top_k) for c in configs], dtype=torch.long, device=device),
            top_p=torch.tensor([float(c.top_p) for c in configs], dtype=torch.float32, device=device),
            seed=torch.tensor([s & ((1 << 63) - 1) for s in seeds], dtype=torch.long, device=device),
            all_greedy=all(c.greedy for c in configs),
            any_greedy=any(c.greedy for c in configs),
            any_top_k=any(c.top_k for c in configs),
            any_top_p=any(c.top_p < 1.0 for c in configs),
        )

    @property
    def greedy(self) -> torch.Tensor:
        """[B] bool."""
        return self.temperature == 0

    @property
    def sampling_temperature(self) -> torch.Tensor:
        """[B] fp32: the temperature distributions are taken at (greedy rows as 1)."""
        return torch.where(self.temperature > 0, self.temperature, 1.0)


def row_probabilities(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """logits [B, ..., V] -> fp32 sampling distributions [B, ..., V] under each row's settings.

    Greedy rows (temperature 0) come out as temperature 1: callers use argmax for them.
    Temperature-only rows on a CPU: one kernel call (sampling.cpu_softmax), the bits every CPU
    sampling path draws from.
    """
    temp = s.sampling_temperature
    if not (s.any_top_k or s.any_top_p):
        p = cpu_softmax(logits, temp)
        if p is not None:
            return p
    shape = (-1,) + (1,) * (logits.dim() - 1)
    temp = temp.view(shape)
    x = logits.float() / temp
    if s.any_top_k or s.any_top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        drop_sorted = torch.zeros_like(sorted_x, dtype=torch.bool)
        if s.any_top_k:
            k = s.top_k.view(shape)
            use = k > 0
            kth = torch.gather(sorted_x, -1, (k.clamp(min=1) - 1).expand(*x.shape[:-1], 1))
            drop_sorted |= use & (sorted_x < kth)
        if s.any_top_p:
            kept = sorted_x.masked_fill(drop_sorted, float("-inf"))
            p = kept.softmax(-1)
            # Drop a token when the mass before it already reaches top_p; the first always stays.
            drop_sorted |= (s.top_p.view(shape) < 1.0) & ((p.cumsum(-1) - p) >= s.top_p.view(shape))
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)
