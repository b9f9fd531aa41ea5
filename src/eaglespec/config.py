"""Configuration dataclasses: the target model's shape (from a Hugging Face config.json or GGUF
metadata), and the knobs of sampling and tree drafting.

Everything that describes *what* to run lives here, so the model, the decode loop and the CLI
share one set of defaults.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from numbers import Integral, Real
from typing import Any

# Decoder families eaglespec runs. All are the Llama block (RMSNorm, RoPE, GQA, gated MLP) plus
# the switches in ModelConfig: Qwen3 adds q/k norms, Mixtral a sparse MoE MLP, Gemma 3 sandwich
# norms, GeGLU, scaled embeddings and sliding-window layers. Qwen2.5 checkpoints are Qwen2ForCausalLM.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
               "gemma3_text": "gemma3"}
# GGUF general.architecture values (llama.cpp writes Mixtral as "llama" with expert_count set).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
SUPPORTED_SUMMARY = ("Llama 2/3, Mistral, Qwen2/Qwen2.5, Qwen3, Mixtral (sparse MoE), Gemma 3 (text); "
                     f"Hugging Face architectures {sorted(SUPPORTED_ARCHITECTURES)}, "
                     f"GGUF architectures {sorted(GGUF_ARCHITECTURES)}")


class ConfigError(ValueError):
    """A model or head configuration that eaglespec cannot run."""


@dataclass
class RopeScaling:
    """RoPE scaling: Llama-3 frequency-dependent ("llama3") or linear (positions / factor, Gemma 3)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


def parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    """A config.json rope_scaling / rope_parameters dict -> RopeScaling (None: plain RoPE)."""
    rs = rs or {}
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type == "llama3":
        return RopeScaling(
            factor=rs["factor"],
            low_freq_factor=rs.get("low_freq_factor", 1.0),
            high_freq_factor=rs.get("high_freq_factor", 4.0),
            original_max_position_embeddings=rs.get("original_max_position_embeddings", 8192),
        )
    if rope_type == "linear":
        return RopeScaling(factor=float(rs["factor"]), rope_type="linear")
    if rope_type not in (None, "default"):
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3, linear)")
    return None


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # --- family switches (defaults: the Llama block) ---
    qk_norm: bool = False  # per-head RMSNorm on queries and keys before RoPE (Qwen3, Gemma 3)
    num_experts: int = 0  # > 0: sparse MoE MLP of this many experts (Mixtral); intermediate_size is per expert
    experts_per_token: int = 0  # top-k experts each token routes to
    sliding_window: int = 0  # > 0: windowed layers see keys at positions > query position - window
    layer_types: list[str] = field(default_factory=list)  # per layer "sliding_attention" | "full_attention"
    hidden_act: str = "silu"  # gated-MLP activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    sandwich_norms: bool = False  # Gemma: extra RMSNorm after attention and after the MLP
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: float = 0.0  # attention scale is this ** -0.5 (0: head_dim, the usual)
    rope_local_theta: float = 0.0  # > 0: sliding layers use plain RoPE with this base (Gemma 3)
    final_logit_softcapping: float = 0.0  # > 0: logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(f"experts_per_token {self.experts_per_token} must be in [1, {self.num_experts}]")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ConfigError(f"unsupported hidden activation {self.hidden_act!r} (supported: silu, gelu_pytorch_tanh)")

    def layer_window(self, i: int) -> int:
        """Layer i's sliding window (0: full attention)."""
        if not self.sliding_window:
            return 0
        if self.layer_types:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else 0
        return self.sliding_window  # Mistral: every layer

    def head_config(self) -> "ModelConfig":
        """The config of an EAGLE head on this target: a dense Llama block of the same width.

        The head stays dense and full-attention whatever the target is (EAGLE's Mixtral heads are
        dense too); Llama/Mistral/Qwen2 heads keep their target's architecture (and Qwen2's biases).
        """
        keep = self.architecture in ("llama", "mistral", "qwen2")
        return replace(self, architecture=self.architecture if keep else "llama",
                       qkv_bias=self.qkv_bias if keep else False, qk_norm=False, num_experts=0,
                       experts_per_token=0, sliding_window=0, layer_types=[], hidden_act="silu",
                       sandwich_norms=False, embed_scale=False, query_pre_attn_scalar=0.0, rope_local_theta=0.0,
                       final_logit_softcapping=0.0)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict."""
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = MODEL_TYPES.get(cfg.get("model_type", ""))
        if arch is None:
            raise ConfigError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                              f"eaglespec runs {SUPPORTED_SUMMARY}")
        rp = cfg.get("rope_parameters")  # transformers >= 5 writes RoPE settings here instead
        local_theta = 0.0
        if arch == "gemma3" and isinstance(rp, dict) and "full_attention" in rp:
            # Gemma 3 under transformers >= 5: one RoPE setting per layer type.
            glob, loc = rp["full_attention"] or {}, rp.get("sliding_attention") or {}
            rs, rope_theta = glob, glob.get("rope_theta", 1e6)
            if parse_rope_scaling(loc) is not None:
                raise ConfigError("Gemma 3 RoPE scaling on sliding layers is not supported")
            local_theta = float(loc.get("rope_theta", 10000.0))
        else:
            rs = cfg.get("rope_scaling") or {}
            if not rs and isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
                rs = rp
            rope_theta = cfg.get("rope_theta")
            if rope_theta is None:  # transformers >= 5 nests it in rope_parameters
                rope_theta = (rp or {}).get("rope_theta", 10000.0)
            if arch == "gemma3":
                local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        scaling = parse_rope_scaling(rs)
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        window = cfg.get("sliding_window") or 0
        if cfg.get("use_sliding_window") is False:  # Qwen2/Qwen3 carry a window they do not use
            window = 0
        layer_types = list(cfg.get("layer_types") or [])
        if arch == "gemma3" and not layer_types:  # configs older than layer_types: every 6th is global
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(cfg["num_hidden_layers"])]
        if arch in ("qwen2", "qwen3") and window and not layer_types:
            raise ConfigError(f"{arch} with use_sliding_window needs layer_types in config.json")
        if cfg.get("attn_logit_softcapping"):
            raise ConfigError("attention logit soft-capping (Gemma 2) is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if arch == "gemma3":
            act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6 if arch == "gemma3" else 1e-5),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=arch in ("qwen3", "gemma3"),
            num_experts=int(cfg.get("num_local_experts", 0)) if arch == "mixtral" else 0,
            experts_per_token=int(cfg.get("num_experts_per_tok", 0)) if arch == "mixtral" else 0,
            sliding_window=int(window),
            layer_types=layer_types if window else [],
            hidden_act=act,
            sandwich_norms=arch == "gemma3",
            embed_scale=arch == "gemma3",
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0.0) if arch == "gemma3" else 0.0,
            rope_local_theta=local_theta,
            final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face style config dict (used for draft-head interchange)."""
        arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        out: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = asdict(self.rope_scaling)
        return out


MAX_SEED = 2**63 - 1
# Largest trees accepted (GPU trees are ~60 tokens, depth 6, top-k 10; these leave ample room).
MAX_TREE_TOKENS, MAX_TREE_DEPTH, MAX_TREE_TOPK = 1024, 64, 128


