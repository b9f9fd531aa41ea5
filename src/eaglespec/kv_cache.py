"""Preallocated key/value cache shared by the target model and the draft head.

Slots are contiguous: slot i holds the i-th token that was kept. Position ids are separate
(a tree's nodes share positions), so the cache never needs to know about positions.

Life of one speculative step:
  forward(tree)  -> the tree's T entries are appended after `length` (append)
  compact(start, keep) -> the accepted path is moved to slots start.. and the rest dropped
  truncate(n)    -> drop everything after slot n (the draft does this after drafting)
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for every layer: [layers, B, n_kv_heads, max_len, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # slots in use, committed or pending

    @property
    def free(self) -> int:
        return self.max_len - self.length

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, n_kv, T, hd]) after `length`; return the views [B, n_kv, length+T, hd].

        `length` itself advances in `advance`, once all layers have written.
        """
        t = k.shape[2]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: {self.length} + {t} tokens > {self.max_len} slots; "
                "allocate a larger cache (max_new_tokens / context)"
            )
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, t: int) -> None:
        self.length += t

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (the data stays; it is overwritten later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def compact(self, start: int, keep: torch.Tensor | list[int]) -> None:
        """Keep slots start + keep[i] (relative, increasing) at slots start + i; drop the rest.

        Used after verification: `start` is the context length before the tree, `keep` the
        tree-node indices of the accepted path.
        """
        keep_t = torch.as_tensor(keep, dtype=torch.long, device=self.k.device)
        n = keep_t.numel()
        if n and (int(keep_t.max()) + start >= self.length or int(keep_t.min()) < 0):
            raise ValueError(f"compact: indices {keep_t.tolist()} outside the {self.length - start} new slots")
        src = keep_t + start
        # Identity prefix needs no copy (common: the root and a greedy chain).
        if not torch.equal(src, torch.arange(start, start + n, device=src.device)):
            # index_select copies first, so overlapping source/destination ranges are safe.
            self.k[:, :, :, start:start + n] = self.k.index_select(3, src)
            self.v[:, :, :, start:start + n] = self.v.index_select(3, src)
        self.length = start + n
