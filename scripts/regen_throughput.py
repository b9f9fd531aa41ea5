"""Answer tokens/s of `eaglespec regenerate` by batch size and with or without prefix reuse,
interleaved in one process.

Each round regenerates the same packaged ShareGPT conversations once per (batch, reuse) setting,
the order reversed every other round. With prefix reuse a conversation's next turn prefills only
its new message; without it every turn prefills its whole history. Prefill time is summed over
admissions. --decode-batches first prices one batched decode step at those row counts (prompts of
300 tokens), which bounds what batching can give. --packing on off loads the target twice, with
its bf16 linears packed once for oneDNN (packed.py) and plain, and compares those too. Pin to one
core for figures the README quotes:

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/regen_throughput.py --batches 1 32 --reuse on
    OMP_NUM_THREADS=1 taskset -c 0 python scripts/regen_throughput.py --conversations 64 --skip 0 \\
        --max-length 640 --decode-batches 1,8,32,64,128
    OMP_NUM_THREADS=1 taskset -c 0 python scripts/regen_throughput.py --reuse on --packing on off \\
        --decode-batches 1,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eaglespec import packed
from eaglespec.api import EagleSpec, set_threads
from eaglespec.runtime import engine as engine_mod
from eaglespec.train.data import load_conversations
from eaglespec.train.regenerate import RegenConfig, regenerate


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


def run_once(es, convs, cfg: RegenConfig, reuse: bool, out: Path) -> dict:
    """One regeneration into `out`, with the engine's prefix reuse forced on or off and its
    admissions timed."""
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
        t0 = time.perf_counter()
        rep = regenerate(es, convs, out, cfg, progress=False)
        wall = time.perf_counter() - t0
    finally:
        engine_mod.Engine.__init__, engine_mod.Lane.admit = make, admit
    return {"tokens_per_s": rep.tokens / wall, "wall_s": wall, "prefill_s": prefill[0], "answers": rep.answers,
            "prompt_tokens": rep.prompt_tokens, "cached_tokens": rep.cached_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--skip", type=int, default=200, help="start here in the packaged ShareGPT")
    p.add_argument("--batches", type=int, nargs="+", default=[32])
    p.add_argument("--reuse", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--quant", default="none")
    p.add_argument("--decode-batches", default="", help="rows per decode step to price, e.g. 1,32,64")
    p.add_argument("--packing", nargs="+", choices=["on", "off"], default=["on"],
                   help="bf16 linears packed once for oneDNN (the default) and/or plain F.linear")
    args = p.parse_args(argv)
    set_threads()
    engines = {}
    for pk in args.packing:
        packed.PACK_BF16 = pk == "on"
        engines[pk] = EagleSpec.load(args.model, quant=args.quant)
    packed.PACK_BF16 = True
    for b in [int(x) for x in args.decode_batches.split(",") if x]:
        for r in range(3 if len(engines) > 1 else 1):  # interleaved: packed and plain alternate
            for pk, es in engines.items():
                sec = decode_step_cost(es, b)
                print(f"decode step, {b} rows, packing {pk}: {sec * 1e3:.1f} ms, {b / sec:.0f} tokens/s",
                      file=sys.stderr, flush=True)
    convs = load_conversations(None).conversations[args.skip:args.skip + args.conversations]
    settings = [(b, r == "on", pk) for b in args.batches for r in args.reuse for pk in args.packing]
    rates: dict[tuple[int, bool, str], list[float]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for b, reuse, pk in (settings if r % 2 == 0 else settings[::-1]):
                cfg = RegenConfig(args.max_new_tokens, args.max_length, batch=b)
                out = run_once(engines[pk], convs, cfg, reuse, Path(tmp) / f"{r}_{b}_{reuse}_{pk}.jsonl")
                rates[(b, reuse, pk)].append(out["tokens_per_s"])
                print(f"round {r} batch {b} reuse {'on' if reuse else 'off'} packing {pk}: {out['tokens_per_s']:.0f} answer "
                      f"tokens/s, prefill {out['prefill_s']:.1f} of {out['wall_s']:.1f} s, {out['answers']} answers, "
                      f"{out['cached_tokens']:,} of {out['prompt_tokens']:,} prompt tokens reused",
                      file=sys.stderr, flush=True)
    if not rates or not args.rounds:
        return 0
    base = statistics.median(rates[settings[0]])
    print(f"\n| batch | prefix reuse | packing | answer tokens/s (median) | x batch {settings[0][0]}, "
          f"reuse {'on' if settings[0][1] else 'off'}, packing {settings[0][2]} |\n|---|---|---|---|---|")
    for b, reuse, pk in settings:
        m = statistics.median(rates[(b, reuse, pk)])
        print(f"| {b} | {'on' if reuse else 'off'} | {pk} | {m:.0f} | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
