"""Checkpoint loading: GGUF files written here with gguf.GGUFWriter (llama.cpp tensor names, its Q/K
row permutation, several quantisation types), the converted-weights cache, and broken inputs.

The reference for every GGUF is transformers' LlamaForCausalLM / Qwen2ForCausalLM holding the
very weights the GGUF encodes (the dequantised bytes), so a quantised file must match to fp32
tolerance, not just roughly.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from conftest import randomize_
from eaglespec import weights as W
from eaglespec.config import ConfigError
from eaglespec.weights import ModelLoadError, load_model

Q = None  # gguf.GGMLQuantizationType, imported lazily


def qtypes():
    global Q
    import gguf

    Q = gguf.GGMLQuantizationType
    return Q


VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 64, 256, 256, 4, 2, 2
LAYER_NAMES = {  # llama.cpp name -> transformers name (inside model.layers.{i}.)
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_reference(arch: str = "llama", tie: bool = False, seed: int = 0):
    import transformers as tf

    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
    cfg = tf.Qwen2Config(**kw) if arch == "qwen2" else tf.LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    cls = tf.Qwen2ForCausalLM if arch == "qwen2" else tf.LlamaForCausalLM
    return randomize_(cls(cfg), seed).eval()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Q and K (rows may hold quantised bytes)."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """gguf.quants cannot quantise K-quants; random blocks with sane fp16 scales are just as good."""
    blocks = cols // 256
    if qtype == Q.Q4_K:  # d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        b = rng.integers(0, 256, (rows, blocks, 144), dtype=np.uint8)
        b[..., 0:2] = (rng.uniform(2e-4, 6e-4, (rows, blocks, 1)).astype(np.float16)).view(np.uint8)
        b[..., 2:4] = (rng.uniform(1e-4, 5e-4, (rows, blocks, 1)).astype(np.float16)).view(np.uint8)
    elif qtype == Q.Q5_K:  # d, dmin (f16), 12 bytes of 6-bit scales/mins, 32 bytes high bits, 128 of nibbles
        b = rng.integers(0, 256, (rows, blocks, 176), dtype=np.uint8)
        b[..., 0:2] = (rng.uniform(1e-4, 3e-4, (rows, blocks, 1)).astype(np.float16)).view(np.uint8)
        b[..., 2:4] = (rng.uniform(1e-4, 5e-4, (rows, blocks, 1)).astype(np.float16)).view(np.uint8)
    elif qtype == Q.Q6_K:  # ql 128, qh 64, int8 scales 16, d (f16)
        b = rng.integers(0, 256, (rows, blocks, 210), dtype=np.uint8)
        b[..., 208:210] = (rng.uniform(1e-5, 3e-5, (rows, blocks, 1)).astype(np.float16)).view(np.uint8)
    else:
        raise AssertionError(qtype)
    return b.reshape(rows, -1)


def encode(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """fp32 weight -> (the bytes/array to store, the fp32 weight those bytes decode to)."""
    import gguf

    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = random_kquant(w.shape[0], w.shape[1], qtype, rng)
    else:
        data = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32)
    assert np.isfinite(ref).all()
    return data, ref


def write_gguf(path: Path, model, qtype=None, *, arch: str = "llama", tie: bool | None = None, seed: int = 0,
               drop_meta: tuple[str, ...] = (), meta_override: dict | None = None,
               permute: bool | None = None) -> None:
    """Write `model` (transformers) as llama.cpp would; with qtype, 2-D weights are quantised and
    `model`'s weights are replaced by what the file decodes to (so it stays the exact reference)."""
    import gguf

    qtypes()
    rng = np.random.default_rng(seed)
    cfg = model.config
    tie = cfg.tie_word_embeddings if tie is None else tie
    permute = arch in ("llama", "mistral") if permute is None else permute
    sd = model.state_dict()
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
            "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads, "context_length": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, **(meta_override or {})}
    for k, v in meta.items():
        if k not in drop_meta:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32("tokenizer.ggml.eos_token_id", 3)

    def put(gguf_name: str, hf_name: str, n_head: int | None = None) -> None:
        t = sd[hf_name].float().numpy()
        if t.ndim == 2 and qtype is not None and qtype != Q.F32:
            data, ref = encode(t, qtype, rng)
            with torch.no_grad():
                sd[hf_name].copy_(torch.from_numpy(ref))
        else:
            data = np.ascontiguousarray(t)
        if n_head is not None and permute:
            data = llama_cpp_permute(data, n_head)  # whole rows move: same as quantising permuted rows
        raw_dtype = None if data.dtype in (np.float32, np.float16) else qtype
        w.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=raw_dtype)

    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight")
    if not tie:
        put("output.weight", "lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        for gname, hname in LAYER_NAMES.items():
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(gname)
            put(f"blk.{i}.{gname}.weight", f"model.layers.{i}.{hname}.weight", heads)
            if gname in ("attn_q", "attn_k", "attn_v") and f"model.layers.{i}.{hname}.bias" in sd:
                put(f"blk.{i}.{gname}.bias", f"model.layers.{i}.{hname}.bias", heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TOKENS = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))


