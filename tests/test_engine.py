"""The engine: batched steps give each request exactly what it gets alone, from any thread.

Reference: the single-request decode loop (generate.py) and vanilla decoding. fp32 tiny models.
"""

from __future__ import annotations

import threading

import pytest
import torch

from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Engine, Request
from eaglespec.runtime.request import GenerationError
from eaglespec.spec.sampling import RowSampling
from spec_helpers import SyncCounter, run_generate, sharp_random_head, single_thread
from tiny import tiny_config, tiny_model

PROMPTS = [[3], [10, 20, 30, 40, 50, 60, 70], [5, 6, 7], list(range(1, 40)), [90, 1, 90, 1]]
TREES = {"vanilla": None, "eagle": TreeConfig("eagle"), "eagle2": TreeConfig("eagle2", total_tokens=12, depth=4, top_k=3)}


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config(vocab=96, eos=7)
    target = tiny_model(cfg, seed=5)
    return target, sharp_random_head(cfg, seed=9)


def alone(target, head, prompt, method, **kw) -> list[int]:
    engine = Engine(target, head, eos_ids=target.config.eos_token_ids)
    (req,) = engine.run([Request(prompt, method, TREES[method], **kw)])
    return req.pending_tokens


@pytest.mark.parametrize("method", ["vanilla", "eagle", "eagle2"])
def test_engine_equals_reference_loop(models, method):
    """Greedy: the engine's tokens equal the reference loop's vanilla tokens, stop reason too."""
    target, head = models
    with single_thread():
        for prompt in PROMPTS[:3]:
            ref = run_generate(target, prompt, max_new_tokens=30, eos_ids=[7])
            got = alone(target, head, prompt, method, max_new_tokens=30)
            assert got == ref.tokens, (prompt, method)


