"""Prefix reuse: a request whose prompt starts with what a free row still holds (the next turn of
a chat) prefills only the rest, and gets exactly the tokens a fresh prefill gives.

Reference: the same requests through an engine with reuse_prefix=False. fp32 tiny models.
"""

from __future__ import annotations

import pytest

from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Engine, Request
from spec_helpers import sharp_random_head, single_thread
from tiny import tiny_config, tiny_model

TREES = {"vanilla": None, "eagle": TreeConfig("eagle"), "eagle2": TreeConfig("eagle2", total_tokens=12, depth=4, top_k=3)}
FIRST = [10, 20, 30, 40, 50, 60, 70, 80]
REPLY = [11, 12, 13]  # the "user" turn appended after the first answer


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config(vocab=96, eos=7)
    return tiny_model(cfg, seed=5), sharp_random_head(cfg, seed=9)


def request(prompt, method, temperature=0.0, max_new_tokens=16, seed=3) -> Request:
    return Request(list(prompt), method, TREES[method], SamplingConfig(temperature, seed=seed), max_new_tokens)


def fresh(target, head, prompt, method, **kw) -> list[int]:
    engine = Engine(target, head, eos_ids=[7], reuse_prefix=False)
    (req,) = engine.run([request(prompt, method, **kw)])
    assert req.stats.cached_tokens == 0
    return req.pending_tokens


@pytest.mark.parametrize("method", ["vanilla", "eagle", "eagle2"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_next_turn_reuses_the_row_and_equals_a_fresh_prefill(models, method, temperature):
    target, head = models
    with single_thread():
        engine = Engine(target, head, eos_ids=[7], max_batch=2)
        (turn1,) = engine.run([request(FIRST, method, temperature)])
        answer = turn1.pending_tokens
        second = FIRST + answer + REPLY
        (turn2,) = engine.run([request(second, method, temperature, seed=4)])
        assert turn2.pending_tokens == fresh(target, head, second, method, temperature=temperature, seed=4)
    # The first request's steps ran every token of its answer but the last (the draft pair of the
    # last position holds that token: drafting reuses as much).
    held = len(FIRST) + len(answer) - 1
    assert turn2.stats.cached_tokens == held, (turn2.stats.cached_tokens, held)


def test_a_prompt_inside_what_a_row_holds(models):
    """A prompt that is a prefix of a row's tokens (a regenerated turn, a retried request) runs
    only its last token."""
    target, head = models
    with single_thread():
        engine = Engine(target, head, eos_ids=[7])
        (first,) = engine.run([request(FIRST, "eagle2")])
        (again,) = engine.run([request(FIRST, "eagle2")])
    assert again.stats.cached_tokens == len(FIRST) - 1
    assert again.pending_tokens == first.pending_tokens


@pytest.mark.parametrize("method", ["vanilla", "eagle2"])
def test_a_free_row_stepped_as_padding_is_not_reused(models, method):
    """Free rows below a running one are stepped with it (harmlessly, at the start of their
    caches): what they held is gone. Rows above the last running one are not stepped and keep it."""
    target, head = models
    with single_thread():
        for short_row in (0, 1):
            engine = Engine(target, head, eos_ids=[-1], max_batch=2)  # no EOS: lengths are exact
            short, long = request(FIRST, method, max_new_tokens=3), request([5, 6, 9], method, max_new_tokens=30)
            for r in ((short, long) if short_row == 0 else (long, short)):
                engine.submit(r)
            while not short.done:
                engine.step()
            engine.step()  # the long one runs on with the short one's row free
            second = FIRST + short.pending_tokens + REPLY
            turn2 = engine.submit(request(second, method))
            while not (turn2.done and long.done):
                engine.step()
            if short_row == 0:  # below the running row: stepped as padding
                assert turn2.stats.cached_tokens == 0
            else:
                assert turn2.stats.cached_tokens > len(FIRST)
            ref = Engine(target, head, eos_ids=[-1], reuse_prefix=False)
            (alone,) = ref.run([request(second, method)])
            assert turn2.pending_tokens == alone.pending_tokens


def test_a_new_prompt_leaves_the_longest_history_alone(models):
    """Among free rows that share as much with a prompt, it takes the one that held least, so a
    conversation that held more can come back to its row."""
    target, head = models
    with single_thread():
        engine = Engine(target, head, eos_ids=[-1], max_batch=3)
        engine.run([request(FIRST, "vanilla", max_new_tokens=2)])
        lane = engine.lanes[("vanilla",)]
        lane.kept = [[1] * 30, [2] * 3, [4] * 8]  # what three free rows hold
        assert lane._pick_row([9, 9]) == (1, 0)
        assert lane._pick_row([1] * 31) == (0, 29)  # the root (last kept token) was never run
        assert lane._pick_row([4] * 5) == (2, 4)  # one prompt token is always run
        lane.kept = [None, [2] * 3, None]
        assert lane._pick_row([9, 9]) == (0, 0)


def test_reuse_can_be_turned_off(models):
    target, head = models
    with single_thread():
        engine = Engine(target, head, eos_ids=[7], reuse_prefix=False)
        engine.run([request(FIRST, "vanilla")])
        (again,) = engine.run([request(FIRST + [1, 2], "vanilla")])
    assert again.stats.cached_tokens == 0
