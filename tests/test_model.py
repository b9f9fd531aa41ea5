"""The target Transformer against transformers' reference implementation, the KV cache, tree masks.

Each family (Llama, Llama 3 RoPE scaling, Mistral, Qwen2 with q/k/v biases) is built as a tiny
random transformers model, saved with save_pretrained and read back through
eaglespec.weights.load_model, so the Hugging Face loader is exercised along the way.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import randomize_
from eaglespec.kv_cache import KVCache
from eaglespec.model import causal_mask
from eaglespec.weights import load_model
from tiny import FAMILIES, tiny_config, tiny_model

VOCAB = 96
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def hf_model(family: str, tie: bool = False, seed: int = 0):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "llama3":
        cfg, cls = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)), tf.LlamaForCausalLM
    elif family == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=None, rope_theta=1e6), tf.MistralForCausalLM
    elif family == "mistral-window":  # Mistral 7B v0.1's sliding window (4096 there), on every layer
        cfg, cls = tf.MistralConfig(**common, sliding_window=9, rope_theta=1e6), tf.MistralForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**common, rope_theta=1e6), tf.Qwen2ForCausalLM
    elif family == "qwen2.5":  # Qwen2.5-0.5B's shape of config: a window it does not use, max_window_layers
        cfg = tf.Qwen2Config(**common, rope_theta=1e6, use_sliding_window=False, sliding_window=32768,
                             max_window_layers=21)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=24, rope_theta=1e6), tf.Qwen3ForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)
        cls = tf.MixtralForCausalLM
    elif family == "gemma3":
        # Three layers, the last global; a window shorter than the test sequence; a query scale
        # and head_dim that differ from the defaults; linear RoPE scaling on the global layer.
        common.update(num_hidden_layers=3, tie_word_embeddings=True)
        cfg = tf.Gemma3TextConfig(**common, head_dim=24, sliding_window=7, query_pre_attn_scalar=20,
                                  sliding_window_pattern=3,
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        cls = tf.Gemma3ForCausalLM
    else:
        raise AssertionError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_(cls(cfg), seed).eval()


def save_and_load(model, path, shard: bool = False):
    kw = {"max_shard_size": "40KB"} if shard else {}
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    if shard:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert not (path / "model.safetensors").exists()
    ours, src = load_model(str(path), dtype=torch.float32)
    assert src.kind == "hf"
    return ours


def run_ours(model, tokens: torch.Tensor, hidden_layers=()):
    cache = model.new_cache(tokens.shape[1])
    pos = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        return model(tokens, pos, cache, hidden_layers=hidden_layers)


CASES = [
    ("llama", False, False),
    ("llama", True, False),
    ("llama", False, True),
    ("llama3", False, False),
    ("mistral", False, False),
    ("mistral", True, True),
    ("qwen2", False, False),
    ("qwen2", True, True),
    ("mistral-window", False, False),
    ("qwen2.5", True, False),
    ("qwen3", False, False),
    ("qwen3", True, True),
    ("mixtral", False, False),
    ("mixtral", False, True),
    ("gemma3", True, False),
]
ARCH = {"llama3": "llama", "qwen2.5": "qwen2", "mistral-window": "mistral"}


@pytest.mark.parametrize("family,tie,shard", CASES, ids=[f"{f}-tie{int(t)}-shard{int(s)}" for f, t, s in CASES])
def test_logits_match_transformers(tmp_path, family, tie, shard):
    ref = hf_model(family, tie=tie)
    ours = save_and_load(ref, tmp_path, shard=shard)
    cfg = ours.config
    assert cfg.architecture == ARCH.get(family, family)
    assert cfg.tie_word_embeddings == tie and cfg.qkv_bias == (cfg.architecture == "qwen2")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 24 if family in ("qwen3", "gemma3") else 16)
    assert cfg.qk_norm == (family in ("qwen3", "gemma3")) and cfg.num_experts == (4 if family == "mixtral" else 0)
    if family == "gemma3":  # window 7 < the 40 tokens below: the sliding layers really slide
        assert cfg.sliding_window == 7 and cfg.layer_types == ["sliding_attention"] * 2 + ["full_attention"]
        assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_local_theta == 1e4
    assert cfg.sliding_window == {"gemma3": 7, "mistral-window": 9}.get(family, 0)
    if tie:
        assert ours.lm_head.weight.data_ptr() == ours.embed.weight.data_ptr()
    # Llama 3 scaling differs most far from the original window: go well past 64.
    n = 150 if family == "llama3" else 40
    tokens = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
    got = run_ours(ours, tokens).logits
    assert want.std() > 0.5  # not a near-uniform model, where any bug would hide
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_read_from_config(tmp_path):
    ours = save_and_load(hf_model("llama3"), tmp_path)
    s = ours.config.rope_scaling
    assert s is not None, "llama3 rope scaling from config.json was ignored"
    assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (8.0, 1.0, 4.0, 64)
    assert ours.config.rope_theta == 500000.0


def test_hidden_layers_and_features_match_transformers(tmp_path):
    ref = hf_model("llama", seed=3)
    ours = save_and_load(ref, tmp_path)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = ref(tokens, output_hidden_states=True).hidden_states  # [i]: input of layer i; [-1]: after the norm
    out = run_ours(ours, tokens, hidden_layers=(0, 1))
    assert sorted(out.hidden) == [0, 1]
    torch.testing.assert_close(out.hidden[0], hs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden[1], hs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.features, hs[-1], atol=1e-4, rtol=1e-4)
    assert run_ours(ours, tokens, hidden_layers=(1,)).hidden.keys() == {1}
    assert run_ours(ours, tokens).hidden == {}


def test_mixtral_fused_expert_tensors_load(tmp_path):
    """transformers >= 5 holds Mixtral experts fused ([E, 2I, H] gate|up, [E, H, I] down, router
    under mlp.gate); a checkpoint written in that layout loads to the same model."""
    from safetensors.torch import save_file

    ref = hf_model("mixtral", seed=2)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd and "model.layers.0.mlp.gate.weight" in sd
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(ref.config.to_json_string())
    ours, _ = load_model(str(tmp_path))
    tokens = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
    torch.testing.assert_close(run_ours(ours, tokens).logits, want, atol=1e-4, rtol=1e-4)


def test_moe_dense_routing_equals_sparse():
    """The dense expert path (used on CUDA, where graphs need fixed shapes) gives what the
    routed path gives, and tokens route independently (a token's output is its own alone)."""
    from eaglespec.model import MoE

    model = tiny_model(tiny_config(arch="mixtral", vocab=VOCAB), seed=3)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None].expand(2, -1)
    with torch.no_grad():
        sparse = model(tokens, pos, model.new_cache(12, 2)).logits
        for m in model.modules():
            if isinstance(m, MoE):
                m.dense = True
        dense = model(tokens, pos, model.new_cache(12, 2)).logits
        moe = model.layers[0].mlp
        x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(1))
        alone = torch.cat([moe(x[:, i:i + 1]) for i in range(7)], dim=1)
        torch.testing.assert_close(moe(x), alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)


