"""The target transformer (Llama family) in plain PyTorch, and the decoder layer the draft reuses.

Families are the Llama block plus ModelConfig switches, each a small separate step: Qwen3/Gemma 3
q/k norms (`Attention.qk_norm`, before RoPE), Mixtral's sparse MoE MLP (`MoE`: a router and one
`MLP` of nn.Linear per expert), Gemma 3's sandwich norms, GeGLU, scaled embeddings, local RoPE and
sliding-window layers (`window_mask`, by logical position). Gemma's (1 + w) norms are stored as
plain RMSNorm weights: the loader adds the 1 (GGUF files already hold it).

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

from . import direct
from .attention import ChainMask, attend
from .config import ModelConfig
from .kernels import ops_kernel, pinned_ops
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels_apply(x) and self.weight.dtype == x.dtype and x.shape[-1] % 16 == 0:
            ops = ops_kernel()
            if ops is not None:  # one call for the 8 ops below (the same two roundings)
                return ops.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 like the reference implementation; bf16 variance loses digits.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 or linear scaling when configured.

    local: Gemma 3's sliding layers (base rope_local_theta, never scaled)."""
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = None if local else cfg.rope_scaling
    if s is not None and s.rope_type == "linear":
        inv = inv / s.factor  # position / factor
    elif s is not None:
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

    def __init__(self, cfg: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg, local), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, 1, T, head_dim]
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def cpu_kernels_apply(x: torch.Tensor) -> bool:
    """Whether csrc's bf16 CPU ops may take this call: inference only (they have no backward)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, nh, T, hd]; rotate-half layout (Hugging Face's, not llama.cpp's interleaved one)
    if cpu_kernels_apply(x) and x.shape[-1] % 32 == 0 and x.stride(-1) == 1 and cos.dtype == x.dtype:
        ops = ops_kernel()
        if ops is not None:  # one call for seven ops, computed in fp32 and rounded once
            return ops.rope(x, cos, sin)
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
        # Decode-shaped calls take the row-invariant kernel (attention.py); a draft head, which
        # only proposes, turns it off.
        self.exact_decode = True
        # Qwen3 / Gemma 3: RMSNorm over each head's query and key (before RoPE).
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Gemma's attention scale query_pre_attn_scalar**-0.5, folded into q so SDPA keeps its
        # default 1/sqrt(head_dim).
        pre = cfg.query_pre_attn_scalar
        self.q_scale = 1.0 if not pre or pre == self.hd else (self.hd / pre) ** 0.5

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, nh, T, hd], k [B, nkv, T, hd]: per-head norms and query scale (identity for Llama)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        layer: int,
        mask: torch.Tensor | ChainMask | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.wqkv(x)
        fused = None
        if cache is not None and self.q_norm is None and self.q_scale == 1.0 and hasattr(cache, "write_rotated"):
            fused = cache.write_rotated(layer, qkv, cos, sin, self.n_heads, self.n_kv)
        if fused is not None:  # split, RoPE and the cache write in one call, the same bits
            q, k_all, v_all = fused
        else:
            q, k_all, v_all = self._rotate_and_store(qkv, cos, sin, cache, layer)
        y = attend(q, k_all, v_all, mask, self.exact_decode)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))

    def _rotate_and_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                          layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, (nh + 2 nkv) hd] -> q [B, nh, T, hd] and every key/value so far [B, nkv, S, hd],
        as separate steps (q/k norms, RoPE, the cache write)."""
        b, t, _ = qkv.shape
        q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(b, t, self.n_heads, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = k.view(b, t, self.n_kv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = self.qk_norm(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:  # training: the whole sequence at once, nothing to keep
            return q, k, v
        return (q, *cache.write(layer, k, v))  # [B, nkv, S, hd], S = cached + T


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """Gated MLP: SwiGLU (Llama) or GeGLU with tanh-approximated GELU (Gemma)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = gelu_tanh if cfg.hidden_act == "gelu_pytorch_tanh" else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)
        if self.act is F.silu and cpu_kernels_apply(gate_up) and self.inter % 16 == 0:
            ops = ops_kernel()
            if ops is not None:  # one call for silu, split and multiply (the same two roundings)
                return self.w_down(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.w_down(self.act(gate) * up)


class MoE(nn.Module):
    """Mixtral's sparse MoE MLP: a linear router picks the top-k experts per token; their outputs
    are summed with the renormalised softmax weights (fp32 routing, as transformers does).

    Experts are ordinary `MLP`s (nn.Linear w_gate_up / w_down) in a ModuleList, so a pass that
    swaps nn.Linear for quantised modules covers them. Every token routes on its own hidden state
    only, so tree nodes (and batch rows) route independently of each other.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.num_experts))
        self.dense: bool | None = None  # run every expert on every token; None: on CUDA only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        probs = F.softmax(self.router(flat).float(), dim=-1)  # [N, E]
        weight, idx = probs.topk(self.top_k, dim=-1)  # [N, k]
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        if flat.is_cuda if self.dense is None else self.dense:
            # Data-dependent gathers would break CUDA graph capture: run every expert densely.
            dense = torch.zeros_like(probs).scatter_(1, idx, weight).to(flat.dtype)  # [N, E]
            for e, expert in enumerate(self.experts):
                out += expert(flat) * dense[:, e:e + 1]
            return out.view(shape)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)  # tokens routed to expert e, and which of their k picks
            if rows.numel():
                y = expert(flat[rows]) * weight[rows, slot, None].to(flat.dtype)
                out.index_add_(0, rows, y)
        return out.view(shape)


