"""The draft head shipped inside the package for the default model: it loads as `default`, it is
the EAGLE-1/2 layout, it fits the size limit, and greedy eagle2 with it equals vanilla on five
MT-bench questions (fp32, where equality must be exact)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglespec.api import EagleSpec, default_head_path
from eaglespec.weights import DEFAULT_MODEL

pytestmark = pytest.mark.slow

MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench" / "question.jsonl"
# Used when ../shared is absent (a user's checkout): five prompts in the MT-bench style.
FALLBACK = ["Compose an engaging travel blog post about a recent trip to Hawaii.",
            "Write a persuasive email to convince your introverted friend to volunteer as a guest speaker.",
            "Describe a vivid and unique character, using strong imagery and creative language.",
            "Implement a program to find the common elements in two arrays without extra data structures.",
            "What is the central dogma of molecular biology? What processes are involved?"]


def first_turns(n: int) -> list[str]:
    if not MT_BENCH.is_file():
        return FALLBACK[:n]
    # Spread over categories: every 16th question (the file holds 10 per category, in order).
    qs = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return [q["turns"][0] for q in qs[::16][:n]]


@pytest.fixture(scope="module")
def engine() -> EagleSpec:
    e = EagleSpec.load(DEFAULT_MODEL, dtype="fp32")
    e.set_draft("default")
    return e


def test_head_ships_in_eagle_layout_under_the_size_limit():
    path = default_head_path(DEFAULT_MODEL)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    assert {"config.json", "model.safetensors"} <= set(files), files
    assert sum(files.values()) <= 20 * 2**20
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and any(k.startswith("layers.0.self_attn.") for k in keys), sorted(keys)[:8]


@pytest.mark.parametrize("i", range(5))
def test_shipped_head_eagle2_equals_vanilla_on_mt_bench(engine, i):
    prompt = first_turns(5)[i]
    van = engine.generate(prompt, method="vanilla", max_new_tokens=48)
    spec = engine.generate(prompt, method="eagle2", max_new_tokens=48)
    assert spec.token_ids == van.token_ids
    # A trained head accepts drafts: far above a random head's tau of about 1.0.
    assert spec.tau > 1.2, spec.tau
