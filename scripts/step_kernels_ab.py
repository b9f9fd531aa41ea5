"""The step's small CPU kernels (csrc/pointwise.cpp: greedy verification, the KV keep;
csrc/sampling.cpp: temperature-only softmax, draws, uniforms, speculative sampling) against the
torch ops they replace, in one process: vanilla and eagle2 trees on MT-bench first turns, at
T=0 and T=1, the arms interleaved per prompt (their order alternating by repeat). At T=0 every
output must be identical between the arms; at T=1 the arms sample from softmaxes that differ in
the last bits, so outputs may part. Prints tokens/s of each arm and their ratio.

  python scripts/step_kernels_ab.py --data ../shared/data/mt_bench/question.jsonl --skip 10 --prompts 8 \\
      --trees 3,2,1 --t1-trees 2,1,1 3,2,1
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch

import eaglespec.sampling as sampling_mod
import eaglespec.spec.rng as rng_mod
import eaglespec.spec.sampling as spec_sampling_mod
import eaglespec.spec.verify as verify_mod
from eaglespec.api import EagleSpec
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.kv_cache import RowKVCache
from eaglespec.runtime.engine import Request


@contextmanager
def torch_ops():
    """The step's routing points to the new kernels, pointed back at the torch ops."""
    saved = [(verify_mod, "ops_kernel"), (rng_mod, "ops_kernel"), (sampling_mod, "cpu_softmax"),
             (spec_sampling_mod, "cpu_softmax"), (RowKVCache, "keep")]
    old = [getattr(o, n) for o, n in saved]
    verify_mod.ops_kernel = rng_mod.ops_kernel = lambda: None
    sampling_mod.cpu_softmax = spec_sampling_mod.cpu_softmax = lambda *a: None
    RowKVCache.keep = RowKVCache.keep_indexed
    try:
        yield
    finally:
        for (o, n), v in zip(saved, old):
            setattr(o, n, v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--trees", nargs="*", default=["3,2,1"], help="eagle2 trees at T=0: total_tokens,depth,top_k")
    ap.add_argument("--t1-trees", nargs="*", default=["2,1,1", "3,2,1"], help="eagle2 trees at T=1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    eagle = EagleSpec.load(draft="default", quant=args.quant)
    lines = open(args.data, encoding="utf-8").read().splitlines()[args.skip:args.skip + args.prompts]
    prompts = [eagle.encode(json.loads(line)["turns"][0])[1] for line in lines]
    cases = [(0.0, "vanilla", None)] + [(0.0, t, TreeConfig("eagle2", *map(int, t.split(",")))) for t in args.trees]
    cases += [(1.0, "vanilla", None)] + [(1.0, t, TreeConfig("eagle2", *map(int, t.split(",")))) for t in args.t1_trees]

    def run(prompt: list[int], temperature: float, tree: TreeConfig | None, seed: int) -> Request:
        req = Request(prompt, "vanilla" if tree is None else "eagle2", tree,
                      SamplingConfig(temperature=temperature, seed=seed), max_new_tokens=args.max_new_tokens)
        eagle.engine.run([req])
        return req

    for temp, _, tree in cases:  # warm-up (and the tree tuner's cache, if any)
        run(prompts[0], temp, tree, 0)
    seconds: dict = {}
    tokens: dict = {}
    outputs: dict = {}
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for temp, name, tree in cases:
                for kernels_on in ((True, False) if rep % 2 == 0 else (False, True)):
                    key = (temp, name, kernels_on)
                    t0 = time.perf_counter()
                    if kernels_on:
                        req = run(prompt, temp, tree, i)
                    else:
                        with torch_ops():
                            req = run(prompt, temp, tree, i)
                    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
                    tokens[key] = tokens.get(key, 0) + len(req.pending_tokens)
                    outputs.setdefault(key, []).append(list(req.pending_tokens))
    print(f"{len(prompts)} prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens, quant {args.quant}, "
          f"one thread")
    print("| T | method | torch ops, tokens/s | kernels, tokens/s | kernels / torch | x vanilla (kernels) | "
          "x vanilla (torch) | outputs equal |")
    print("|---|---|---|---|---|---|---|---|")
    for temp, name, _ in cases:
        rate = {on: tokens[temp, name, on] / seconds[temp, name, on] for on in (True, False)}
        van = {on: tokens[temp, "vanilla", on] / seconds[temp, "vanilla", on] for on in (True, False)}
        runs = len(outputs[temp, name, True])
        same = sum(a == b for a, b in zip(outputs[temp, name, True], outputs[temp, name, False]))
        print(f"| {temp:g} | {name} | {rate[False]:.1f} | {rate[True]:.1f} | {rate[True] / rate[False]:.2f}x | "
              f"{rate[True] / van[True]:.2f}x | {rate[False] / van[False]:.2f}x | {same}/{runs} |")
        if temp == 0:
            assert same == runs, f"greedy outputs differ between the arms ({name})"


if __name__ == "__main__":
    main()
