"""Tiny random models for tests: no downloads, built in milliseconds."""

from __future__ import annotations

import torch

from eaglespec.config import ModelConfig, RopeScaling
from eaglespec.model import Transformer


# The families beyond Llama/Qwen2, each with its switches on (Gemma 3: a window of 4 on two of
# three layers, so every test longer than 4 tokens crosses it; Mixtral: 4 experts, top-2).
FAMILY_SWITCHES = {
    "qwen3": dict(qk_norm=True),
    "mixtral": dict(num_experts=4, experts_per_token=2),
    "gemma3": dict(qk_norm=True, sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"],
                   hidden_act="gelu_pytorch_tanh", sandwich_norms=True, embed_scale=True,
                   query_pre_attn_scalar=12.0, rope_local_theta=1000.0),
}
FAMILIES = ["llama", "qwen2", *FAMILY_SWITCHES]


def tiny_config(arch: str = "llama", vocab: int = 96, hidden: int = 32, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, inter: int = 64, max_pos: int = 256, rope_scaling: bool = False,
                tie: bool = False, eos: int | None = None) -> ModelConfig:
    extra = dict(FAMILY_SWITCHES.get(arch, {}))
    if arch == "gemma3":
        layers = 3
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64) if rope_scaling else None,
        rms_norm_eps=1e-6, max_position_embeddings=max_pos, tie_word_embeddings=tie,
        qkv_bias=arch == "qwen2", architecture=arch, bos_token_id=None,
        eos_token_ids=[] if eos is None else [eos], **extra)


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
               scale: float = 0.5) -> Transformer:
    """Random weights with a larger scale than HF's init, so logits are far from uniform and
    greedy decoding is not dominated by ties."""
    cfg = cfg or tiny_config()
    g = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return model.to(dtype).eval().requires_grad_(False)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of `tokens` ([1, T]) from our Transformer (a fresh cache) or a transformers model."""
    with torch.no_grad():
        if hasattr(model, "new_cache"):
            return model(tokens, torch.arange(tokens.shape[1])[None], model.new_cache(tokens.shape[1])).logits
        return model(tokens).logits
