"""Lossless greedy speculative decoding: token-for-token equal to vanilla decoding.

Fuzzed on tiny random models with a draft that is often right (long accepted runs, EOS and
max_new_tokens inside a run), checked on the default model with a random head, plus the stats,
the KV caches after compaction and the context-window boundary.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglespec import generate as generate_mod
from eaglespec.config import EAGLE1_CHOICES, TreeConfig
from eaglespec.draft import Drafter, init_random_head
from eaglespec.generate import GenerationError, generate_tokens
from eaglespec.tree import static_layout

from spec_helpers import VerifyRecorder, check_stats, cut_at_eos, oracle_drafter, run_generate, single_thread
from tiny import tiny_config, tiny_model

CHOICE_SETS = {
    "eagle1": EAGLE1_CHOICES,
    "chain4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "small": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    "wide": [[0], [1], [2], [3], [4], [5], [0, 0], [5, 0], [5, 0, 0]],
}


# --- (a) fuzzed on tiny random models -----------------------------------------------------------
@st.composite
def cases(draw):
    c = {
        "seed": draw(st.integers(0, 10**6)),
        "vocab": draw(st.sampled_from([8, 16, 50, 96])),
        "arch": draw(st.sampled_from(["llama", "llama", "qwen2"])),
        "tie": draw(st.booleans()),
        "n": draw(st.integers(1, 12)),
        "max_new": draw(st.integers(1, 40)),
        "method": draw(st.sampled_from(["eagle", "eagle2"])),
        "total": draw(st.integers(1, 60) | st.integers(1, 6)),
        "depth": draw(st.integers(1, 6)),
        "choices": draw(st.sampled_from(sorted(CHOICE_SETS))),
        "eos_at": draw(st.none() | st.integers(0, 39)),
        "drafter": draw(st.sampled_from(["oracle", "oracle", "oracle", "random_head"])),
        "window": draw(st.none() | st.integers(0, 4)),  # slack over n + max_new, None: roomy
        "until_full": draw(st.booleans()),
    }
    c["top_k"] = draw(st.integers(1, min(10, c["vocab"])))
    return c


def run_case(c: dict, recorder: VerifyRecorder, seen: Counter) -> None:
    tight = c["window"] is not None
    max_pos = c["n"] + c["max_new"] + c["window"] if tight else 256
    cfg = tiny_config(arch=c["arch"], vocab=c["vocab"], max_pos=max_pos, tie=c["tie"])
    target = tiny_model(cfg, seed=c["seed"])
    rng = random.Random(c["seed"])
    prompt = [rng.randrange(c["vocab"]) for _ in range(c["n"])]
    # max_new_tokens None (until the window is full) only with a small window.
    max_new = None if (tight and c["until_full"]) else c["max_new"]
    base = run_generate(target, prompt, max_new_tokens=max_new)
    eos = None if c["eos_at"] is None else base.tokens[c["eos_at"] % len(base.tokens)]
    eos_ids = [] if eos is None else [eos]
    van = run_generate(target, prompt, max_new_tokens=max_new, eos_ids=eos_ids)
    assert van.tokens == cut_at_eos(base.tokens, eos)
    assert van.stats.accept_lengths == [1] * (len(van.tokens) - 1)
    assert not van.stats.accept_lengths or van.stats.tau == 1.0
    check_stats(van.stats, van.tokens)

    if c["method"] == "eagle":
        tree = TreeConfig("eagle", choices=CHOICE_SETS[c["choices"]])
        lay = static_layout(tree.choices)
        budget, max_depth = len(lay.parents), lay.max_depth
    else:
        tree = TreeConfig("eagle2", total_tokens=c["total"], depth=c["depth"], top_k=c["top_k"])
        budget, max_depth = c["total"], c["depth"]
    if c["drafter"] == "oracle":
        drafter = oracle_drafter(target, seed=c["seed"], p_oracle=0.5, noise=0.15)
    else:
        drafter = Drafter(init_random_head(cfg, seed=c["seed"]), target)
    recorder.take()
    spec = run_generate(target, prompt, drafter, tree=tree, max_new_tokens=max_new, eos_ids=eos_ids)
    accs = recorder.take()

    assert spec.tokens == van.tokens, c
    assert spec.stats.stop_reason == van.stats.stop_reason
    check_stats(spec.stats, spec.tokens)
    assert len(accs) == spec.stats.steps
    assert all(s <= budget for s in spec.stats.tree_sizes)
    assert all(1 <= a <= max_depth + 1 for a in spec.stats.accept_lengths)
    if tight:
        assert len(prompt) + len(spec.tokens) <= max_pos
    if max_new is None:
        assert spec.stats.stop_reason in ("context_full", "eos")
        if spec.stats.stop_reason == "context_full":
            assert len(prompt) + len(spec.tokens) == max_pos

    # What this example exercised.
    seen["examples"] += 1
    seen[c["method"]] += 1
    if any(a.length >= 3 for a in accs):
        seen["long_run"] += 1
    if accs:
        last, emitted = accs[-1], spec.stats.accept_lengths[-1]
        cut_inside = emitted <= last.length  # the step's last emitted token was a drafted one
        if spec.stats.stop_reason == "eos" and cut_inside:
            seen["eos_in_run"] += 1
            if emitted < last.length:
                seen["eos_mid_run"] += 1  # accepted drafts after the EOS were dropped
        if spec.stats.stop_reason == "max_new_tokens" and cut_inside:
            seen["max_new_in_run"] += 1
        if spec.stats.stop_reason == "context_full":
            seen["context_full"] += 1
    if tight and any(s < budget for s in spec.stats.tree_sizes[1:]):
        seen["tree_shrunk"] += 1


def test_greedy_lossless_fuzz(monkeypatch):
    recorder = VerifyRecorder()
    monkeypatch.setattr(generate_mod, "verify", recorder)
    seen: Counter = Counter()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases())
    def fuzz(c):
        run_case(c, recorder, seen)

    with single_thread():
        fuzz()
    # The fuzzing reached the cases that matter (hypothesis is derandomized: stable counts).
    for key in ("eagle", "eagle2", "long_run", "eos_in_run", "eos_mid_run", "max_new_in_run",
                "context_full", "tree_shrunk"):
        assert seen[key] > 0, (key, seen)


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_greedy_lossless_random_head(method):
    """The real Drafter with a random head (acceptance near zero): still identical."""
    cfg = tiny_config(vocab=96)
    target = tiny_model(cfg, seed=5)
    drafter = Drafter(init_random_head(cfg, seed=9), target)
    tree = TreeConfig(method, total_tokens=24, depth=6, top_k=6)
    with single_thread():
        for prompt in ([3], [10, 20, 30, 40, 50, 60, 70]):
            van = run_generate(target, prompt, max_new_tokens=40)
            spec = run_generate(target, prompt, drafter, tree=tree, max_new_tokens=40)
            assert spec.tokens == van.tokens
            check_stats(spec.stats, spec.tokens)
            assert spec.stats.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
@pytest.mark.parametrize("vocab_size", [3, 20])
def test_reduced_draft_vocab_lossless_and_confined(method, vocab_size, monkeypatch):
    """A head with a reduced vocabulary proposes only its tokens (even when it holds fewer
    than top_k), and the output still equals vanilla's."""
    cfg = tiny_config(vocab=96)
    target = tiny_model(cfg, seed=5)
    head = init_random_head(cfg, seed=9)
    allowed = torch.arange(0, 96, 96 // vocab_size)[:vocab_size]
    head.set_vocab(allowed)
    drafter = Drafter(head, target)
    drafted: set[int] = set()
    real_draft = Drafter.draft

    def spy(self, *a, **kw):
        tree = real_draft(self, *a, **kw)
        drafted.update(tree.tokens[1:].tolist())
        return tree

    monkeypatch.setattr(Drafter, "draft", spy)
    tree = TreeConfig(method, total_tokens=12, depth=4, top_k=5)
    with single_thread():
        van = run_generate(target, [10, 20, 30], max_new_tokens=30)
        spec = run_generate(target, [10, 20, 30], drafter, tree=tree, max_new_tokens=30)
    assert spec.tokens == van.tokens
    assert drafted and drafted <= set(allowed.tolist())


@pytest.mark.parametrize("total, depth, top_k", [(2, 6, 10), (3, 6, 10), (5, 8, 10), (1, 6, 10), (60, 6, 10),
                                                   (30, 3, 100)])
def test_small_tree_wide_expansion(total, depth, top_k):
    """EAGLE-2 drafts (depth - 1) * top_k tentative nodes whatever total_tokens is: a small tree
    with a wide expansion must still fit the draft cache (regression: KV cache overflow).
    top_k above the vocabulary (64) is clamped to it."""
    cfg = tiny_config(vocab=64)
    target = tiny_model(cfg, seed=6)
    tree = TreeConfig("eagle2", total_tokens=total, depth=depth, top_k=top_k)
    with single_thread():
        van = run_generate(target, [9, 8, 7], max_new_tokens=32)
        for drafter in (Drafter(init_random_head(cfg, seed=1), target), oracle_drafter(target, seed=3)):
            spec = run_generate(target, [9, 8, 7], drafter, tree=tree, max_new_tokens=32)
            assert spec.tokens == van.tokens
            assert max(spec.stats.tree_sizes) <= total


@pytest.mark.parametrize("method, min_tau", [("eagle", 3.0), ("eagle2", 2.5)])
def test_oracle_draft_speeds_up(method, min_tau):
    """A sanity check of the test draft itself: with the oracle always on, tau is well above 1
    (and the dynamic trees of its sharp random head are deep enough for long runs)."""
    cfg = tiny_config(vocab=64)
    target = tiny_model(cfg, seed=2)
    tree = TreeConfig(method, total_tokens=16, depth=5, top_k=4)
    with single_thread():
        van = run_generate(target, [1, 2, 3], max_new_tokens=40)
        spec = run_generate(target, [1, 2, 3], oracle_drafter(target, p_oracle=1.0, noise=0.0), tree=tree,
                            max_new_tokens=40)
    assert spec.tokens == van.tokens
    assert spec.stats.tau > min_tau, spec.stats.accept_lengths


# --- (b) the default model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from eaglespec.api import EagleSpec

    e = EagleSpec.load(dtype="fp32")
    e.set_draft("random")
    return e


PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23? Explain step by step."]
# Each prompt runs vanilla, the default static tree, and two of the dynamic tree sizes.
DEFAULT_MODEL_RUNS = [(PROMPTS[0], [1, 60]), (PROMPTS[1], [4, 16])]


@pytest.mark.slow
@pytest.mark.parametrize("prompt, sizes", DEFAULT_MODEL_RUNS, ids=["haiku", "arith"])
def test_default_model_greedy_lossless(engine, prompt, sizes):
    van = engine.generate(prompt, method="vanilla", max_new_tokens=24)
    assert van.new_tokens == len(van.token_ids) > 0 and van.tau == 1.0
    runs = [("eagle", TreeConfig("eagle"))] + [("eagle2", TreeConfig("eagle2", total_tokens=s)) for s in sizes]
    for method, tree in runs:
        r = engine.generate(prompt, method=method, tree=tree, max_new_tokens=24)
        assert r.token_ids == van.token_ids, (method, tree.total_tokens)
        assert r.text == van.text and r.stop_reason == van.stop_reason
        assert sum(r.accept_lengths) + 1 == r.new_tokens
        assert r.tau == pytest.approx(sum(r.accept_lengths) / len(r.accept_lengths))
        assert r.steps == len(r.accept_lengths)


# --- KV compaction ---------------------------------------------------------------------------
def test_kv_caches_after_compaction(monkeypatch):
    """After every step the target cache holds exactly what an uncached forward over the
    accepted sequence gives, and the draft cache holds the committed (token, real feature) pairs
    of that sequence, one per target slot."""
    cfg = tiny_config(vocab=32, max_pos=128)
    target = tiny_model(cfg, seed=21)
    drafter = oracle_drafter(target, seed=4, p_oracle=0.9, noise=0.3)
    made = []
    orig_new_cache = target.new_cache

    def spy(*args, **kwargs):
        c = orig_new_cache(*args, **kwargs)
        made.append(c)
        return c

    monkeypatch.setattr(target, "new_cache", spy)
    recorder = VerifyRecorder()
    monkeypatch.setattr(generate_mod, "verify", recorder)
    prompt = [4, 9, 1, 30, 2]
    drafter.start(prompt)
    tree = TreeConfig("eagle2", total_tokens=20, depth=5, top_k=3)
    seq = list(prompt)
    reordered = 0
    with single_thread():
        gen = generate_tokens(target, prompt, drafter=drafter, tree=tree, max_new_tokens=40)
        cache = None
        for chunk in gen:
            if cache is None:
                cache = made[0]  # the first cache generate_tokens makes is the target's
            seq.extend(chunk)
            n = cache.length
            assert n == len(seq) - 1  # everything but the newest token
            if len(seq) - len(prompt) < 40:  # (after the last step the draft is not extended)
                assert drafter.committed == n and drafter.cache.length == n
            with torch.inference_mode():
                fresh = orig_new_cache(n)
                out = target(torch.tensor(seq[:n])[None], torch.arange(n)[None], fresh)
            torch.testing.assert_close(cache.k[..., :n, :], fresh.k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache.v[..., :n, :], fresh.v, rtol=1e-5, atol=1e-5)
            # The draft cache: pairs (x[t+1], f[t]) for t < n, with the target's real features.
            m = drafter.committed
            ref = Drafter(drafter.head, target)
            ref.reset(m)
            with torch.inference_mode():
                ref.extend(torch.tensor(seq[1:m + 1]), out.features[0, :m])
            torch.testing.assert_close(drafter.cache.k[..., :m, :], ref.cache.k[..., :m, :], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(drafter.cache.v[..., :m, :], ref.cache.v[..., :m, :], rtol=1e-5, atol=1e-5)
            for acc in recorder.take():
                if acc.nodes != list(range(len(acc.nodes))):
                    reordered += 1
    assert reordered >= 3  # accepted paths that needed slots moved, not just a prefix kept
    assert len(seq) == len(prompt) + 40


# --- the context window --------------------------------------------------------------------------
WINDOW = 40


@pytest.fixture(scope="module")
def short_model():
    cfg = tiny_config(vocab=64, max_pos=WINDOW)
    return tiny_model(cfg, seed=8)


def spec_setups(target):
    cfg = target.config
    return [
        ("vanilla", None, None),
        ("eagle", oracle_drafter(target, seed=1, p_oracle=0.7, noise=0.1), TreeConfig("eagle")),
        ("eagle2", oracle_drafter(target, seed=2, p_oracle=0.7, noise=0.1),
         TreeConfig("eagle2", total_tokens=60, depth=6, top_k=10)),
        ("eagle2-random", Drafter(init_random_head(cfg, seed=3), target),
         TreeConfig("eagle2", total_tokens=60, depth=6, top_k=10)),
    ]


def test_prompt_one_short_of_the_window(short_model):
    prompt = list(range(1, WINDOW))  # 39 tokens
    with single_thread():
        for name, drafter, tree in spec_setups(short_model):
            r = run_generate(short_model, prompt, drafter, tree=tree, max_new_tokens=1)
            assert len(r.tokens) == 1 and r.stats.stop_reason == "max_new_tokens", name
            r = run_generate(short_model, prompt, drafter, tree=tree, max_new_tokens=None)
            assert len(r.tokens) == 1 and r.stats.stop_reason == "context_full", name


@pytest.mark.parametrize("n, max_new, match", [
    (39, 2, "exceeds the context window of 40 tokens; lower --max-new-tokens to at most 1"),
    (20, 21, "exceeds the context window of 40 tokens; lower --max-new-tokens to at most 20"),
    (40, 1, "prompt of 40 tokens does not fit the context window of 40"),
    (41, None, "does not fit the context window"),
    (0, 5, "empty prompt"),
    (5, 0, "max_new_tokens must be >= 1"),
])
def test_requests_that_cannot_fit(short_model, n, max_new, match):
    prompt = [(7 * i) % 64 for i in range(n)]
    for name, drafter, tree in spec_setups(short_model)[:3]:
        with pytest.raises(GenerationError, match=match):
            next(generate_tokens(short_model, prompt, drafter=drafter, tree=tree, max_new_tokens=max_new))


def test_near_the_limit_big_tree_equals_vanilla(short_model, monkeypatch):
    """A 60-token tree does not fit in the last steps before the window: it shrinks, positions
    stay inside the window, and the output is still vanilla's."""
    positions = []
    orig_forward = short_model.forward

    def spy(tokens, pos, *args, **kwargs):
        positions.append(int(pos.max()))
        return orig_forward(tokens, pos, *args, **kwargs)

    monkeypatch.setattr(short_model, "forward", spy)
    with single_thread():
        for n, max_new in [(20, 20), (30, 10), (35, None), (12, None), (38, 2)]:
            prompt = [(5 * i + 3) % 64 for i in range(n)]
            van = run_generate(short_model, prompt, max_new_tokens=max_new)
            expected_len = WINDOW - n if max_new is None else max_new
            assert len(van.tokens) == expected_len
            for name, drafter, tree in spec_setups(short_model)[1:]:
                positions.clear()
                r = run_generate(short_model, prompt, drafter, tree=tree, max_new_tokens=max_new)
                assert r.tokens == van.tokens, (name, n, max_new)
                assert r.stats.stop_reason == van.stats.stop_reason
                assert r.stats.stop_reason == ("context_full" if max_new is None else "max_new_tokens")
                assert max(positions) < WINDOW, (name, n, max_new)
                check_stats(r.stats, r.tokens)
                if tree.method == "eagle2" and r.stats.steps:
                    assert r.stats.tree_sizes[-1] < 60  # the tree shrank near the limit


def test_until_full_from_a_short_prompt(short_model):
    """max_new_tokens=None: prompt + output fill the window exactly, as max_new_tokens =
    window - prompt would, and the stop reason says why."""
    prompt = [5, 6, 7]
    with single_thread():
        van = run_generate(short_model, prompt, max_new_tokens=None)
        capped = run_generate(short_model, prompt, max_new_tokens=WINDOW - 3)
        assert van.tokens == capped.tokens and len(van.tokens) == WINDOW - 3
        assert van.stats.stop_reason == "context_full" and capped.stats.stop_reason == "max_new_tokens"
        for name, drafter, tree in spec_setups(short_model)[1:]:
            r = run_generate(short_model, prompt, drafter, tree=tree, max_new_tokens=None)
            assert r.tokens == van.tokens, name
            assert r.stats.stop_reason == "context_full"
