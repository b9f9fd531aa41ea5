"""GGUF files of the newer families, written here as llama.cpp writes them, against transformers.

Qwen3 (q/k norms), Mixtral (written as "llama" with expert counts; merged [E, ...] expert tensors
and the older per-expert ones), Gemma 3 (its four norms stored with llama.cpp's +1, sliding
layers, every 6th global), with K-quant blocks (Q4_K, Q5_K, Q6_K, as in Q4_K_M files) on the
matrices. As in test_weights, the reference transformers model is given exactly the weights the
file decodes to, so parity is to fp32 tolerance. Also: unsupported architectures are refused
with an error that names what is supported.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import randomize_
from eaglespec.config import ConfigError
from eaglespec.weights import load_model
from test_weights import encode, llama_cpp_permute, qtypes
from tiny import logits_of

VOCAB, HIDDEN, INTER = 64, 256, 256
ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj"}
DENSE = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
NORMS = {  # llama.cpp name -> transformers name, per family
    "qwen3": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "mixtral": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "gemma3": {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}


def hf_family(family: str, seed: int = 0):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=family == "gemma3")
    if family == "qwen3":
        cfg = tf.Qwen3Config(**common, num_hidden_layers=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6)
        cls = tf.Qwen3ForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_hidden_layers=2, num_local_experts=3, num_experts_per_tok=2,
                               rms_norm_eps=1e-5, rope_theta=1e6)
        cls = tf.MixtralForCausalLM
    else:  # what llama.cpp assumes for Gemma 3: every 6th layer global, local base 10k, scale head_dim
        cfg = tf.Gemma3TextConfig(**common, num_hidden_layers=6, head_dim=64, sliding_window=5,
                                  query_pre_attn_scalar=64, rms_norm_eps=1e-6, rope_theta=1e6,
                                  rope_local_base_freq=1e4)
        cls = tf.Gemma3ForCausalLM
    cfg._attn_implementation = "eager"
    return randomize_(cls(cfg), seed).eval()


def write_family_gguf(path, model, family: str, qtype, *, per_expert: bool = False, seed: int = 0) -> None:
    """Write `model` as llama.cpp would (K-quant blocks on every matrix but the embedding); the
    model's weights become what the file decodes to."""
    import gguf

    Q = qtypes()
    rng = np.random.default_rng(seed)
    cfg = model.config
    sd = model.state_dict()
    arch = "llama" if family == "mixtral" else family
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
            "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads, "context_length": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size}
    if family != "mixtral":
        meta["attention.key_length"] = meta["attention.value_length"] = cfg.head_dim
    if family == "mixtral":
        meta.update({"expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok})
    if family == "gemma3":
        meta["attention.sliding_window"] = cfg.sliding_window
    for k, v in meta.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.rope.freq_base", 1e6)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)

    def matrix(t: torch.Tensor, qt, n_head: int | None = None) -> np.ndarray:
        """Encode a 2-D [rows, cols] weight; copies the decoded values back into t."""
        data, ref = encode(t.float().numpy(), qt, rng)
        with torch.no_grad():
            t.copy_(torch.from_numpy(ref))
        return llama_cpp_permute(data, n_head) if n_head is not None and arch == "llama" else data

    def put(name: str, data: np.ndarray, qt=None) -> None:
        raw = None if data.dtype in (np.float32, np.float16) else qt
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=raw)

    def norm(t: torch.Tensor) -> np.ndarray:  # llama.cpp stores Gemma's (1 + w)
        return (t.float().numpy() + (1.0 if family == "gemma3" else 0.0)).astype(np.float32)

    put("token_embd.weight", sd["model.embed_tokens.weight"].float().numpy())
    put("output_norm.weight", norm(sd["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        put("output.weight", matrix(sd["lm_head.weight"], Q.Q6_K), Q.Q6_K)
    kinds = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # Q4_K_M mixes all three
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for j, (g, h) in enumerate(ATTN.items()):
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(g)
            qt = kinds[(i + j) % 3]
            put(f"blk.{i}.{g}.weight", matrix(sd[p + h + ".weight"], qt, heads), qt)
        for g, h in NORMS[family].items():
            put(f"blk.{i}.{g}.weight", norm(sd[p + h + ".weight"]))
        if family != "mixtral":
            for j, (g, h) in enumerate(DENSE.items()):
                qt = kinds[(i + j + 1) % 3]
                put(f"blk.{i}.{g}.weight", matrix(sd[p + h + ".weight"], qt), qt)
            continue
        put(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"].float().numpy())
        gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]  # [E, 2I, H], [E, H, I]
        gate, up = gate_up[:, :INTER], gate_up[:, INTER:]
        enc = {n: [matrix(t[e], qt) for e in range(t.shape[0])]
               for n, t, qt in (("gate", gate, Q.Q4_K), ("up", up, Q.Q5_K), ("down", down, Q.Q6_K))}
        with torch.no_grad():  # the decoded experts back into the fused reference tensors
            gate_up.copy_(torch.cat([gate, up], 1))
        for n, qt in (("gate", Q.Q4_K), ("up", Q.Q5_K), ("down", Q.Q6_K)):
            if per_expert:
                for e, data in enumerate(enc[n]):
                    put(f"blk.{i}.ffn_{n}.{e}.weight", data, qt)
            else:
                put(f"blk.{i}.ffn_{n}_exps.weight", np.stack(enc[n]), qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TOKENS = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))


def logits(model) -> torch.Tensor:
    return logits_of(model, TOKENS)


CASES = [("qwen3", False), ("mixtral", False), ("mixtral", True), ("gemma3", False)]


@pytest.mark.parametrize("family, per_expert", CASES, ids=["qwen3", "mixtral-merged", "mixtral-per-expert", "gemma3"])
def test_family_gguf_with_kquants_matches_transformers(tmp_path, family, per_expert):
    ref = hf_family(family, seed=1)
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, ref, family, None, per_expert=per_expert, seed=2)
    ours, _ = load_model(str(path), use_cache=False)
    c = ours.config
    assert c.architecture == family and c.qk_norm == (family != "mixtral")
    if family == "mixtral":
        assert (c.num_experts, c.experts_per_token) == (3, 2)
    if family == "gemma3":
        assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and c.sliding_window == 5
        assert c.tie_word_embeddings and c.embed_scale and c.sandwich_norms
    want = logits(ref)
    assert want.std() > 0.3
    torch.testing.assert_close(logits(ours), want, atol=1e-4, rtol=1e-4)


def test_unsupported_architectures_name_the_supported_ones(tmp_path):
    import gguf

    d = tmp_path / "phi"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*Phi3ForCausalLM.*Qwen3.*Mixtral.*Gemma 3"):
        load_model(str(d))
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}))
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM"):
        load_model(str(d))
    p = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(p), "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"unsupported architecture 'qwen3moe'.*GGUF architectures"):
        load_model(str(p), use_cache=False)
