"""Answer tokens/s of `eaglespec regenerate` with and without prefix reuse, interleaved.

Each round regenerates the same packaged ShareGPT conversations twice in this process, once with
the engine's prefix reuse (a conversation's next turn prefills only its new message) and once
without (every turn prefills its whole history), alternating which goes first. Prefill time is
summed over admissions. First, the cost of one batched decode step at --decode-batches rows
(prompts of 300 tokens), which bounds what batching can give. Pin to one core for figures the README can quote:
  OMP_NUM_THREADS=1 taskset -c 0 python scripts/regen_throughput.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eaglespec.api import EagleSpec
from eaglespec.runtime import engine as engine_mod
from eaglespec.train.data import load_conversations
from eaglespec.train.regenerate import RegenConfig, regenerate


def run_once(es, convs, cfg: RegenConfig, reuse: bool) -> dict:
    """One regeneration into a scratch file; the engine's admissions are timed."""
    prefill = [0.0]
    make, admit = engine_mod.Engine.__init__, engine_mod.Lane.admit

    def init(self, *a, **k):
        make(self, *a, **{**k, "reuse_prefix": reuse})

    def timed_admit(self, req):
        t0 = time.perf_counter()
        admit(self, req)
        prefill[0] += time.perf_counter() - t0

    engine_mod.Engine.__init__, engine_mod.Lane.admit = init, timed_admit
    try:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            rep = regenerate(es, convs, Path(d) / "out.jsonl", cfg, progress=False)
            wall = time.perf_counter() - t0
    finally:
        engine_mod.Engine.__init__, engine_mod.Lane.admit = make, admit
    return {"tokens_per_s": rep.tokens / wall, "wall_s": wall, "prefill_s": prefill[0], "answers": rep.answers,
            "prompt_tokens": rep.prompt_tokens, "cached_tokens": rep.cached_tokens}


def decode_step_cost(es, batch: int, prompt_len: int = 300, steps: int = 10) -> float:
    """Median seconds of one vanilla engine step with `batch` rows running."""
    eng = engine_mod.Engine(es.target, None, eos_ids=[], max_batch=batch)
    prompt = list(range(1000, 1000 + prompt_len))
    for _ in range(batch):
        eng.submit(engine_mod.Request(prompt, "vanilla", None, max_new_tokens=steps + 8))
    eng.step()  # admits every request (and steps once)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--decode-batches", default="1,8,32,64,128", help="rows per decode step to price ('' skips)")
    args = p.parse_args(argv)
    es = EagleSpec.load(args.model, quant="none")
    for b in [int(x) for x in args.decode_batches.split(",") if x]:
        sec = decode_step_cost(es, b)
        print(f"decode step, {b} rows: {sec * 1e3:.1f} ms, {b / sec:.0f} tokens/s", file=sys.stderr)
    convs = load_conversations(None, limit=args.conversations).conversations
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, max_length=args.max_length, batch=args.batch)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for reuse in ((True, False) if r % 2 == 0 else (False, True)):
            out = run_once(es, convs, cfg, reuse)
            runs[reuse].append(out)
            print(f"round {r} reuse {'on ' if reuse else 'off'}: {out['tokens_per_s']:.0f} answer tokens/s, "
                  f"prefill {out['prefill_s']:.1f} of {out['wall_s']:.1f} s, {out['answers']} answers, "
                  f"{out['cached_tokens']:,} of {out['prompt_tokens']:,} prompt tokens reused", file=sys.stderr)
    on = statistics.median(o["tokens_per_s"] for o in runs[True])
    off = statistics.median(o["tokens_per_s"] for o in runs[False])
    print(f"median: reuse on {on:.0f}, off {off:.0f} answer tokens/s: {on / off:.2f}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
