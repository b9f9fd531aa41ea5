"""Choosing a reduced draft vocabulary: the target tokens that training answers use most.

The draft can only propose tokens in its vocabulary, so every assistant token outside it is a
guaranteed rejection at that depth; `coverage` measures that share on held-out data.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .data import TokenizedSample


@dataclass
class DraftVocab:
    token_ids: torch.Tensor  # [Vd] sorted target ids
    train_coverage: float  # share of training assistant tokens inside the vocabulary


def _answer_tokens(samples: Iterable[TokenizedSample]) -> Counter:
    counts: Counter = Counter()
    for s in samples:
        counts.update(t for t, m in zip(s.input_ids, s.loss_mask) if m)
    return counts


def frequent_tokens(samples: Sequence[TokenizedSample], size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The `size` most frequent assistant tokens (ties broken by id), plus `always` (EOS ids)."""
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    counts = _answer_tokens(samples)
    keep = set(always)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        keep.add(tok)
    total = sum(counts.values())
    covered = sum(c for t, c in counts.items() if t in keep)
    return DraftVocab(torch.tensor(sorted(keep), dtype=torch.long), covered / max(1, total))


def coverage(vocab: torch.Tensor, samples: Sequence[TokenizedSample]) -> float:
    """Share of the samples' assistant tokens that the vocabulary holds."""
    counts = _answer_tokens(samples)
    inside = set(vocab.tolist())
    return sum(c for t, c in counts.items() if t in inside) / max(1, sum(counts.values()))


def widen_vocab(vocab: torch.Tensor, samples: Sequence[TokenizedSample], size: int, vocab_size: int,
                always: Iterable[int] = ()) -> torch.Tensor | None:
    """A larger draft vocabulary that keeps every id of `vocab` ([Vd] target ids): they, `always`
    and the most frequent other answer tokens of `samples`, up to `size` ids; None (the full
    vocabulary) when `size` reaches `vocab_size`."""
    if size >= vocab_size:
        return None
    if size < vocab.numel():
        raise ValueError(f"cannot narrow a draft vocabulary of {vocab.numel()} ids to {size}")
    return frequent_tokens(samples, size, [*vocab.tolist(), *always]).token_ids