def test_gemma3_window_matters(tmp_path):
    """Without its window the Gemma 3 reference model gives other logits (so parity above covers it)."""
    ref = hf_model("gemma3")
    ours = save_and_load(ref, tmp_path)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    windowed = run_ours(ours, tokens).logits
    ours.config.sliding_window = 0
    assert not torch.allclose(run_ours(ours, tokens).logits[0, 10:], windowed[0, 10:], atol=1e-3)


# --- cached decoding and tree masks (our model only) ----------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    return tiny_model(tiny_config(arch=request.param, vocab=VOCAB), seed=5)


def full_forward(model, tokens: list[int]):
    t = torch.tensor(tokens)[None]
    return run_ours(model, t)


def test_cached_decoding_equals_full_forward(tiny):
    tokens = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    full = full_forward(tiny, tokens)
    cache = tiny.new_cache(32)
    k = 7
    with torch.no_grad():
        out = tiny(torch.tensor(tokens[:k])[None], torch.arange(k)[None], cache)
        logits, feats = [out.logits[0]], [out.features[0]]
        for i in range(k, len(tokens)):
            o = tiny(torch.tensor([[tokens[i]]]), torch.tensor([[i]]), cache)
            logits.append(o.logits[0])
            feats.append(o.features[0])
    assert cache.length == len(tokens)
    torch.testing.assert_close(torch.cat(logits), full.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(feats), full.features[0], atol=1e-5, rtol=1e-5)


