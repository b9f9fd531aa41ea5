"""Features computed inside the training loop (no dump): for disks too small for a dump, or
for a single pass over data that would be read only once anyway."""

from __future__ import annotations

import torch

from ..model import Transformer
from .data import TokenizedSample
from .features import target_features
from .loss import Sample


class OnlineStore:
    """Same interface as loop.SampleStore; runs the target on demand (one sample at a time)."""

    def __init__(self, target: Transformer, samples: list[TokenizedSample], input_layers: tuple[int, ...] = ()) -> None:
        self.target, self.samples, self.input_layers = target, samples, tuple(input_layers)

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, i: int) -> int:
        return len(self.samples[i])

    def get(self, i: int) -> Sample:
        s = self.samples[i]
        feats, hidden = target_features(self.target, s.input_ids, self.input_layers)
        inputs = torch.cat([hidden[k] for k in self.input_layers], -1).to(torch.bfloat16).cpu() if self.input_layers else None
        return Sample(torch.tensor(s.input_ids, dtype=torch.long), feats.to(torch.bfloat16).cpu(),
                      torch.tensor(s.loss_mask, dtype=torch.bool), inputs)
