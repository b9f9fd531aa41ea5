"""Draft-head checkpoints: our save/load round trip, released EAGLE-1/2 directories written by
hand (pytorch_model.bin and model.safetensors), bias variants, and heads that must be refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglespec.config import ConfigError
from eaglespec.draft import DraftHead, init_random_head, load_head, save_head

from tiny import tiny_config

EAGLE_KEYS = {
    "fc.weight", "fc.bias",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}
QKV_BIAS_KEYS = {"layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias",
                 "layers.0.self_attn.v_proj.bias"}


def random_head(cfg, seed=0, bias=True, num_layers=1) -> DraftHead:
    """Every parameter random (biases and norm weights too, unlike init_random_head), so that a
    wrongly mapped tensor changes the output."""
    head = DraftHead(cfg, bias=bias, num_layers=num_layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return head.eval().requires_grad_(False)


def head_output(head: DraftHead, seed: int = 5) -> torch.Tensor:
    """Two calls (a prefix, then a masked tree-like step) against a fresh cache."""
    cfg = head.config
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(1, 6, cfg.hidden_size, generator=g)
    f = torch.randn(1, 6, cfg.hidden_size, generator=g)
    cache = head.new_cache(16)
    with torch.inference_mode():
        a = head(e[:, :4], f[:, :4], torch.arange(4)[None], cache)
        mask = torch.ones(2, 6, dtype=torch.bool)
        mask[0, 5] = False  # two sibling nodes
        b = head(e[:, 4:], f[:, 4:], torch.tensor([[4, 4]]), cache, mask)
    return torch.cat([a, b], dim=1)


def eagle_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    """The released EAGLE-1/2 tensor names, split from our fused weights by hand."""
    c = head.config
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = head.layer.attn.wqkv.weight
    gu = head.layer.mlp.w_gate_up.weight
    sd = {
        "fc.weight": head.fc.weight,
        "layers.0.self_attn.q_proj.weight": w[:nq],
        "layers.0.self_attn.k_proj.weight": w[nq:nq + nkv],
        "layers.0.self_attn.v_proj.weight": w[nq + nkv:],
        "layers.0.self_attn.o_proj.weight": head.layer.attn.wo.weight,
        "layers.0.mlp.gate_proj.weight": gu[:c.intermediate_size],
        "layers.0.mlp.up_proj.weight": gu[c.intermediate_size:],
        "layers.0.mlp.down_proj.weight": head.layer.mlp.w_down.weight,
        "layers.0.post_attention_layernorm.weight": head.layer.mlp_norm.weight,
    }
    if head.bias:
        sd["fc.bias"] = head.fc.bias
    if c.qkv_bias:
        b = head.layer.attn.wqkv.bias
        sd.update({"layers.0.self_attn.q_proj.bias": b[:nq], "layers.0.self_attn.k_proj.bias": b[nq:nq + nkv],
                   "layers.0.self_attn.v_proj.bias": b[nq + nkv:]})
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def released_config(cfg, bias=True, qwen=False) -> dict:
    """A Hugging Face config.json as the released heads ship it: the target's, one layer."""
    d = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_attention_heads": cfg.num_heads, "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_kv_heads, "pretraining_tp": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_scaling": None, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
        "use_cache": True, "vocab_size": cfg.vocab_size, "bias": bias,
    }
    if qwen:
        d["qkv_bias"] = True
    return d


