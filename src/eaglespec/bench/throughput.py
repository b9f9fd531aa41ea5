"""Throughput with many requests in flight: `eaglespec bench --batch-size B`.

The first turn of every prompt is queued at once into a fresh engine that runs up to B rows per
method (continuous batching: a finished request's row takes the next waiting one). Batch size 1
runs the same queue one request at a time, so the table shows what batching buys, per method,
measured in one process with the batch sizes interleaved method by method. Greedy outputs must be
identical at every batch size (exactly so in fp32; reduced precision may round near-ties apart).
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field

from ..config import SamplingConfig, TreeConfig
from ..runtime.engine import Engine, Request
from .datasets import BenchItem


@dataclass
class ThroughputRow:
    method: str
    batch_size: int
    requests: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    steps: int  # engine steps of this lane (one step advances every running row)
    tau: float
    draft_ms_per_step: float = 0.0  # propose + commit, per engine step
    verify_ms_per_step: float = 0.0  # target forward + verify + cache compaction, per engine step
    identical_to_batch1: int | None = None  # greedy outputs equal to batch size 1's
    peak_rss_mb: float = 0.0  # process peak so far (Linux ru_maxrss)


@dataclass
class ThroughputResult:
    rows: list[ThroughputRow] = field(default_factory=list)
    setup: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"setup": self.setup, "rows": [asdict(r) for r in self.rows]}


def _prompts(eagle, items: list[BenchItem]) -> list[list[int]]:
    from .runner import _encode

    return [_encode(eagle, [{"role": "user", "content": it.turns[0]}])[1] for it in items]


def run_once(eagle, prompts: list[list[int]], method: str, tree: TreeConfig | None, batch_size: int,
             max_new_tokens: int, sampling: SamplingConfig) -> tuple[float, list[Request], int]:
    """All prompts through a fresh engine with `batch_size` rows; (wall seconds, requests, steps)."""
    engine = Engine(eagle.target, eagle.head, eos_ids=eagle.tokenizer.eos_token_ids,
                    decode=eagle.tokenizer.decode, max_batch=batch_size)
    reqs = [Request(p, method, tree, sampling, max_new_tokens) for p in prompts]
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    steps = 0
    while engine.step():
        steps += 1
    wall = time.perf_counter() - t0
    return wall, reqs, steps


def run_throughput(eagle, items: list[BenchItem], methods: list[str], tree: TreeConfig, batch_size: int,
                   max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> ThroughputResult:
    """Each engine method at batch size 1 and `batch_size`, on the first turns of `items`."""
    prompts = _prompts(eagle, items)
    window = eagle.target.config.max_position_embeddings
    prompts = [p for p in prompts if len(p) + max_new_tokens <= window]
    sampling = SamplingConfig(temperature=temperature, seed=seed)
    result = ThroughputResult(setup={"model": eagle.source.name, "head": eagle.head_name or None,
                                     "dtype": str(eagle.target.dtype).replace("torch.", ""),
                                     "device": str(eagle.target.device), "prompts": len(prompts),
                                     "max_new_tokens": max_new_tokens, "temperature": temperature})
    sizes = [1] if batch_size == 1 else [1, batch_size]
    for method in methods:
        t = None if method == "vanilla" else TreeConfig(method, tree.total_tokens, tree.depth, tree.top_k,
                                                        tree.choices)
        run_once(eagle, prompts[:1], method, t, 1, 8, sampling)  # warm-up
        ref: list[list[int]] | None = None
        for b in sizes:
            wall, reqs, steps = run_once(eagle, prompts, method, t, b, max_new_tokens, sampling)
            outs = [r.pending_tokens for r in reqs]
            n = sum(len(o) for o in outs)
            spec_steps = sum(r.stats.steps for r in reqs)
            same = None
            if ref is None:
                ref = outs
            elif sampling.greedy or sampling.seed is not None:
                same = sum(a == b_ for a, b_ in zip(outs, ref))
            # Every request in a step records that step's times: average them over request-steps.
            per_step = 1e3 / max(1, spec_steps)
            row = ThroughputRow(method, b, len(reqs), n, wall, n / wall, steps,
                                sum(len(o) - 1 for o in outs) / max(1, spec_steps),
                                per_step * sum(r.stats.draft_s for r in reqs),
                                per_step * sum(r.stats.verify_s for r in reqs), same,
                                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            result.rows.append(row)
            print(f"# {method} batch {b}: {row.tokens_per_s:.1f} tok/s, tau {row.tau:.2f}, {steps} steps"
                  + (f", {same}/{len(reqs)} identical to batch 1" if same is not None else ""), file=sys.stderr)
    return result


def throughput_table(result: ThroughputResult) -> str:
    lines = ["| method | batch | requests | tokens/s | x batch 1 | tau | draft ms/step | verify ms/step | "
             "identical to batch 1 |", "|---|---|---|---|---|---|---|---|---|"]
    base = {r.method: r.tokens_per_s for r in result.rows if r.batch_size == 1}
    for r in result.rows:
        ratio = r.tokens_per_s / base[r.method] if base.get(r.method) else float("nan")
        same = "-" if r.identical_to_batch1 is None else f"{r.identical_to_batch1}/{r.requests}"
        lines.append(f"| {r.method} | {r.batch_size} | {r.requests} | {r.tokens_per_s:.1f} | {ratio:.2f}x | "
                     f"{r.tau:.2f} | {r.draft_ms_per_step:.1f} | {r.verify_ms_per_step:.1f} | {same} |")
    return "\n".join(lines) + "\n"
