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

from . import kernels


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

    def slot_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Logical positions of the slots the next forward reads: [B, length + T].

        Kept slots are contiguous from position 0 (slot = position); the T new entries carry
        `positions` ([B, T]; tree nodes share them). Sliding-window layers mask by these.
        """
        b, t = positions.shape
        kept = torch.arange(self.length, device=positions.device).expand(b, -1)
        return torch.cat((kept, positions), dim=1)

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


class RowKVCache:
    """A KV cache for B independent rows: [layers, B, n_kv_heads, capacity, head_dim].

    Each row has its own committed length (`lengths`, [B] long, on the cache's device). Before a
    forward, `prepare(slots, view_len)` says where its T new entries go in every row ([B, T] slot
    ids) and how many leading slots attention reads; the caller's mask decides which of those a
    query may see. Writes are scatters, so a step's shapes depend only on (B, T, view_len): a
    CUDA graph can replay them with view_len fixed at the capacity.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, batch_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._slots: torch.Tensor | None = None  # [B, T] where the next forward writes
        self._rows: torch.Tensor | None = None  # [B, T] their row ids (for advanced indexing)
        self._view = 0
        self._views: tuple | None = None  # `layer_views`' per-forward views
        self._layers: tuple | None = None  # (self.k, self.k and self.v unbound by layer)

    @classmethod
    def _wrap(cls, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> "RowKVCache":
        c = cls.__new__(cls)
        c.k, c.v, c.lengths, c._slots, c._rows, c._view = k, v, lengths, None, None, 0
        c._views = c._layers = None
        return c

    @property
    def capacity(self) -> int:
        return int(self.k.shape[3])

    @property
    def batch_size(self) -> int:
        return int(self.k.shape[1])

    def rows(self, start: int, stop: int) -> "RowKVCache":
        """A cache over rows start..stop-1 that shares this one's storage (writes go through)."""
        return RowKVCache._wrap(self.k[:, start:stop], self.v[:, start:stop], self.lengths[start:stop])

    def prepare(self, slots: torch.Tensor, view_len: int) -> None:
        """The next forward writes new entry t of row b at slot slots[b, t] ([B, T]) and attends
        over slots [0, view_len)."""
        self.check_view(view_len)
        self._slots, self._view, self._views = slots, view_len, None
        self._rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)

    def check_view(self, view_len: int) -> None:
        """Refuse a forward that would attend over more slots than the cache holds."""
        if view_len > self.capacity:
            raise ValueError(f"KV cache overflow: {view_len} slots asked of a cache of {self.capacity}; "
                             "allocate a larger cache (max_new_tokens / context)")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter k, v ([B, n_kv, T, hd]) into the prepared slots; return [B, n_kv, view_len, hd] views."""
        assert self._slots is not None, "call prepare() before a forward"
        # Advanced indexing (index_put) rather than scatter_: several times faster on CPU.
        rows, slots = self._rows, self._slots  # [B, T] each
        if slots.shape[0] == 1:  # one row: index_copy_ is 3x faster still
            self.k[layer].index_copy_(2, slots[0], k)
            self.v[layer].index_copy_(2, slots[0], v)
        else:
            self.k[layer][rows, :, slots] = k.transpose(1, 2)  # [B, T, n_kv, hd]
            self.v[layer][rows, :, slots] = v.transpose(1, 2)
        return self.layer_views(layer)[2:]

    def write_rotated(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                      n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`write` fused with what precedes it, in one kernel call (csrc/norm_rope.cpp): qkv [B, T,
        (n_heads + 2 n_kv) hd] is split into heads, q and k rotated (cos, sin [B, 1, T, hd]) with
        the bits `apply_rotary` gives, k and v written at the prepared slots. Returns (q [B, n_heads,
        T, hd], the k and v views `write` returns), or None where the kernel does not take the call
        (not bf16 on a CPU, autograd on, head_dim not a multiple of 32, no kernel): then the caller
        runs the separate steps."""
        if not (self._rotated_write_ok(cos) and qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu"
                and qkv.stride(-1) == 1):
            return None
        ops = kernels.ops_kernel()
        if ops is None:
            return None
        assert self._slots is not None, "call prepare() before a forward"
        k_layer, v_layer, k_view, v_view = self.layer_views(layer)
        q = ops.qkv_rope_write(qkv, cos, sin, k_layer, v_layer, self._slots, n_heads, n_kv)
        return q, k_view, v_view

    def _rotated_write_ok(self, cos: torch.Tensor) -> bool:
        """Whether csrc/norm_rope.cpp's fused write takes this cache's writes: bf16 on a CPU, whole
        32-wide halves of head_dim, no autograd."""
        return (self.k.dtype == cos.dtype == torch.bfloat16 and self.k.device.type == "cpu"
                and self.k.shape[-1] % 32 == 0 and not torch.is_grad_enabled())

    def stack_views(self, cos: torch.Tensor, head_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """What csrc/layer_stack.cpp reads for the prepared forward: (k, v [L, B, n_kv, capacity,
        hd], slots [B, T], view_len), or None where `write_rotated` would decline (it writes the
        same way)."""
        if not (self._rotated_write_ok(cos) and self.k.shape[-1] == head_dim):
            return None
        assert self._slots is not None, "call prepare() before a forward"
        return self.k, self.v, self._slots, self._view

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values over the whole capacity ([B, n_kv, capacity, hd] each),
        then over the prepared view ([B, n_kv, view_len, hd] each). Views of every layer are made
        at once, once per prepared forward: sliced one layer at a time they cost about 1.4 ms of a
        30-layer decode on a 2-core EPYC (torch takes ~9 us per slice)."""
        if self._layers is None or self._layers[0] is not self.k:
            self._layers = (self.k, self.k.unbind(0), self.v.unbind(0))
        if self._views is None:
            view = self._view
            self._views = (self.k[:, :, :, :view].unbind(0), self.v[:, :, :, :view].unbind(0))
        return self._layers[1][layer], self._layers[2][layer], self._views[0][layer], self._views[1][layer]

    def advance(self, t: int) -> None:
        """Lengths move only when the step commits (after verification), not per forward."""

    def slot_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Logical positions of the slots the prepared forward reads: [B, view_len].

        Committed slots hold positions 0.. in order (slot = position); the prepared slots get
        `positions` ([B, T]). Other slots (stale tree entries) are masked out by the caller anyway.
        """
        assert self._slots is not None, "call prepare() before a forward"
        b = positions.shape[0]
        # Over the whole capacity: a prepared slot may lie past the view (an idle row's).
        pos = torch.arange(self.capacity, device=positions.device).expand(b, -1).clone()
        return pos.scatter_(1, self._slots, positions.to(pos.dtype))[:, : self._view]

    def keep(self, start: torch.Tensor, src: torch.Tensor, count: torch.Tensor) -> None:
        """Per row: move slots start + src[b, j] to start + j for j < count[b]; commit them.

        start, count: [B]; src: [B, D] relative slot ids, increasing along a row (so entry j
        never moves right and gathering before scattering handles overlaps). Entries j >= count
        are copied too (harmless: they land past the new committed length).
        """
        if self.k.device.type == "cpu" and self.k.stride(3) == self.k.shape[4]:
            ops = kernels.ops_kernel()
            if ops is not None:  # one call; rows already in place copy nothing (csrc/pointwise.cpp)
                ops.keep_rows(self.k, self.v, start, src)
                self.lengths.copy_(start + count)
                return
        self.keep_indexed(start, src, count)

    def keep_indexed(self, start: torch.Tensor, src: torch.Tensor, count: torch.Tensor) -> None:
        """`keep` by torch's indexed copy (any device)."""
        b, d = src.shape
        rows = torch.arange(b, device=src.device)[:, None].expand(b, d)
        frm = start[:, None] + src  # [B, D]
        to = start[:, None] + torch.arange(d, device=src.device)
        for t in (self.k, self.v):
            t[:, rows, :, to] = t[:, rows, :, frm]  # the read is a copy, so overlaps are safe
        self.lengths.copy_(start + count)

    def grow(self, capacity: int) -> None:
        """Reallocate to a larger capacity, keeping every row's entries."""
        if capacity <= self.capacity:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (capacity, old.shape[4]))
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)


def row_attention_mask(committed: torch.Tensor, start: torch.Tensor, ancestors: torch.Tensor,
                       view_len: int) -> torch.Tensor:
    """The mask of a forward over T new entries per row, against a block of W slots at start[b].

    committed [B]: slots [0, committed) are visible to every new entry. ancestors [B, T, W] bool:
    new entry i sees block slot start[b] + j iff ancestors[b, i, j]. The target's tree forward
    writes its T nodes as the block (W = T: a causal block for a chain, the ancestor mask for a
    tree); drafting passes its scratch slots (W = scratch). Returns [B, T, view_len] bool.
    """
    b, t, w = ancestors.shape
    cols = torch.arange(view_len, device=ancestors.device)[None]  # [1, S]
    rel = cols - start[:, None]  # [B, S] offset into the block
    in_block = (rel >= 0) & (rel < w)
    picked = torch.gather(ancestors, 2, rel.clamp(0, w - 1)[:, None, :].expand(b, t, view_len))
    return (cols < committed[:, None])[:, None, :] | (in_block[:, None, :] & picked)