def write_released(path, cfg_dict, tensors, fmt: str = "safetensors"):
    """A head directory as released heads ship: config.json plus safetensors or a .bin."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict))
    if fmt == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture
def cfg():
    return tiny_config(vocab=96, hidden=32, heads=4, kv_heads=2, inter=64)


# --- our layout -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, bias", [("llama", True), ("llama", False), ("qwen2", True)])
def test_save_load_round_trip(tmp_path, arch, bias):
    cfg = tiny_config(arch=arch, vocab=96)
    head = random_head(cfg, seed=1, bias=bias)
    save_head(head, tmp_path / "h", extra={"note": "test"})
    loaded = load_head(tmp_path / "h", cfg)
    assert loaded.bias == bias and loaded.config.qkv_bias == (arch == "qwen2")
    assert torch.equal(head_output(loaded), head_output(head))
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    meta = json.loads((tmp_path / "h" / "config.json").read_text())
    assert meta["num_hidden_layers"] == 1 and meta["bias"] is bias
    assert meta["eaglespec"]["note"] == "test"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_layer_head_round_trip_in_eagle_layout(tmp_path, arch):
    """A 2-layer EAGLE-1/2 head: layer 1 is saved under EAGLE's names (with its input norm), loads
    back as 2 layers (from the tensors, whatever config.json's layer count), and computes the same."""
    cfg = tiny_config(arch=arch, vocab=96)
    head = random_head(cfg, seed=3, num_layers=2)
    one = random_head(cfg, seed=3)
    assert not torch.allclose(head_output(head), head_output(one))  # layer 1 is used
    save_head(head, tmp_path / "h")
    with safe_open(str(tmp_path / "h" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    layer1 = {k.replace("layers.0.", "layers.1.") for k in keys if k.startswith("layers.0.")}
    assert layer1 | {"layers.1.input_layernorm.weight"} <= keys
    assert "layers.0.input_layernorm.weight" not in keys
    meta = json.loads((tmp_path / "h" / "config.json").read_text())
    assert meta["num_hidden_layers"] == 2
    meta["num_hidden_layers"] = 30  # a released config copied from its target
    (tmp_path / "h" / "config.json").write_text(json.dumps(meta))
    loaded = load_head(tmp_path / "h", cfg)
    assert loaded.cache_layers == 2 and loaded.new_cache(4).k.shape[0] == 2
    assert torch.equal(head_output(loaded), head_output(head))
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with pytest.raises(ConfigError, match="at least one layer"):
        DraftHead(cfg, num_layers=0)


def test_two_layer_head_cache_equals_one_pass():
    """Drafting's cached calls (a prefix, then one pair at a time) give what one causal pass over
    all pairs gives, in every layer's cache slot: layer 1 reads and writes its own cache layer."""
    cfg = tiny_config(vocab=96)
    head = random_head(cfg, seed=4, num_layers=3)
    g = torch.Generator().manual_seed(0)
    e, f = torch.randn(1, 7, cfg.hidden_size, generator=g), torch.randn(1, 7, cfg.hidden_size, generator=g)
    pos = torch.arange(7)[None]
    with torch.inference_mode():
        full = head(e, f, pos, None)
        cache = head.new_cache(8)
        parts = [head(e[:, :4], f[:, :4], pos[:, :4], cache)]
        parts += [head(e[:, i:i + 1], f[:, i:i + 1], pos[:, i:i + 1], cache) for i in range(4, 7)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 7 and bool(cache.k[2, :, :, :7].abs().sum() > 0)


@pytest.mark.parametrize("arch, bias, expected", [
    ("llama", True, EAGLE_KEYS),
    ("llama", False, EAGLE_KEYS - {"fc.bias"}),
    ("qwen2", True, EAGLE_KEYS | QKV_BIAS_KEYS),
])
def test_saved_keys_are_eagle_names(tmp_path, arch, bias, expected):
    cfg = tiny_config(arch=arch, vocab=96)
    head = random_head(cfg, seed=2, bias=bias)
    save_head(head, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == expected
        ref = eagle_tensors(head)
        for k in keys:  # and each holds the right slice
            assert torch.equal(f.get_tensor(k), ref[k]), k


def test_save_head_dtype(tmp_path, cfg):
    head = random_head(cfg, seed=3)
    save_head(head, tmp_path, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    loaded = load_head(tmp_path, cfg, dtype=torch.float32)
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())


# --- the released EAGLE-1/2 layout, written by hand ---------------------------------------------
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_released_eagle_directory_loads(tmp_path, cfg, fmt):
    head = random_head(cfg, seed=4)
    tensors = eagle_tensors(head)
    tensors["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)  # shipped, unused
    write_released(tmp_path, released_config(cfg), tensors, fmt)
    loaded = load_head(tmp_path, cfg)
    assert loaded.bias is True
    assert torch.equal(head_output(loaded), head_output(head))


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_released_fp16_directory_loads(tmp_path, cfg, fmt):
    """Released heads are fp16 on disk: loading upcasts exactly."""
    head = random_head(cfg, seed=5)
    tensors = {k: v.half() for k, v in eagle_tensors(head).items()}
    write_released(tmp_path, released_config(cfg), tensors, fmt)
    loaded = load_head(tmp_path, cfg)
    rounded = random_head(cfg, seed=5)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.half().float())
    assert torch.equal(head_output(loaded), head_output(rounded))
    assert not torch.equal(head_output(loaded), head_output(head))  # the rounding was real


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_released_head_without_fc_bias_loads(tmp_path, cfg, fmt):
    """Llama-3 heads ship no fc.bias."""
    head = random_head(cfg, seed=6, bias=False)
    tensors = eagle_tensors(head)
    assert "fc.bias" not in tensors
    write_released(tmp_path, released_config(cfg, bias=False), tensors, fmt)
    loaded = load_head(tmp_path, cfg)
    assert loaded.bias is False and loaded.fc.bias is None
    assert torch.equal(head_output(loaded), head_output(head))


def test_released_qwen2_head_with_qkv_bias(tmp_path):
    cfg = tiny_config(arch="qwen2", vocab=96)
    head = random_head(cfg, seed=7)
    tensors = eagle_tensors(head)
    assert QKV_BIAS_KEYS <= tensors.keys()
    write_released(tmp_path, released_config(cfg, qwen=True), tensors, "safetensors")
    loaded = load_head(tmp_path, cfg)
    assert loaded.config.qkv_bias
    assert torch.equal(head_output(loaded), head_output(head))
    # Without its biases the output differs: they were really loaded.
    with torch.no_grad():
        loaded.layer.attn.wqkv.bias.zero_()
    assert not torch.allclose(head_output(loaded), head_output(head))


def test_random_head_round_trip(tmp_path, cfg):
    head = init_random_head(cfg, seed=8)
    save_head(head, tmp_path)
    assert torch.equal(head_output(load_head(tmp_path, cfg)), head_output(head))


# --- heads that must be refused ----------------------------------------------------------------
def test_refuses_other_hidden_size(tmp_path, cfg):
    other = tiny_config(vocab=96, hidden=48, heads=4, kv_heads=2)
    save_head(random_head(other), tmp_path)
    with pytest.raises(ConfigError, match="hidden_size 48 != target's 32"):
        load_head(tmp_path, cfg)


def test_refuses_other_vocab_size(tmp_path, cfg):
    other = tiny_config(vocab=80)
    write_released(tmp_path, released_config(other), eagle_tensors(random_head(other)), "bin")
    with pytest.raises(ConfigError, match="vocab_size 80 != target's 96"):
        load_head(tmp_path, cfg)


def test_refuses_wrong_embedding(tmp_path, cfg):
    tensors = eagle_tensors(random_head(cfg))
    tensors["embed_tokens.weight"] = torch.zeros(cfg.vocab_size + 1, cfg.hidden_size)
    write_released(tmp_path, released_config(cfg), tensors, "safetensors")
    with pytest.raises(ConfigError, match="embedding"):
        load_head(tmp_path, cfg)


def eagle3_tensors(cfg) -> dict[str, torch.Tensor]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "fc.weight": torch.randn(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": torch.randn(nq, 2 * h),
        "midlayer.self_attn.k_proj.weight": torch.randn(nkv, 2 * h),
        "midlayer.self_attn.v_proj.weight": torch.randn(nkv, 2 * h),
        "midlayer.self_attn.o_proj.weight": torch.randn(h, nq),
        "midlayer.mlp.gate_proj.weight": torch.randn(i, h),
        "midlayer.mlp.up_proj.weight": torch.randn(i, h),
        "midlayer.mlp.down_proj.weight": torch.randn(h, i),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(32, h),
        "d2t": torch.zeros(32, dtype=torch.long),
        "t2d": torch.zeros(cfg.vocab_size, dtype=torch.bool),
    }


@pytest.mark.parametrize("with_draft_vocab", [True, False])
def test_eagle3_head_is_detected(tmp_path, cfg, with_draft_vocab):
    """EAGLE-3 tensors in an EAGLE-1/2-style config are read as an EAGLE-3 head (tests/test_eagle3_head.py
    covers those); this one's t2d marks no token while d2t maps 32, so it is refused as such."""
    conf = released_config(cfg, bias=False)
    if with_draft_vocab:
        conf["draft_vocab_size"] = 32
    write_released(tmp_path, conf, eagle3_tensors(cfg), "safetensors")
    with pytest.raises(ConfigError, match="EAGLE-3 draft head .*t2d does not mark"):
        load_head(tmp_path, cfg)


def test_eagle3_head_in_pytorch_bin_is_detected(tmp_path, cfg):
    write_released(tmp_path, released_config(cfg, bias=False), eagle3_tensors(cfg), "bin")
    with pytest.raises(ConfigError, match="EAGLE-3 draft head .*t2d does not mark"):
        load_head(tmp_path, cfg)


def test_refuses_incomplete_or_misshapen_head(tmp_path, cfg):
    tensors = eagle_tensors(random_head(cfg))
    del tensors["layers.0.mlp.down_proj.weight"]
    write_released(tmp_path / "a", released_config(cfg), tensors, "safetensors")
    with pytest.raises(ConfigError, match="missing tensor"):
        load_head(tmp_path / "a", cfg)
    tensors = eagle_tensors(random_head(cfg))
    tensors["fc.weight"] = tensors["fc.weight"][:, : cfg.hidden_size]  # 1H -> H, not 2H -> H
    write_released(tmp_path / "b", released_config(cfg), tensors, "bin")
    with pytest.raises(ConfigError, match="shapes"):
        load_head(tmp_path / "b", cfg)


def test_refuses_missing_files(tmp_path, cfg):
    with pytest.raises(ConfigError, match="no config.json"):
        load_head(tmp_path, cfg)
    (tmp_path / "config.json").write_text(json.dumps(released_config(cfg)))
    with pytest.raises(ConfigError, match="no model.safetensors or pytorch_model.bin"):
        load_head(tmp_path, cfg)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="unreadable"):
        load_head(tmp_path, cfg)


def test_reduced_vocab_round_trip_and_keeps_eagle_layout(tmp_path, cfg):
    head = init_random_head(cfg, seed=4)
    head.set_vocab(torch.tensor([7, 3, 3, 50]))  # unsorted, duplicated: stored sorted and unique
    save_head(head, tmp_path / "h")
    with safe_open(str(tmp_path / "h" / "model.safetensors"), framework="pt") as f:
        assert not any("vocab" in k for k in f.keys())  # the EAGLE-1/2 file stays as released heads have it
    back = load_head(tmp_path / "h", cfg)
    assert back.vocab.tolist() == [3, 7, 50]
    # Saving the same directory again without a vocabulary removes it.
    head.set_vocab(None)
    save_head(head, tmp_path / "h")
    assert load_head(tmp_path / "h", cfg).vocab is None


@pytest.mark.parametrize("ids", [[-1, 2], [0, 10**6], []])
def test_reduced_vocab_out_of_range_is_refused(cfg, ids):
    head = init_random_head(cfg, seed=4)
    with pytest.raises(ConfigError):
        head.set_vocab(torch.tensor(ids, dtype=torch.long))


@pytest.mark.parametrize("bad", [0, -1.0, 11, "1.2", True, None])
def test_draft_sharpness_is_read_and_checked(tmp_path, cfg, bad):
    """`draft_sharpness` in the config's "eaglespec" block becomes head.draft_sharpness (sampled
    chains draw from softmax(s * logits / T)); a head without it has none (1.0 is used); a value
    that is not a number in (0, 10] is refused with a clear error."""
    head = init_random_head(cfg, seed=0)
    save_head(head, tmp_path / "h", extra={"draft_sharpness": 1.15})
    assert load_head(tmp_path / "h", cfg).draft_sharpness == 1.15
    save_head(head, tmp_path / "none")
    assert not hasattr(load_head(tmp_path / "none", cfg), "draft_sharpness")
    save_head(head, tmp_path / "bad", extra={"draft_sharpness": bad})
    if bad is None:  # JSON null: as if absent
        assert not hasattr(load_head(tmp_path / "bad", cfg), "draft_sharpness")
        return
    with pytest.raises(ConfigError, match="draft head .*bad.*draft_sharpness must be a number in"):
        load_head(tmp_path / "bad", cfg)
