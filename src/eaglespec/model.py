"""The target transformer (Llama family) in plain PyTorch, and the decoder layer the draft reuses.

The model is only the model: `forward(tokens, positions, cache, mask)` scores new tokens against
the KV cache and returns logits and features. It knows nothing about generation or trees; a tree
is just a set of new tokens with shared positions and a mask.

Weights are stored fused (q|k|v in one matrix, gate|up in another) so that one decode step is
four matrix products per layer; `weights.py` owns the mapping from checkpoint names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .config import ModelConfig
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation; bf16 variance loses digits.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s is not None:
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        scaled = torch.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
        inv = scaled
    return inv.float()


class Rotary(nn.Module):
    """cos/sin tables indexed by explicit position ids (tree nodes share positions)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, 1, T, head_dim]
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, nh, T, hd]; rotate-half layout (Hugging Face's, not llama.cpp's interleaved one)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv) * self.hd
        self.wqkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        layer: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(b, t, self.n_heads, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = k.view(b, t, self.n_kv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:  # training: the whole sequence at once, nothing to keep
            k_all, v_all = k, v
        else:
            k_all, v_all = cache.write(layer, k, v)  # [B, nkv, S, hd], S = cached + T
        y = attend(q, k_all, v_all, mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.inter, dim=-1)
        return self.w_down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. The EAGLE-1/2 draft uses it without the input norm."""

    def __init__(self, cfg: ModelConfig, input_norm: bool = True) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache: KVCache | None, layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T_out, V] (T_out: see `logits_for`)
    features: torch.Tensor  # [B, T, H] hidden state entering the LM head (after the final norm)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer i -> [B, T, H] entering it


def causal_mask(cached: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, cached + T] bool: new token i sees every cached slot and new tokens <= i."""
    cols = torch.arange(cached + t, device=device)
    rows = torch.arange(t, device=device)[:, None] + cached
    return cols[None, :] <= rows


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.quant = "none"  # the --quant mode its linears run in (quant.quantize_model)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, batch_size, self.dtype, self.device)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        logits_for: str | torch.Tensor = "all",
        hidden_layers: tuple[int, ...] = (),
    ) -> ModelOutput:
        """Score new tokens against the cache and append their keys/values to it.

        tokens, positions: [B, T]. mask: bool [T, S] or [B, T, S] over S = cache.length + T
        slots (True = may attend); None = causal. logits_for: "all", "last", "none", or index
        tensor [K] of new-token rows (the LM head is a fifth of a small model's cost, so the
        decode loop asks only for the rows it needs).
        """
        b, t = tokens.shape
        if mask is None:
            # One new token attends to everything: no mask lets SDPA take its fastest path.
            mask = None if t == 1 else causal_mask(cache.length, t, tokens.device)
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [B, 1, T, S] broadcast over heads
        cos, sin = self.rotary(positions, self.dtype)
        x = self.embed(tokens)  # [B, T, H]
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                hidden[i] = x
            x = layer(x, cos, sin, cache, i, mask)
        cache.advance(t)
        feats = self.norm(x)
        if isinstance(logits_for, torch.Tensor):
            logits = self.lm_head(feats[:, logits_for])
        elif logits_for == "all":
            logits = self.lm_head(feats)
        elif logits_for == "last":
            logits = self.lm_head(feats[:, -1:])
        elif logits_for == "none":
            logits = feats.new_empty(b, 0, self.config.vocab_size)
        else:
            raise ValueError(f"logits_for must be 'all', 'last', 'none' or an index tensor, got {logits_for!r}")
        return ModelOutput(logits=logits, features=feats, hidden=hidden)
