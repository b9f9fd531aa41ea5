"""Prometheus metrics of one server, named after vLLM's (`vllm:` becomes `eaglespec:`).

Speculation counters are updated after every engine step from each request's own statistics, so
they are live during long answers and, summed over requests, equal what the requests report.
Each server has its own registry (several servers in one process, as in the tests, stay apart).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from .worker import Job

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]
        self.drafts = Counter("eaglespec:spec_decode_num_drafts", "Draft-verify steps of speculative requests",
                              m, registry=r)
        self.draft_tokens = Counter("eaglespec:spec_decode_num_draft_tokens",
                                    "Draft tokens proposed (tree nodes below the root)", m, registry=r)
        self.accepted = Counter("eaglespec:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target",
                                m, registry=r)
        self.accepted_pos = Counter("eaglespec:spec_decode_num_accepted_tokens_per_pos",
                                    "Steps that accepted a draft token at this depth (0: the first)",
                                    m + ["position"], registry=r)
        self.generation = Counter("eaglespec:generation_tokens", "Tokens generated", m, registry=r)
        self.prompt = Counter("eaglespec:prompt_tokens", "Prompt tokens of requests run", m, registry=r)
        self.prompt_cached = Counter("eaglespec:prompt_tokens_cached",
                                     "Prompt tokens not prefilled: their KV was reused from a previous request "
                                     "in the same row", m, registry=r)
        self.requests = Counter("eaglespec:requests", "Generation requests by how they ended "
                                "(finished, cancelled, error, rejected)", m + ["status"], registry=r)
        self.running = Gauge("eaglespec:num_requests_running", "Requests holding a row", m, registry=r)
        self.waiting = Gauge("eaglespec:num_requests_waiting", "Requests waiting for a row", m, registry=r)
        self.ttft = Histogram("eaglespec:time_to_first_token_seconds", "Time to first token", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("eaglespec:time_per_output_token_seconds", "Time per output token after the first",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("eaglespec:e2e_request_latency_seconds", "Time from submission to the last token", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        # Every series exists from the start (at 0), so a scrape before any request sees them all.
        for metric in (self.drafts, self.draft_tokens, self.accepted, self.generation, self.prompt, self.prompt_cached,
                       self.running, self.waiting, self.ttft, self.tpot, self.e2e):
            metric.labels(model_name)
        for status in ("finished", "cancelled", "error", "rejected"):
            self.requests.labels(model_name, status)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def tokens(self, job: "Job", chunks: list[list[int]], drafted: list[int]) -> None:
        """New tokens of one request, and the steps it made since the last call."""
        name, st = self.model_name, job.req.stats
        n = sum(map(len, chunks))
        if n:
            self.generation.labels(name).inc(n)
        sizes = st.tree_sizes[job.seen_steps:]
        job.seen_steps = len(st.tree_sizes)
        spec = [s for s in sizes if s > 1]  # vanilla steps (a one-node tree) draft nothing
        if spec:
            self.drafts.labels(name).inc(len(spec))
            self.draft_tokens.labels(name).inc(sum(s - 1 for s in spec))
        per_pos = st.accepted_per_depth
        for pos, total in enumerate(per_pos):
            before = job.seen_per_pos[pos] if pos < len(job.seen_per_pos) else 0
            if total > before:
                self.accepted_pos.labels(name, str(pos)).inc(total - before)
                self.accepted.labels(name).inc(total - before)
        job.seen_per_pos = list(per_pos)

    def finished(self, job: "Job", status: str) -> None:
        name, req = self.model_name, job.req
        self.requests.labels(name, status).inc()
        self.prompt.labels(name).inc(len(req.prompt_ids))
        self.prompt_cached.labels(name).inc(req.stats.cached_tokens)
        end = time.perf_counter()
        if req.t_submit:
            self.e2e.labels(name).observe(end - req.t_submit)
        n = req.stats.new_tokens
        if job.t_first is not None and n > 1:
            self.tpot.labels(name).observe((end - job.t_first) / (n - 1))

    def rejected(self) -> None:
        """A generation request refused before it ran (bad input, unknown model, full queue, no key)."""
        self.requests.labels(self.model_name, "rejected").inc()