# root 0 -> children 1, 2; node 1 -> children 3, 4.
PARENTS = [-1, 0, 0, 1, 1]
PATHS = [[0, 1, 3], [0, 1, 4], [0, 2]]


def depth(i: int) -> int:
    return 0 if PARENTS[i] < 0 else 1 + depth(PARENTS[i])


def ancestor_mask() -> torch.Tensor:
    n = len(PARENTS)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = PARENTS[j]
    return m


def run_tree(model, ctx_tokens, tree_tokens, batched_mask: bool = False):
    ctx = len(ctx_tokens)
    cache = model.new_cache(ctx + len(tree_tokens) + 4)
    with torch.no_grad():
        model(torch.tensor(ctx_tokens)[None], torch.arange(ctx)[None], cache)
        mask = torch.ones(len(tree_tokens), ctx + len(tree_tokens), dtype=torch.bool)
        mask[:, ctx:] = ancestor_mask()
        if batched_mask:
            mask = mask[None]
        positions = torch.tensor([[ctx + depth(i) for i in range(len(tree_tokens))]])
        out = model(torch.tensor(tree_tokens)[None], positions, cache, mask=mask)
    return out, cache


@pytest.mark.parametrize("batched_mask", [False, True])
def test_tree_forward_equals_each_path_alone(tiny, batched_mask):
    g = torch.Generator().manual_seed(6)
    ctx_tokens = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    tree_tokens = torch.randint(0, VOCAB, (len(PARENTS),), generator=g).tolist()
    out, cache = run_tree(tiny, ctx_tokens, tree_tokens, batched_mask)
    assert cache.length == len(ctx_tokens) + len(tree_tokens)
    ctx = len(ctx_tokens)
    for path in PATHS:
        plain = full_forward(tiny, ctx_tokens + [tree_tokens[i] for i in path])
        torch.testing.assert_close(out.logits[0, path], plain.logits[0, ctx:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.features[0, path], plain.features[0, ctx:], atol=1e-5, rtol=1e-5)
    # Siblings really see different contexts (else the comparison above proves little).
    assert not torch.allclose(out.logits[0, 3], out.logits[0, 4])


def test_compact_accepted_path_then_continue(tiny):
    """After a tree forward, keeping one path in the cache leaves it exactly as if only that
    path had been decoded: the next token's logits match an uncached forward."""
    g = torch.Generator().manual_seed(8)
    ctx_tokens = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    tree_tokens = torch.randint(0, VOCAB, (len(PARENTS),), generator=g).tolist()
    ctx = len(ctx_tokens)
    for path in PATHS:
        _, cache = run_tree(tiny, ctx_tokens, tree_tokens)
        cache.compact(ctx, path)
        assert cache.length == ctx + len(path)
        nxt = 17
        with torch.no_grad():
            o = tiny(torch.tensor([[nxt]]), torch.tensor([[ctx + len(path)]]), cache)
        seq = ctx_tokens + [tree_tokens[i] for i in path] + [nxt]
        torch.testing.assert_close(o.logits[0, -1], full_forward(tiny, seq).logits[0, -1], atol=1e-5, rtol=1e-5)


def test_logits_for_variants(tiny):
    tokens = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(9))
    pos = torch.arange(10)[None]
    with torch.no_grad():
        full = tiny(tokens, pos, tiny.new_cache(10)).logits
        last = tiny(tokens, pos, tiny.new_cache(10), logits_for="last").logits
        idx = tiny(tokens, pos, tiny.new_cache(10), logits_for=torch.tensor([2, 5, 9])).logits
        none = tiny(tokens, pos, tiny.new_cache(10), logits_for="none")
        with pytest.raises(ValueError, match="logits_for"):
            tiny(tokens, pos, tiny.new_cache(10), logits_for="first")
    torch.testing.assert_close(last, full[:, -1:])
    torch.testing.assert_close(idx, full[:, [2, 5, 9]])
    assert none.logits.shape == (1, 0, VOCAB) and none.features.shape == (1, 10, 32)