def logits_of(model) -> torch.Tensor:
    return tiny.logits_of(model, TOKENS)


def assert_matches(ours, ref) -> None:
    want = logits_of(ref)
    assert want.std() > 0.3
    torch.testing.assert_close(logits_of(ours), want, atol=1e-4, rtol=1e-4)


# --- quantisation types ----------------------------------------------------------------------
QTYPE_NAMES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qname", QTYPE_NAMES)
def test_gguf_quantised_matches_dequantised_reference(tmp_path, qname):
    qt = getattr(qtypes(), qname)
    ref = hf_reference(seed=1)
    if qname == "F32":
        before = logits_of(ref)
    path = tmp_path / f"tiny-{qname}.gguf"
    write_gguf(path, ref, qt, seed=2)
    ours, src = load_model(str(path), dtype=torch.float32, use_cache=False)
    assert src.kind == "gguf" and src.name == f"tiny-{qname}"
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (LAYERS, HIDDEN, HEADS, KV_HEADS, 64)
    assert c.eos_token_ids == [3] and not c.tie_word_embeddings
    assert_matches(ours, ref)
    if qname == "F32":  # nothing was rounded: the original model itself
        torch.testing.assert_close(logits_of(ours), before, atol=1e-4, rtol=1e-4)


def test_permuted_rows_equal_quantised_permuted_weights():
    """write_gguf permutes quantised rows; that equals quantising the permuted weight."""
    import gguf

    qtypes()
    w = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
    for qt in (Q.Q4_0, Q.Q8_0, Q.Q5_1):
        assert np.array_equal(llama_cpp_permute(gguf.quants.quantize(w, qt), 2),
                              gguf.quants.quantize(llama_cpp_permute(w, 2), qt))


def test_gguf_without_unpermute_would_differ(tmp_path):
    """The permutation matters: a file written without it loads into a different model."""
    ref = hf_reference(seed=1)
    write_gguf(tmp_path / "raw.gguf", ref, permute=False)
    ours, _ = load_model(str(tmp_path / "raw.gguf"), use_cache=False)
    assert not torch.allclose(logits_of(ours), logits_of(ref), atol=1e-2)


def test_gguf_tied_embeddings(tmp_path):
    ref = hf_reference(tie=True, seed=4)
    write_gguf(tmp_path / "tied.gguf", ref, qtypes().Q8_0)
    ours, _ = load_model(str(tmp_path / "tied.gguf"), use_cache=False)
    assert ours.config.tie_word_embeddings
    assert ours.lm_head.weight.data_ptr() == ours.embed.weight.data_ptr()
    assert_matches(ours, ref)


def test_gguf_qwen2_biases_not_permuted(tmp_path):
    ref = hf_reference("qwen2", seed=5)
    write_gguf(tmp_path / "qwen.gguf", ref, qtypes().F32, arch="qwen2")
    ours, _ = load_model(str(tmp_path / "qwen.gguf"), use_cache=False)
    assert ours.config.architecture == "qwen2" and ours.config.qkv_bias
    assert_matches(ours, ref)