@pytest.mark.parametrize("method", ["vanilla", "eagle2"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batch_invariance(models, method, temperature):
    """A request gives the same tokens alone and in a batch of 4 with others of different lengths
    that join and finish at different times (greedy, and sampling with a seed)."""
    target, head = models
    sampling = [SamplingConfig(temperature, seed=11 + i, top_k=20 if i == 2 else 0) for i in range(5)]
    budgets = [25, 9, 40, 17, 30]
    with single_thread():
        solo = [alone(target, head, p, method, sampling=s, max_new_tokens=m)
                for p, s, m in zip(PROMPTS, sampling, budgets)]
        engine = Engine(target, head, eos_ids=[7], max_batch=4)
        reqs = [Request(p, method, TREES[method], s, m) for p, s, m in zip(PROMPTS, sampling, budgets)]
        for r in reqs[:2]:
            engine.submit(r)
        for _ in range(3):  # the first two run alone for a while
            engine.step()
        for r in reqs[2:]:
            engine.submit(r)  # the fifth waits for a free row
        while not all(r.done for r in reqs):
            engine.step()
    assert [r.pending_tokens for r in reqs] == solo


def test_mixed_lanes_and_sampling_rows(models):
    """vanilla and eagle2 requests, greedy and sampled, all in flight together."""
    target, head = models
    specs = [("vanilla", 0.0), ("eagle2", 0.0), ("eagle2", 1.0), ("eagle", 0.7), ("vanilla", 1.0)]
    with single_thread():
        solo = [alone(target, head, PROMPTS[i], m, sampling=SamplingConfig(t, seed=i), max_new_tokens=20)
                for i, (m, t) in enumerate(specs)]
        engine = Engine(target, head, eos_ids=[7])
        reqs = engine.run([Request(PROMPTS[i], m, TREES[m], SamplingConfig(t, seed=i), 20)
                           for i, (m, t) in enumerate(specs)])
    assert [r.pending_tokens for r in reqs] == solo


@pytest.mark.parametrize("n_streams", [2, 8])
def test_interleaved_streams_from_threads(models, n_streams):
    target, head = models
    methods = ["eagle2", "vanilla", "eagle"]
    jobs = [(PROMPTS[i % len(PROMPTS)], methods[i % 3], SamplingConfig(0.8 * (i % 2), seed=i), 12 + i)
            for i in range(n_streams)]
    with single_thread():
        solo = [alone(target, head, p, m, sampling=s, max_new_tokens=n) for p, m, s, n in jobs]
        engine = Engine(target, head, eos_ids=[7], max_batch=3)
        results: dict[int, list[int]] = {}

        def consume(i):
            p, m, s, n = jobs[i]
            req = engine.submit(Request(p, m, TREES[m], s, n))
            results[i] = [t for chunk in engine.chunks(req) for t in chunk]

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(n_streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert [results.get(i) for i in range(n_streams)] == solo


def test_interleaved_streams_one_thread(models):
    """Two generators advanced alternately in one thread (crashed before the engine)."""
    target, head = models
    with single_thread():
        solo = [alone(target, head, p, "eagle2", max_new_tokens=20) for p in PROMPTS[:2]]
        engine = Engine(target, head, eos_ids=[7])
        its = [engine.chunks(engine.submit(Request(p, "eagle2", TREES["eagle2"], max_new_tokens=20)))
               for p in PROMPTS[:2]]
        out = [[], []]
        live = [True, True]
        while any(live):
            for i, it in enumerate(its):
                if live[i]:
                    try:
                        out[i].extend(next(it))
                    except StopIteration:
                        live[i] = False
    assert out == solo


def test_closing_a_stream_frees_its_row(models):
    target, head = models
    engine = Engine(target, head, eos_ids=[7], max_batch=1)
    it = engine.chunks(engine.submit(Request(PROMPTS[1], "eagle2", TREES["eagle2"], max_new_tokens=50)))
    next(it)
    it.close()
    lane = next(iter(engine.lanes.values()))
    assert lane.active == []
    # The row is reusable and the next request is unaffected.
    (req,) = engine.run([Request(PROMPTS[0], "eagle2", TREES["eagle2"], max_new_tokens=10)])
    assert req.pending_tokens == alone(target, head, PROMPTS[0], "eagle2", max_new_tokens=10)


def test_bad_requests_fail_in_the_caller(models):
    target, head = models
    engine = Engine(target, None)
    with pytest.raises(GenerationError, match="empty prompt"):
        engine.submit(Request([], "vanilla"))
    with pytest.raises(GenerationError, match="context window"):
        engine.submit(Request(list(range(300)), "vanilla"))
    with pytest.raises(GenerationError, match="draft head"):
        engine.submit(Request([1, 2], "eagle2", max_new_tokens=10))


def test_until_the_window_is_full(models):
    target, head = models
    with single_thread():
        ref = run_generate(target, [1, 2, 3], max_new_tokens=None)
        engine = Engine(target, head)
        (req,) = engine.run([Request([1, 2, 3], "eagle2", TREES["eagle2"], max_new_tokens=None)])
    assert req.pending_tokens == ref.tokens
    assert req.stats.stop_reason == "context_full" == ref.stats.stop_reason
    assert len(req.pending_tokens) == target.config.max_position_embeddings - 3


@pytest.mark.parametrize("method", ["vanilla", "eagle", "eagle2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_step_makes_no_host_sync(models, monkeypatch, method, temperature):
    """The step itself never reads a tensor back (no per-node .item() / .tolist()). On a CPU the
    exact decode attention reads its tail width on the host (free there, and it never runs on a
    GPU), so the count runs with the kernel a GPU takes."""
    from eaglespec import attention

    monkeypatch.setattr(attention, "DECODE_KERNEL", "sdpa")
    target, head = models
    engine = Engine(target, head, max_batch=3)
    reqs = [engine.submit(Request(p, method, TREES[method], SamplingConfig(temperature, seed=1), 50))
            for p in PROMPTS[:3]]
    engine.step()  # admit and prefill (host work) outside the count
    lane = next(iter(engine.lanes.values()))
    state = lane.state.rows(3)
    sampling = RowSampling.from_configs([r.sampling for r in reqs])
    counter = SyncCounter(monkeypatch)
    with torch.inference_mode():
        for _ in range(3):
            lane.step_fn(state, sampling, max(lane.lengths) + 20)
    assert counter.calls == []


@pytest.mark.parametrize("method", ["vanilla", "eagle2"])
def test_fixed_shapes_give_the_same_tokens(models, method):
    """Capacity-wide views and bucketed rows (the CUDA-graph layout) change nothing but speed."""
    target, head = models
    with single_thread():
        def jobs():
            return [Request(p, method, TREES[method], SamplingConfig(0.8 * (i % 2), seed=i), 15 + i)
                    for i, p in enumerate(PROMPTS[:3])]

        exact = Engine(target, head, eos_ids=[7]).run(jobs())
        fixed = Engine(target, head, eos_ids=[7], fixed_shapes=True).run(jobs())
    assert [r.pending_tokens for r in fixed] == [r.pending_tokens for r in exact]
    assert all(len(r.pending_tokens) == 15 + i for i, r in enumerate(exact))


def test_fixed_shape_steps_repeat_the_same_ops(models):
    """Graph-capturable on the CPU's evidence: with fixed shapes, every step runs the same
    sequence of operators on tensors of the same shapes (and, per test_step_makes_no_host_sync,
    reads nothing back), whatever the rows accept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Trace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.ops.append((str(func), shapes))
            return func(*args, **(kwargs or {}))

    target, head = models
    engine = Engine(target, head, max_batch=4, fixed_shapes=True)
    for i, p in enumerate(PROMPTS[:3]):
        engine.submit(Request(p, "eagle2", TREES["eagle2"], SamplingConfig(0.9 * (i % 2), seed=i), 60))
    engine.step()
    lane = next(iter(engine.lanes.values()))
    traces = []
    with torch.inference_mode():
        for _ in range(4):
            with Trace() as t:
                acc = lane.step_fn(lane.state.rows(4), lane._row_sampling(4),
                                   lane.state.target_cache.capacity - lane.step_fn.budget, exact=False)
            traces.append(t.ops)
            counts = acc.count.tolist()
    assert len(traces[0]) > 100
    assert all(t == traces[0] for t in traces[1:])
    assert counts  # the rows did advance


def test_drafted_provenance_per_chunk(models):
    """pending_drafted says, per emitted chunk, how many leading tokens were accepted drafts: 0 for
    the prefill's token, the step's accepted count otherwise (cut where a stop cut the chunk)."""
    from spec_helpers import OracleProposer, RecordingEngine

    target, head = models
    with single_thread():
        engine = RecordingEngine(target, head, eos_ids=[7],
                                 proposer=lambda h, t, c: OracleProposer(h, t, c, p_oracle=0.7, noise=0.1))
        reqs = engine.run([Request(p, "eagle2", TREES["eagle2"], max_new_tokens=m)
                           for p, m in zip(PROMPTS[:3], (30, 13, 25))])
    seen_draft = 0
    for req in reqs:
        chunks, drafted = list(req.pending), list(req.pending_drafted)
        assert len(chunks) == len(drafted) == req.stats.steps + 1
        assert drafted[0] == 0 and len(chunks[0]) == 1
        records = [rec for rec in engine.log if rec.req is req]
        assert len(records) == req.stats.steps
        for chunk, d, rec in zip(chunks[1:], drafted[1:], records):
            assert d == min(rec.count - 1, len(chunk))
        seen_draft += sum(drafted)
    assert seen_draft > 0  # the oracle's drafts were accepted, so the test saw them


def test_prune_lanes_drops_idle_settings_only(models):
    """A server that takes tree settings per request bounds the lanes it keeps."""
    target, head = models
    with single_thread():
        engine = Engine(target, head, eos_ids=[7])
        trees = [TreeConfig("eagle2", total_tokens=t, depth=3, top_k=3) for t in (4, 6, 8)]
        engine.run([Request([5, 6], "eagle2", t, max_new_tokens=3) for t in trees])
        busy = engine.submit(Request([5, 6, 7], "vanilla", None, max_new_tokens=20))
        engine.step()  # the vanilla request holds a row now
        assert len(engine.lanes) == 4
        engine.prune_lanes(2)
        assert len(engine.lanes) == 2 and ("vanilla",) in engine.lanes
        engine.prune_lanes(0)  # a busy lane stays whatever the limit
        assert list(engine.lanes) == [("vanilla",)]
        while not busy.done:
            engine.step()
    assert busy.pending_tokens == alone(target, head, [5, 6, 7], "vanilla", max_new_tokens=20)
