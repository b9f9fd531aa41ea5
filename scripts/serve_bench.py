"""Throughput and latency of `eaglespec serve` with 1, 4, 16 concurrent streaming clients,
vanilla against eagle2, and the server's overhead against `eaglespec generate`. Prints numbers and
writes a markdown table; asserts nothing.

Starts `python -m eaglespec.serve` on the default model (SmolLM2-135M GGUF, the shipped head) on a
free loopback port. Each client is a closed loop: it sends its next request when the previous one
ends. Prompts are MT-bench first turns (../shared/data/mt_bench) when present, else a few built in.
Levels and methods are interleaved (for each level, each method), so machine drift hits both.

  python scripts/serve_bench.py --clients 1,4,16 --max-tokens 64 --out runs/serve_bench.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

BUILTIN = ["Why is the sky blue?", "Write a haiku about the sea.", "Explain what a hash table is.",
           "Give three tips for learning a new language.", "What causes the seasons on Earth?",
           "Summarise the plot of Romeo and Juliet in two sentences.", "How do vaccines work?",
           "Write a short email asking for a meeting next week."]


@dataclass
class Sample:
    """One request as its client saw it."""

    tokens: int
    ttft_s: float  # request sent -> first content
    tpot_s: float  # (last - first) / (tokens - 1)
    e2e_s: float
    tau: float


@dataclass
class Level:
    method: str
    clients: int
    wall_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s if self.wall_s else 0.0


def prompts(limit: int) -> list[str]:
    try:
        from eaglespec.bench.datasets import load_dataset

        return [item.turns[0] for item in load_dataset("mt_bench", limit=limit)]
    except Exception as e:  # no shared data here: the built-in prompts will do
        print(f"# MT-bench not available ({e}); using built-in prompts", file=sys.stderr)
        return BUILTIN[:limit]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(url: str, model: str, prompt: str, method: str, max_tokens: int) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "eaglespec": {"method": method}}
    t0 = time.perf_counter()
    first = last = None
    usage, report = {}, {}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if "method" in event.get("eaglespec", {}):
                report = event["eaglespec"]
            if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    first = first or end
    tpot = (last - first) / (n - 1) if last and n > 1 else 0.0
    return Sample(n, first - t0, tpot, end - t0, report.get("tau", 0.0))


def run_level(url: str, model: str, method: str, clients: int, per_client: int, texts: list[str],
              max_tokens: int) -> Level:
    level = Level(method, clients)
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(per_client):
            sample = one_request(url, model, texts[(c * per_client + i) % len(texts)], method, max_tokens)
            with lock:
                level.samples.append(sample)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.wall_s = time.perf_counter() - t0
    return level


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return 0.0
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def generate_tokens_per_s(args, texts: list[str], method: str) -> float:
    """`eaglespec generate` on the same prompts: total new tokens over total generation time."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for t in texts:
            f.write(json.dumps({"prompt": t}) + "\n")
    cmd = [sys.executable, "-m", "eaglespec", "generate", "--prompts", f.name, "--json", "--method", method,
           "--max-new-tokens", str(args.max_tokens), "--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return sum(r["new_tokens"] for r in recs) / sum(r["wall_s"] for r in recs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--methods", default="vanilla,eagle2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after another")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--overhead-prompts", type=int, default=4, help="prompts for the overhead check (0: skip)")
    ap.add_argument("--out", default="runs/serve_bench.md")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    methods = args.methods.split(",")
    texts = prompts(max(max(levels) * args.per_client, args.overhead_prompts))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "eaglespec.serve", "--port", str(port), "--dtype", args.dtype,
                               "--max-batch", str(args.max_batch), "--log-level", "warning"])
    rows: list[Level] = []
    overhead = []
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            try:
                if requests.get(url + "/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        model = requests.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        for m in methods:  # warm-up: lanes allocated, weights in cache
            one_request(url, model, texts[0], m, 8)
        for clients in levels:
            for m in methods:
                level = run_level(url, model, m, clients, args.per_client, texts, args.max_tokens)
                rows.append(level)
                print(f"{m:8s} clients {clients:3d}: {level.tokens_per_s:7.1f} tokens/s, "
                      f"TTFT p50 {pct([s.ttft_s for s in level.samples], .5):.3f} s", flush=True)
        if args.overhead_prompts:
            few = texts[:args.overhead_prompts]
            for m in methods:
                served = [one_request(url, model, t, m, args.max_tokens) for t in few]
                serve_tps = sum(s.tokens for s in served) / sum(s.e2e_s for s in served)
                overhead.append((m, serve_tps))
    finally:
        server.terminate()
        server.wait(60)
    overhead = [(m, tps, generate_tokens_per_s(args, texts[:args.overhead_prompts], m)) for m, tps in overhead]

    lines = ["| method | clients | requests | tokens/s (total) | x 1 client | TTFT p50 / p99 (s) | "
             "TPOT p50 / p99 (ms) | tau |", "|---|---|---|---|---|---|---|---|"]
    base = {r.method: r.tokens_per_s for r in rows if r.clients == levels[0]}
    for r in rows:
        ttft = [s.ttft_s for s in r.samples]
        tpot = [s.tpot_s * 1000 for s in r.samples if s.tokens > 1]
        tau = statistics.mean(s.tau for s in r.samples) if r.samples else 0.0
        lines.append(f"| {r.method} | {r.clients} | {len(r.samples)} | {r.tokens_per_s:.1f} | "
                     f"{r.tokens_per_s / base[r.method]:.2f}x | {pct(ttft, .5):.2f} / {pct(ttft, .99):.2f} | "
                     f"{pct(tpot, .5):.0f} / {pct(tpot, .99):.0f} | {tau:.2f} |")
    if overhead:
        lines += ["", "| method | one streaming client, tokens/s | `eaglespec generate`, tokens/s | ratio |",
                  "|---|---|---|---|"]
        lines += [f"| {m} | {s:.1f} | {g:.1f} | {s / g:.2f} |" for m, s, g in overhead]
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(f"`{' '.join(sys.argv)}`, max_tokens {args.max_tokens}, greedy\n\n{table}\n")


if __name__ == "__main__":
    main()
