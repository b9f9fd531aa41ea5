"""Many clients at once: 32 concurrent streams with different prompts, lengths, methods and
sampling each get exactly what the same request gets alone (fp32; greedy and seeded sampling),
none is lost, a client dropped mid-stream frees its row at once without disturbing the others,
and a full waiting queue answers 429."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests

from eaglespec.config import SamplingConfig, TreeConfig
from serve_helpers import PROMPTS, load_spec, metric_samples, oracle_engine, running_server, sse_events


@dataclass
class Case:
    prompt: str
    method: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    tree: tuple | None = None  # eagle2 (total_tokens, depth, top_k)

    def body(self, model: str) -> dict:
        spec = {"method": self.method}
        if self.tree:
            spec.update(zip(("total_tokens", "depth", "top_k"), self.tree))
        return {"model": model, "messages": [{"role": "user", "content": self.prompt}], "stream": True,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "eaglespec": spec,
                "stream_options": {"include_usage": True}}

    def alone(self, spec) -> tuple[str, int]:
        # No tree: the API's default, which depends on the temperature as the server's does.
        tree = TreeConfig("eagle2", *self.tree) if self.method == "eagle2" and self.tree else None
        r = spec.generate([{"role": "user", "content": self.prompt}], method=self.method, tree=tree,
                          max_new_tokens=self.max_tokens,
                          sampling=SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed))
        return r.text, r.new_tokens


def cases(n: int = 32) -> list[Case]:
    out = []
    methods = ["vanilla", "eagle2", "eagle"]
    for i in range(n):
        sampled = i % 3 == 1
        out.append(Case(PROMPTS[i % len(PROMPTS)] + (" yes" * (i // 8)), methods[i % 3], 6 + (i * 7) % 40,
                        temperature=0.8 if sampled else 0.0, top_p=0.9 if i % 4 == 1 else 1.0,
                        top_k=12 if i % 5 == 1 else 0, seed=100 + i if sampled else None,
                        tree=(6, 2, 3) if i % 6 == 1 else None))
    return out


def stream_text(url: str, body: dict) -> tuple[str, int, str]:
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    final = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]][0]
    return text, events[-2]["usage"]["completion_tokens"], final["choices"][0]["finish_reason"]


def test_32_concurrent_streams_equal_alone(tiny_chat_checkpoint_256):
    # Drafts the target often accepts (an oracle: the target's own top tokens, from the context
    # alone), so accepted runs, bonus tokens and stops inside a run happen while requests come and go.
    reference = oracle_engine(load_spec(tiny_chat_checkpoint_256), 1.0, 0.0, memo=True)
    todo = cases()
    expected = [c.alone(reference) for c in todo]
    with running_server(oracle_engine(load_spec(tiny_chat_checkpoint_256), 1.0, 0.0, memo=True)) as srv:
        dropped = threading.Event()

        def drop_midway():
            """A client that reads three events of a long answer and goes away."""
            body = Case("a dog and a bird", "eagle2", 200).body(srv.model)
            with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 5:
                        break
            dropped.set()

        peak = [0, 0]
        done = threading.Event()

        def watch():  # how many ran together, and waited: the batch was really shared
            while not done.is_set():
                running, waiting = srv.worker.counts()
                peak[0], peak[1] = max(peak[0], running), max(peak[1], waiting)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(len(todo) + 1) as pool:
            drop = pool.submit(drop_midway)
            got = list(pool.map(lambda c: stream_text(srv.url, c.body(srv.model)), todo))
            drop.result()
        done.set()
        watcher.join()
        assert dropped.is_set()
        assert peak[0] >= 8 and peak[1] >= 1, peak
        for case, (text, n, finish), (ref_text, ref_n) in zip(todo, got, expected):
            assert (text, n) == (ref_text, ref_n), case
            assert finish in ("stop", "length")
        deadline = time.monotonic() + 10
        while srv.worker.counts() != (0, 0):  # every request finished or freed its row
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert requests.get(srv.url + "/health", timeout=5).json() == {"status": "ok", "running": 0, "waiting": 0}
        samples = metric_samples(requests.get(srv.url + "/metrics", timeout=5).text)
        status = {k[2][1]: v for k, v in samples.items() if k[0] == "eaglespec:requests_total" and v}
        assert status == {"finished": 32.0, "cancelled": 1.0}
        assert samples[("eaglespec:spec_decode_num_accepted_tokens_total", ("model_name", srv.model))] > 20
        # Still serving after all that.
        assert stream_text(srv.url, todo[0].body(srv.model))[:2] == expected[0]


def test_dropped_client_frees_its_row_at_once(tiny_chat_checkpoint_256):
    spec = load_spec(tiny_chat_checkpoint_256)
    step = spec.engine.step

    def slow_step():  # a slow model: the answer is still running when the client leaves
        time.sleep(0.01)
        return step()

    spec.engine.step = slow_step
    with running_server(spec) as srv:
        body = Case("hello world", "eagle2", 200).body(srv.model)
        with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=30) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
            assert srv.worker.counts() == (1, 0)
        t0 = time.monotonic()
        while srv.worker.counts() != (0, 0):
            assert time.monotonic() - t0 < 2.0, "the row was not freed"
            time.sleep(0.01)
        lane = spec.engine.lanes[("eagle2", 8, 3, 4)]
        assert lane.active == []
        samples = metric_samples(requests.get(srv.url + "/metrics", timeout=5).text)
        assert samples[("eaglespec:requests_total", ("model_name", srv.model), ("status", "cancelled"))] == 1
        assert samples[("eaglespec:generation_tokens_total", ("model_name", srv.model))] < 100


def test_full_queue_answers_429(tiny_chat_checkpoint_256):
    with running_server(load_spec(tiny_chat_checkpoint_256), max_waiting=2) as srv:
        body = Case("hello world", "vanilla", 8).body(srv.model)
        with ThreadPoolExecutor(2) as pool:
            with srv.worker.paused():  # nothing is admitted: two wait, the third is refused
                waiting = [pool.submit(stream_text, srv.url, body) for _ in range(2)]
                deadline = time.monotonic() + 10
                while srv.worker.counts()[1] < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                r = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=10)
                assert r.status_code == 429
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            texts = [f.result(timeout=30) for f in waiting]
        assert texts[0] == texts[1] and texts[0][1] == 8
        assert requests.post(srv.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200


@pytest.mark.parametrize("n_lanes", [2])
def test_per_request_trees_keep_lanes_bounded(tiny_chat_checkpoint_256, n_lanes):
    """Requests naming many tree settings one after another: idle lanes are dropped past --max-lanes."""
    with running_server(load_spec(tiny_chat_checkpoint_256), max_lanes=n_lanes) as srv:
        for total in (3, 4, 5, 6, 7):
            case = Case("hello world", "eagle2", 4, tree=(total, 2, 2))
            assert stream_text(srv.url, case.body(srv.model))[1] == 4
        assert len(srv.spec.engine.lanes) <= n_lanes + 1