# --- converted cache ---------------------------------------------------------------------
def count_reads(monkeypatch) -> list:
    calls = []
    real = W.read_gguf

    def spy(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(W, "read_gguf", spy)
    return calls


def test_cache_hit_and_invalidation(tmp_path, isolated_cache, monkeypatch):
    path = tmp_path / "m.gguf"
    ref = hf_reference(seed=6)
    write_gguf(path, ref, qtypes().Q4_0)
    reads = count_reads(monkeypatch)

    first, _ = load_model(str(path))
    assert len(reads) == 1
    entries = list((isolated_cache / "converted").glob("*.safetensors"))
    assert len(entries) == 1
    assert_matches(first, ref)

    second, _ = load_model(str(path))
    assert len(reads) == 1, "second load should come from the cache"
    assert_matches(second, ref)
    assert second.config == first.config

    # Touching the source (new mtime) invalidates the entry.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    load_model(str(path))
    assert len(reads) == 2

    # New content (same size; the clock moved on) is read again, not served stale.
    ref2 = hf_reference(seed=7)
    write_gguf(path, ref2, qtypes().Q4_0)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 4_000_000_000))
    assert path.stat().st_size == st.st_size
    third, _ = load_model(str(path))
    assert len(reads) == 3
    assert_matches(third, ref2)

    # Each dtype has its own entry.
    bf, _ = load_model(str(path), dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and len(reads) == 4
    load_model(str(path), dtype=torch.bfloat16)
    assert len(reads) == 4


def test_broken_cache_entry_is_rebuilt(tmp_path, isolated_cache, monkeypatch):
    path = tmp_path / "m.gguf"
    ref = hf_reference(seed=8)
    write_gguf(path, ref, qtypes().F16)
    load_model(str(path))
    (entry,) = (isolated_cache / "converted").glob("*.safetensors")
    entry.write_bytes(entry.read_bytes()[:100])
    reads = count_reads(monkeypatch)
    ours, _ = load_model(str(path))
    assert len(reads) == 1
    assert_matches(ours, ref)
    assert entry.stat().st_size > 1000  # rewritten


def test_use_cache_false_writes_nothing(tmp_path, isolated_cache):
    write_gguf(tmp_path / "m.gguf", hf_reference(seed=9), qtypes().F32)
    load_model(str(tmp_path / "m.gguf"), use_cache=False)
    assert not isolated_cache.exists() or not any(isolated_cache.rglob("*.safetensors"))


# --- broken inputs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    write_gguf(path, hf_reference(seed=10), qtypes().Q8_0)
    return path


def test_random_bytes_gguf(tmp_path, isolated_cache):
    p = tmp_path / "junk.gguf"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    for use_cache in (False, True):
        with pytest.raises(ModelLoadError, match="not a readable GGUF"):
            load_model(str(p), use_cache=use_cache)


def test_empty_gguf(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        load_model(str(p), use_cache=False)


@pytest.mark.parametrize("frac", [0.5, 0.97])
def test_truncated_gguf(tmp_path, good_gguf, isolated_cache, frac):
    data = good_gguf.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * frac)])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(p))
    assert not any(isolated_cache.rglob("*.safetensors"))  # nothing half-converted is kept


def test_unsupported_gguf_architecture(tmp_path):
    p = tmp_path / "gpt2.gguf"
    write_gguf(p, hf_reference(seed=11), qtypes().F32, arch="gpt2", permute=False)
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt2'"):
        load_model(str(p), use_cache=False)


def test_gguf_missing_metadata(tmp_path):
    p = tmp_path / "nometa.gguf"
    write_gguf(p, hf_reference(seed=12), qtypes().F32, drop_meta=("block_count",))
    with pytest.raises(ModelLoadError, match="llama.block_count"):
        load_model(str(p), use_cache=False)


def test_gguf_shapes_disagree_with_metadata(tmp_path):
    """A file whose tensors do not have the shapes its metadata implies: a clear error, not a
    RuntimeError from torch."""
    p = tmp_path / "mismatch.gguf"
    write_gguf(p, hf_reference(seed=13), qtypes().F32, meta_override={"feed_forward_length": 512})
    with pytest.raises(ModelLoadError):
        load_model(str(p), use_cache=False)


def test_gguf_missing_tensor(tmp_path):
    p = tmp_path / "missing.gguf"
    write_gguf(p, hf_reference(seed=14), qtypes().F32, meta_override={"block_count": 3})  # file has 2
    with pytest.raises(ModelLoadError, match="blk.2"):
        load_model(str(p), use_cache=False)


