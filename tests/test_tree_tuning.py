"""Measured tree defaults (runtime/tree_tuning.py): a head's tau table is read and checked, the tree
with the most tokens per second is picked from timed steps, the timings are cached per machine,
and requests that name no tree get the pick while requests that name one keep theirs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eaglespec.config import ConfigError, SamplingConfig, TreeConfig, default_tree
from eaglespec.draft import load_head, save_head
from eaglespec.runtime import tree_tuning
from eaglespec.runtime.engine import Engine, Request
from eaglespec.runtime.tree_tuning import choose, parse_tree_tau, tree_key
from spec_helpers import sharp_random_head
from tiny import tiny_config, tiny_model

TAUS = {"greedy": {"2,1,1": 1.5, "4,2,2": 1.8, "8,3,4": 2.1}, "sampled": {"2,1,1": 1.4, "3,2,1": 1.6}}


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """Tuning on (conftest turns it off for the rest of the suite), with a fresh timing cache."""
    monkeypatch.setenv("EAGLESPEC_TREE_TUNING", "1")
    path = tmp_path / "cache" / "trees.json"
    monkeypatch.setattr(tree_tuning, "cache_path", lambda: path)  # (XDG_CACHE_HOME would move the built kernels too)
    return path


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config(vocab=96, eos=7)
    return tiny_model(cfg, seed=5), sharp_random_head(cfg, seed=9)


def test_choose_picks_most_tokens_per_second():
    taus = TAUS["greedy"]
    # A CPU where a tree row costs what a decode does (AVX2 int4): the smallest tree wins.
    pick = choose(taus, {"vanilla": 10.0, "2,1,1": 16.0, "4,2,2": 25.0, "8,3,4": 40.0})
    assert tree_key(pick.tree) == "2,1,1" and pick.speedup == pytest.approx(1.5 * 10 / 16)
    # A CPU where a tree costs little more than a decode (AMX tiles): the largest wins.
    pick = choose(taus, {"vanilla": 10.0, "2,1,1": 12.0, "4,2,2": 13.0, "8,3,4": 14.0, "16,5,4": 1.0})
    assert tree_key(pick.tree) == "8,3,4" and pick.speedup == pytest.approx(2.1 * 10 / 14)
    assert set(pick.step_ms) == {"vanilla", *taus}  # only the table's trees count


@pytest.mark.parametrize("raw,match", [
    ([1, 2], "must map 'greedy'"),
    ({"fast": {"2,1,1": 1.5}}, "must map 'greedy'"),
    ({"greedy": {}}, "non-empty"),
    ({"greedy": {"2,1": 1.5}}, "not a tree"),
    ({"greedy": {"2,1,1": 2.5}}, r"in \[1, depth \+ 1\]"),
    ({"greedy": {"2,1,1": "1.5"}}, r"in \[1, depth \+ 1\]"),
    ({"sampled": {"4,2,2": 3.5}}, r"in \[1, depth \+ 1\]"),
])
def test_bad_tau_tables_are_refused(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_tree_tau(raw, "head x")
    assert parse_tree_tau(TAUS, "head x") == TAUS
    # Sampled requests take trees too (spec/propose.py's sampled layouts), not only chains.
    assert parse_tree_tau({"sampled": {"4,2,2": 1.8}}, "head x") == {"sampled": {"4,2,2": 1.8}}


def test_head_config_carries_its_table(models, tmp_path):
    target, head = models
    save_head(head, tmp_path / "h", extra={"tree_tau": TAUS})
    assert load_head(tmp_path / "h", target.config).tree_tau == TAUS
    save_head(head, tmp_path / "bad", extra={"tree_tau": {"greedy": {"2,1,1": 9}}})
    with pytest.raises(ConfigError, match="draft head .*bad.*tree_tau"):
        load_head(tmp_path / "bad", target.config)
    save_head(head, tmp_path / "none")
    assert getattr(load_head(tmp_path / "none", target.config), "tree_tau", None) is None


def test_engine_times_once_caches_and_uses_the_pick(models, tuning, monkeypatch):
    target, head = models
    head.tree_tau = TAUS
    try:
        timed = []
        real = tree_tuning.time_steps

        def spy(engine, keys, temperature, **kw):
            timed.append((sorted(keys), temperature))
            return real(engine, keys, temperature, rounds=1, new_tokens=6, context=40)

        monkeypatch.setattr(tree_tuning, "time_steps", spy)
        engine = Engine(target, head, eos_ids=[7])
        # every tree of each table and vanilla timed, greedy at T=0 and chains at T=1
        assert sorted(timed) == sorted([(sorted(["vanilla", *TAUS["greedy"]]), 0.0),
                                        (sorted(["vanilla", *TAUS["sampled"]]), 1.0)])
        assert set(engine.tuned) == {"greedy", "sampled"} and engine.eos_ids == [7]  # EOS back on
        cached = json.loads(tuning.read_text())
        assert len(cached) == 2 and all(set(e["step_ms"]) == {"vanilla", *TAUS[k]} for k, e in
                                        zip(("greedy", "sampled"), cached.values()))
        assert all(e["step_ms"]["vanilla"] > 0 for e in cached.values())

        # A second engine on this machine reads the cache and times nothing.
        monkeypatch.setattr(tree_tuning, "time_steps", lambda *a, **k: pytest.fail("timed again"))
        again = Engine(target, head, eos_ids=[7])
        for kind in ("greedy", "sampled"):
            assert again.tuned[kind].tree == engine.tuned[kind].tree
        greedy, sampled = again.tuned["greedy"].tree, again.tuned["sampled"].tree
        assert tree_key(greedy) in TAUS["greedy"] and tree_key(sampled) in TAUS["sampled"]

        # Requests naming no tree get the pick; a named tree is kept.
        r0 = again.submit(Request([1, 2, 3], "eagle2", max_new_tokens=4))
        r1 = again.submit(Request([1, 2, 3], "eagle2", sampling=SamplingConfig(temperature=1.0, seed=1),
                                  max_new_tokens=4))
        named = TreeConfig("eagle2", total_tokens=5, depth=2, top_k=2)
        r2 = again.submit(Request([1, 2, 3], "eagle2", named, max_new_tokens=4))
        assert (r0.tree, r1.tree, r2.tree) == (greedy, sampled, named)
        while not all(r.done for r in (r0, r1, r2)):
            again.step()
        assert all(r.error is None and r.pending_tokens for r in (r0, r1, r2))
        assert again.default_tree("eagle") == default_tree("eagle")  # eagle keeps its static tree

        # retime: timed again although cached, and the cache holds the new timings.
        monkeypatch.setenv("EAGLESPEC_TREE_TUNING", "retime")
        fixed = {k: 2.0 for k in ("vanilla", *TAUS["greedy"], *TAUS["sampled"])}
        fixed["vanilla"] = 1.0
        monkeypatch.setattr(tree_tuning, "time_steps", lambda engine, keys, temperature, **kw:
                            {k: fixed[k] / 1e3 for k in keys})
        Engine(target, head, eos_ids=[7])
        assert all(e["step_ms"]["vanilla"] == 1.0 for e in json.loads(tuning.read_text()).values())

        # Tuning off: the static defaults.
        monkeypatch.setenv("EAGLESPEC_TREE_TUNING", "0")
        off = Engine(target, head, eos_ids=[7])
        assert off.tuned == {} and off.default_tree("eagle2") == default_tree("eagle2", "none")
    finally:
        del head.tree_tau


def test_a_head_without_a_table_keeps_the_static_defaults(models, tuning, monkeypatch):
    target, head = models
    monkeypatch.setattr(tree_tuning, "time_steps", lambda *a, **k: pytest.fail("timed without a table"))
    engine = Engine(target, head, eos_ids=[7])
    assert engine.tuned == {} and not tuning.exists()
    assert engine.default_tree("eagle2", 1.0) == default_tree("eagle2", "none", 1.0)


def test_no_timing_while_requests_are_in_flight(models, tuning, monkeypatch, caplog):
    """Timing would drive the queued requests and be slowed by them: the static defaults stay."""
    target, head = models
    monkeypatch.setattr(tree_tuning, "time_steps", lambda *a, **k: pytest.fail("timed with requests in flight"))
    engine = Engine(target, None, eos_ids=[7])
    req = engine.submit(Request([1, 2, 3], "vanilla", max_new_tokens=3))
    head.tree_tau = TAUS
    try:
        engine.set_head(head)
    finally:
        del head.tree_tau
    assert engine.tuned == {} and "requests in flight" in caplog.text
    while not req.done:
        engine.step()
    assert req.error is None and len(req.pending_tokens) == 3


def test_the_timing_cache_tells_head_shapes_apart(models):
    """Step times depend on the head's draft vocabulary (its LM-head product runs every draft
    step): widening it, or another head kind, must not reuse the cached timings."""
    import torch

    target, head = models
    engine = SimpleNamespace(target=target, head=head)
    key = tree_tuning.cache_key(engine, "greedy", TAUS["greedy"])
    assert tree_tuning.cache_key(engine, "greedy", TAUS["greedy"]) == key
    held = head.vocab
    try:
        head.set_vocab(torch.arange(10))
        narrow = tree_tuning.cache_key(engine, "greedy", TAUS["greedy"])
        head.set_vocab(torch.arange(20))
        wide = tree_tuning.cache_key(engine, "greedy", TAUS["greedy"])
    finally:
        head.set_vocab(held)
    assert len({key, narrow, wide}) == 3
    assert tree_tuning.cache_key(SimpleNamespace(target=target, head=None), "greedy", TAUS["greedy"]) != key


def test_time_steps_takes_the_least_round_median_in_alternating_order(monkeypatch):
    """Load only adds time: a tree's figure is its best round's median step, so one slowed round
    (or one slow step in a round) does not decide the pick; rounds alternate the trees' order."""
    calls = []
    rounds = {"a": [[5, 5, 5], [1, 1, 9], [2, 2, 2]], "b": [[3, 3, 3], [4, 4, 4], [9, 3, 9]]}

    def fake(engine, key, temperature, new_tokens, seed, context):
        calls.append((key, seed))
        return [0.0] if seed == 0 else list(rounds[key][seed - 1])  # seed 0: the warm-up request

    monkeypatch.setattr(tree_tuning, "_step_seconds", fake)
    engine = SimpleNamespace(window=4096)
    assert tree_tuning.time_steps(engine, ["a", "b"], 0.0, rounds=3) == {"a": 1, "b": 3}
    assert calls == [("b", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        tree_tuning.time_steps(engine, ["a"], 0.0, rounds=0)
