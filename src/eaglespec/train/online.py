"""Features computed inside the training loop (no dump): for disks too small for a dump, or
for a single pass over data that would be read only once anyway."""

from __future__ import annotations

import torch

from ..model import Transformer
from .data import TokenizedSample
from .features import target_features


class OnlineStore:
    """Same interface as loop.SampleStore; runs the target on demand (one sample at a time)."""

    def __init__(self, target: Transformer, samples: list[TokenizedSample]) -> None:
        self.target, self.samples = target, samples

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, i: int) -> int:
        return len(self.samples[i])

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.samples[i]
        feats, _ = target_features(self.target, s.input_ids)
        return (torch.tensor(s.input_ids, dtype=torch.long), feats.to(torch.bfloat16).cpu(),
                torch.tensor(s.loss_mask, dtype=torch.bool))