def test_corrupted_gguf_headers_never_crash(tmp_path, good_gguf):
    """Random byte flips in the header, metadata and tensor table: a load either works or
    fails with ModelLoadError/ConfigError, never another exception (the CLI would show a traceback)."""
    data = good_gguf.read_bytes()
    rnd = random.Random(1234)
    p = tmp_path / "flipped.gguf"
    outcomes = set()
    for _ in range(150):
        b = bytearray(data)
        for _ in range(rnd.randint(1, 4)):
            b[rnd.randrange(1500)] = rnd.randrange(256)
        p.write_bytes(bytes(b))
        try:
            load_model(str(p), use_cache=False)
            outcomes.add("ok")
        except (ModelLoadError, ConfigError):
            outcomes.add("error")
    assert "error" in outcomes


# --- Hugging Face directories --------------------------------------------------------------
@pytest.fixture
def hf_dir(tmp_path) -> Path:
    d = tmp_path / "hf"
    hf_reference(seed=15).save_pretrained(str(d), safe_serialization=True)
    return d


def test_hf_dir_loads(hf_dir):
    ours, src = load_model(str(hf_dir))
    assert src.kind == "hf" and src.name == "hf"
    assert ours.config.hidden_size == HIDDEN


@pytest.mark.parametrize("how", ["truncate", "random", "empty"])
def test_corrupt_safetensors(hf_dir, how):
    f = hf_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2],
                   "random": np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes(),
                   "empty": b""}[how])
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        load_model(str(hf_dir))


def test_hf_dir_without_weights(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(hf_dir))


def test_hf_dir_bad_index(hf_dir):
    (hf_dir / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="shard index"):
        load_model(str(hf_dir))


def test_hf_dir_missing_tensor(hf_dir):
    from safetensors.torch import load_file, save_file

    f = hf_dir / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(f))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(hf_dir))


def test_hf_dir_wrong_shapes(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 300
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError):
        load_model(str(hf_dir))


@pytest.mark.parametrize("edit", ["missing_key", "not_object", "bad_json", "zero_heads"])
def test_hf_bad_config_json(hf_dir, edit):
    cfg = json.loads((hf_dir / "config.json").read_text())
    if edit == "missing_key":
        del cfg["hidden_size"]
        text = json.dumps(cfg)
    elif edit == "not_object":
        text = "[1, 2]"
    elif edit == "bad_json":
        text = "{"
    else:
        cfg["num_key_value_heads"] = 0
        cfg["num_attention_heads"] = 0
        text = json.dumps(cfg)
    (hf_dir / "config.json").write_text(text)
    with pytest.raises((ModelLoadError, ConfigError), match="config.json"):
        load_model(str(hf_dir))


def test_unsupported_hf_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load_model(str(d))


def test_unsupported_rope_scaling(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="yarn"):
        load_model(str(hf_dir))


# --- resolving model names ---------------------------------------------------------------
def test_missing_gguf_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf") as e:
        load_model(str(missing))
    assert "existing .gguf file" in str(e.value)


def test_missing_relative_gguf_is_not_a_hub_id(tmp_path, monkeypatch):
    """'models/x.gguf' has one slash like a hub repo id; it must not be sent to the hub."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(W, "_download_hub", lambda repo: pytest.fail(f"tried the hub for {repo}"))
    with pytest.raises(ModelLoadError, match="x.gguf"):
        load_model("models/x.gguf")


def test_unknown_model_id():
    with pytest.raises(ModelLoadError) as e:
        load_model("no-such-model-xyz")
    msg = str(e.value)
    assert "no-such-model-xyz" in msg and W.DEFAULT_MODEL in msg


def test_non_gguf_file(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=".gguf"):
        load_model(str(p))


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("use_cache", [False, True])
def test_loaded_model_does_not_alias_the_file(tmp_path, isolated_cache, use_cache):
    """F32 tensors must be copied out of the GGUF's memory map: rewriting the file afterwards
    (a new download, a re-quantisation) must not change, or crash, a model already loaded."""
    path = tmp_path / "m.gguf"
    ref = hf_reference(seed=16)
    write_gguf(path, ref, qtypes().F32)
    ours, _ = load_model(str(path), use_cache=use_cache)
    before = logits_of(ours)
    size = path.stat().st_size
    data = bytearray(path.read_bytes())
    with open(path, "r+b") as f:  # same size, new numbers, written in place
        f.seek(size // 3)
        f.write(np.random.default_rng(0).standard_normal((size - size // 3) // 4).astype(np.float32).tobytes())
    assert path.read_bytes() != bytes(data)
    torch.testing.assert_close(logits_of(ours), before, atol=0, rtol=0)