class DecoderLayer(nn.Module):
    """Pre-norm Llama block (Gemma: plus post-attention and post-MLP norms). The EAGLE-1/2 draft
    uses it without the input norm."""

    def __init__(self, cfg: ModelConfig, input_norm: bool = True) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(h, eps) if input_norm else nn.Identity()
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(h, eps)
        self.mlp = MoE(cfg) if cfg.num_experts else MLP(cfg)
        self.post_attn_norm = RMSNorm(h, eps) if cfg.sandwich_norms else nn.Identity()
        self.post_mlp_norm = RMSNorm(h, eps) if cfg.sandwich_norms else nn.Identity()
        self._direct: tuple[tuple[nn.Module, ...], direct.DirectLayer | None] | None = None  # (planned from, plan)

    def forward(self, x, cos, sin, cache: KVCache | None, layer: int, mask: torch.Tensor | ChainMask | None
                ) -> torch.Tensor:
        if cache is not None and direct.DIRECT and cpu_kernels_apply(x):
            plan = self.direct_plan()
            out = None if plan is None else plan.run(x, cos, sin, cache, layer, mask)
            if out is not None:  # the same kernels as below, called without the modules (direct.py)
                return out
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, cache, layer, mask))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))

    def direct_plan(self) -> direct.DirectLayer | None:
        """This layer's direct CPU plan (direct.py), made again only when its modules change."""
        key = direct.layer_modules(self)
        if self._direct is None or self._direct[0] != key:
            self._direct = (key, direct.plan_layer(self))
        return self._direct[1]


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