@dataclass
class SamplingConfig:
    """How the next token is chosen. temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Types first (TypeError naming the field), so a bad value never reaches torch.
        for name, kinds, what in (("temperature", Real, "a number"), ("top_p", Real, "a number"),
                                  ("top_k", Integral, "an int"), ("seed", (Integral, type(None)), "an int or None")):
            v = getattr(self, name)
            if not isinstance(v, kinds) or isinstance(v, bool):
                raise TypeError(f"{name} must be {what}, got {type(v).__name__} {v!r}")
        t = self.temperature
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not (0.0 < self.top_p <= 1.0) or math.isnan(self.top_p):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")
        # The engine keeps seeds in int64 tensors; refuse what would wrap or overflow there.
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be between 0 and {MAX_SEED} (2**63 - 1), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# EAGLE-1's default static tree for 7B targets: 25 nodes + root, depth 5 (EAGLE_FACTS.md).
EAGLE1_CHOICES: list[list[int]] = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


@dataclass
class TreeConfig:
    """Tree drafting. method "eagle": static tree from `choices`; "eagle2": dynamic tree.

    CPU defaults: verifying an extra token costs far more on a CPU than on a GPU (the target
    forward is compute-bound at a few dozen tokens, see README "forward-cost curve"), so the
    dynamic tree is much smaller than the GPU default of 60 tokens. 8 nodes at depth 3 measured
    fastest with the shipped head (README, "Tree defaults"): its acceptance beyond depth 2 is low,
    so deeper drafting and more verified nodes cost more than they return.
    """

    method: str = "eagle2"
    total_tokens: int = 8  # tree size including the root (eagle2)
    depth: int = 3  # drafting depth (eagle2)
    top_k: int = 4  # children per expanded node and frontier width (eagle2)
    choices: list[list[int]] = field(default_factory=lambda: [list(c) for c in EAGLE1_CHOICES])

    def __post_init__(self) -> None:
        if self.method not in ("eagle", "eagle2"):
            raise ValueError(f"tree method must be 'eagle' or 'eagle2', got {self.method!r}")
        # Caches are sized from these: an unbounded value would allocate without limit.
        for name, top in (("total_tokens", MAX_TREE_TOKENS), ("depth", MAX_TREE_DEPTH), ("top_k", MAX_TREE_TOPK)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise ValueError(f"tree {name} must be an int between 1 and {top}, got {v!r}")
        if len(self.choices) + 1 > MAX_TREE_TOKENS or max(map(len, self.choices), default=0) > MAX_TREE_DEPTH:
            raise ValueError(f"tree choices must have at most {MAX_TREE_TOKENS - 1} paths of length at most "
                             f"{MAX_TREE_DEPTH}, got {len(self.choices)} paths")


# eagle2's trees where a request names none and the head ships no tau table (a head that does gets
# the tree timed fastest on the machine: runtime/tree_tuning.py), by target and by whether it
# samples, re-measured in
# session 15 (scripts/tree_sweep.py on MT-bench first turns, the shipped head; README, "Tree
# defaults, session 15"). Greedy requests on the int4 / int8 CPU kernels, whose products cost
# about their row count: (6, 3, 2), 1.29-1.46x their vanilla against 1.21-1.25x for the chain
# (2, 1, 1) that was the default while drafting cost more. Float and int8a16 (AMX) targets keep
# TreeConfig's default (8, 3, 4) when greedy.
QUANT_TREE = {"total_tokens": 6, "depth": 3, "top_k": 2}

# Sampled requests (temperature > 0) get chains: their drafts are drawn from the head's
# distribution and pass with sum(min(p, q)) (spec/propose.py), where a top-k tree's pass with
# p(token). Float targets: (3, 2, 1), 1.30x vanilla at T=1 in bf16 against 0.98x for (8, 3, 4)
# (README, "Sampled chain drafts"). int8a16 on AMX tiles, where a longer chain costs the target
# little: (4, 3, 1), 1.33-1.34x against 1.21-1.22x for (2, 1, 1). int4 / int8: (2, 1, 1) (1.08x;
# (3, 2, 1) 1.10x and (4, 3, 1) 1.06x, within noise). Those (8, 3, 4) figures were top-k drafts;
# a sampled request's tree with top-k > 1 is now a sampled layout (tree.sampled_layout), which
# accepts more (README "Session 25") but was measured only on int4, where chains stay ahead. Heads
# with a tau table get the tree timed fastest on the machine instead (runtime/tree_tuning.py).
SAMPLED_TREE = {"total_tokens": 3, "depth": 2, "top_k": 1}
TILES_SAMPLED_TREE = {"total_tokens": 4, "depth": 3, "top_k": 1}
QUANT_SAMPLED_TREE = {"total_tokens": 2, "depth": 1, "top_k": 1}


def default_tree(method: str, quant: str = "none", temperature: float = 0.0) -> TreeConfig:
    """The tree a request gets when it names none (eagle: its static tree; eagle2: see above)."""
    if method != "eagle2":
        return TreeConfig(method)
    if temperature > 0:
        table = {"int4": QUANT_SAMPLED_TREE, "int8": QUANT_SAMPLED_TREE, "int8a16": TILES_SAMPLED_TREE}
        return TreeConfig(method, **table.get(quant, SAMPLED_TREE))
    if quant in ("int4", "int8"):
        return TreeConfig(method, **QUANT_TREE)
    return TreeConfig(method)