def test_causal_mask_shape_and_content():
    m = causal_mask(3, 2)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


# --- KV cache ------------------------------------------------------------------------------
def filled_cache(n: int, max_len: int = 12, layers: int = 2) -> KVCache:
    """Slot s of layer l holds keys l*1000 + s*10 + (0..) and values the negated keys."""
    c = KVCache(layers, num_kv_heads=2, head_dim=3, max_len=max_len)
    for s in range(n):
        for layer in range(layers):
            k = layer * 1000 + s * 10 + torch.arange(6, dtype=torch.float32).reshape(1, 2, 1, 3)
            c.write(layer, k, -k)
        c.advance(1)
    return c


def slot(c: KVCache, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    return c.k[:, :, :, s].clone(), c.v[:, :, :, s].clone()


@pytest.mark.parametrize("start,keep", [(4, [0, 2, 5]), (4, [5]), (3, [0, 1, 2]), (2, [1, 2, 7]), (2, [1, 2, 3]), (5, [])])
def test_compact_keeps_exactly_the_chosen_slots(start, keep):
    c = filled_cache(10)
    before = [slot(c, s) for s in range(10)]
    c.compact(start, keep)
    assert c.length == start + len(keep)
    for s in range(start):  # the context before `start` is untouched
        assert torch.equal(slot(c, s)[0], before[s][0]) and torch.equal(slot(c, s)[1], before[s][1])
    for i, rel in enumerate(keep):
        k, v = slot(c, start + i)
        assert torch.equal(k, before[start + rel][0]), (i, rel)
        assert torch.equal(v, before[start + rel][1]), (i, rel)


def test_compact_rejects_indices_outside_the_new_slots():
    c = filled_cache(6)
    with pytest.raises(ValueError):
        c.compact(4, [0, 2])  # slot 6 does not exist
    with pytest.raises(ValueError):
        c.compact(4, [-1])
    assert c.length == 6


def test_write_returns_views_up_to_the_new_end():
    c = filled_cache(3)
    k_new = torch.full((1, 2, 2, 3), 7.0)
    k_all, v_all = c.write(1, k_new, -k_new)
    assert k_all.shape == (1, 2, 5, 3) and torch.equal(k_all[:, :, 3:], k_new) and torch.equal(v_all[:, :, 3:], -k_new)
    assert c.length == 3  # advance() moves length, once all layers wrote
    c.advance(2)
    assert c.length == 5 and c.free == 12 - 5


def test_truncate():
    c = filled_cache(8)
    c.truncate(5)
    assert c.length == 5 and c.free == 7
    c.truncate(5)
    assert c.length == 5
    with pytest.raises(ValueError):
        c.truncate(6)
    with pytest.raises(ValueError):
        c.truncate(-1)
    # New writes land right after the truncation point.
    k = torch.full((1, 2, 1, 3), 99.0)
    c.write(0, k, k)
    assert torch.equal(c.k[0, :, :, 5], k[:, :, 0])


def test_overflow_raises():
    c = filled_cache(10, max_len=12)
    with pytest.raises(ValueError, match="overflow"):
        c.write(0, torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 3))
    c.write(0, torch.zeros(1, 2, 2, 3), torch.zeros(1, 2, 2, 3))  # exactly full is fine


def test_model_forward_overflow_raises(tiny):
    cache = tiny.new_cache(4)
    with pytest.raises(ValueError, match="overflow"):
        tiny(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], cache)