def window_mask(mask: torch.Tensor | None, positions: torch.Tensor, key_positions: torch.Tensor,
                window: int) -> torch.Tensor:
    """Restrict `mask` ([T, S] / [B, T, S] bool, None = all) to a sliding window, by logical
    position: query at position p sees keys at positions > p - window (transformers' rule).

    positions [B, T] of the queries; key_positions [B, S] of every slot the forward reads. Tree
    nodes share positions and compacted slots are contiguous, so positions, not slots, decide.
    Returns [B, T, S].
    """
    inside = key_positions[:, None, :] > positions[:, :, None] - window  # [B, T, S]
    return inside if mask is None else inside & mask


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.quant = "none"  # the --quant mode its linears run in (quant.quantize_model)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg)
        # Gemma 3's sliding layers use their own (local) RoPE base.
        self.rotary_local = Rotary(cfg, local=True) if cfg.rope_local_theta else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._stack: tuple[list, object] | None = None  # (the layers' plans, their direct.layer_stack)
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
        masks = self.layer_masks(mask, positions, cache)  # per layer: [T, S] / [B, T, S] / None
        masks = [m[:, None] if m is not None and m.dim() == 3 else m for m in masks]  # [B, 1, T, S]
        cos, sin = self.rotary(positions, self.dtype)
        local = (cos, sin) if self.rotary_local is None else self.rotary_local(positions, self.dtype)
        x = self.embed(tokens)  # [B, T, H]
        if self.config.embed_scale:  # Gemma: sqrt(hidden), rounded to the model dtype as transformers does
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        hidden: dict[int, torch.Tensor] = {}
        with pinned_ops():  # one look at EAGLESPEC_KERNELS for the layers' ~160 ops, not one each
            stacked = self._run_stack(x, cos, sin, cache, masks[0], hidden_layers)
            if stacked is not None:
                x, hidden = stacked
            else:
                for i, layer in enumerate(self.layers):
                    if i in hidden_layers:
                        hidden[i] = x
                    c, s = local if self.config.layer_window(i) else (cos, sin)
                    x = layer(x, c, s, cache, i, masks[i])
            cache.advance(t)
            feats = self.norm(x)
        if isinstance(logits_for, torch.Tensor):
            logits = self.logits(feats[:, logits_for])
        elif logits_for == "all":
            logits = self.logits(feats)
        elif logits_for == "last":
            logits = self.logits(feats[:, -1:])
        elif logits_for == "none":
            logits = feats.new_empty(b, 0, self.config.vocab_size)
        else:
            raise ValueError(f"logits_for must be 'all', 'last', 'none' or an index tensor, got {logits_for!r}")
        return ModelOutput(logits=logits, features=feats, hidden=hidden)

    def _run_stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, mask: torch.Tensor | None,
                   hidden_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """All layers in one C++ call (direct.layer_stack) where every layer has a direct plan the
        stack can run and the model has no sliding windows (one mask and one RoPE for all layers);
        else None and the layers run one by one. The same kernels in the same order: the same bits."""
        if (not (direct.DIRECT and direct.STACK) or cache is None or not cpu_kernels_apply(x)
                or self.config.sliding_window or self.rotary_local is not None):
            return None
        plans = [layer.direct_plan() for layer in self.layers]
        if self._stack is None or any(a is not b for a, b in zip(self._stack[0], plans)):  # identity, not __eq__
            self._stack = (plans, direct.layer_stack(plans))
        stack = self._stack[1]
        if stack is None:
            return None
        return direct.run_stack(stack, plans, x, cos, sin, cache, mask, hidden_layers)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """LM head (with Gemma-style final soft-capping when configured)."""
        # As 2-D rows: a [B, 1, H] slice of a longer sequence keeps its batch stride, and linear
        # then takes a batched-matmul path that copies the whole LM-head weight (3.5 s per
        # prefill on Gemma 3's 262k x 640 bf16 head, measured).
        out = self.lm_head(feats.reshape(-1, feats.shape[-1])).view(*feats.shape[:-1], -1)
        cap = self.config.final_logit_softcapping
        return out if not cap else torch.tanh(out / cap) * cap

    def layer_masks(self, mask: torch.Tensor | None, positions: torch.Tensor, cache) -> list[torch.Tensor | None]:
        """The attention mask of each layer: `mask` itself, or for a sliding-window layer `mask`
        cut to its window (skipped while every key the forward reads is inside any window)."""
        cfg = self.config
        out: list[torch.Tensor | None] = [mask] * cfg.num_layers
        if not cfg.sliding_window:
            return out
        key_pos = cache.slot_positions(positions)  # [B, S]
        if key_pos.shape[1] <= cfg.sliding_window:  # positions < S: nothing is out of any window
            return out
        by_window: dict[int, torch.Tensor] = {}
        for i in range(cfg.num_layers):
            w = cfg.layer_window(i)
            if w:
                if w not in by_window:
                    by_window[w] = window_mask(mask, positions, key_pos, w)
                out[i] = by_window[w]
        return out
