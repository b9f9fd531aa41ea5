"""Tokens/s of `eaglespec regenerate` at batch 1 and at larger batches, interleaved in one process.

    python scripts/regen_throughput.py --conversations 32 --batches 1 32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from eaglespec.api import EagleSpec, set_threads
from eaglespec.train.data import load_conversations
from eaglespec.train.regenerate import RegenConfig, regenerate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--skip", type=int, default=200, help="start here in the packaged ShareGPT")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--quant", default="none")
    args = p.parse_args()
    set_threads()
    es = EagleSpec.load(quant=args.quant)
    convs = load_conversations(None).conversations[args.skip:args.skip + args.conversations]
    rates: dict[int, list[float]] = {b: [] for b in args.batches}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for b in args.batches:
                cfg = RegenConfig(args.max_new_tokens, args.max_length, batch=b)
                rep = regenerate(es, convs, Path(tmp) / f"{r}_{b}.jsonl", cfg, progress=False)
                rates[b].append(rep.tokens / rep.seconds)
                print(f"round {r} batch {b}: {rep.summary()}", flush=True)
    base = statistics.median(rates[args.batches[0]])
    print("\n| batch | answer tokens/s (median) | x batch " + str(args.batches[0]) + " |\n|---|---|---|")
    for b in args.batches:
        m = statistics.median(rates[b])
        print(f"| {b} | {m:.0f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
