"""Shared fixtures: a tiny Hugging Face chat checkpoint on disk and an isolated converted-weights cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Engines with a head that ships a tau table (the default one) would time its trees on first load
# (runtime/tree_tuning.py); the suite keeps the static defaults, and test_tree_tuning.py turns it
# on where it is the subject. Child processes inherit this.
os.environ["EAGLESPEC_TREE_TUNING"] = "0"

# Under pytest-xdist (`make test` runs one worker per core) each worker gets its share of the cores:
# OpenMP pools of all cores in every worker would oversubscribe the machine and spin against each
# other. Child processes (CLI, server and torchrun tests) inherit the setting. Tests that are
# about thread counts set their own.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _SHARE = max(1, _CORES // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)
    torch.set_num_threads(_SHARE)

# ChatML, as SmolLM2 and Qwen2 use it (no default system prompt, to keep prompts short).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ("hello world the a cat dog sat on mat red blue green one two three four five six seven eight nine "
         "ten sun moon star tree river stone bird fish user assistant system big small fast slow up down "
         "left right yes no why how what who when where").split()


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that logits are far from uniform (HF's 0.02 init gives near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.6 / p.shape[-1] ** 0.5)
    return model


def save_word_tokenizer(path: Path) -> dict[str, int]:
    """A word-level tokenizer (one token per word, specials split out) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHATML
    hf.save_pretrained(str(path))
    return vocab


def build_tiny_chat(path: Path, max_positions: int) -> Path:
    """A 2-layer Llama checkpoint (safetensors + config.json + word tokenizer with ChatML)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    n_vocab = len(SPECIALS) + len(WORDS)
    cfg = LlamaConfig(vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=SPECIALS.index("<|im_end|>"),
                      pad_token_id=None, tie_word_embeddings=False)
    model = randomize_(LlamaForCausalLM(cfg), seed=7)
    model.save_pretrained(str(path), safe_serialization=True)
    assert save_word_tokenizer(path)["<|im_end|>"] == cfg.eos_token_id
    return path


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory) -> Path:
    """Context window 32."""
    return build_tiny_chat(tmp_path_factory.mktemp("tiny_chat"), 32)


@pytest.fixture(scope="session")
def tiny_chat_checkpoint_256(tmp_path_factory) -> Path:
    """The same model with a context window of 256 (room for chat prompts and answers: the server)."""
    return build_tiny_chat(tmp_path_factory.mktemp("tiny_chat_256"), 256)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """Point the converted-weights/tokenizer cache at a fresh directory."""
    cache = tmp_path / "eaglespec-cache"
    monkeypatch.setenv("EAGLESPEC_CACHE", str(cache))
    return cache
