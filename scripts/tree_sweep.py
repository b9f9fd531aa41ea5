"""eagle2 tree settings against vanilla, interleaved prompt by prompt in one process (the engine,
the shipped head). Prints numbers, asserts nothing.

  python scripts/tree_sweep.py --data ../shared/data/mt_bench/question.jsonl --skip 10 --prompts 20 \\
      --trees 16,5,4 16,4,4 12,4,4 8,3,4 12,3,4
Several --draft heads run side by side (each head x each tree, all interleaved), to compare heads'
speed as well as tau on the same prompts and the same warm machine. At --temperature > 0 a tree
with top-k > 1 is the sampled layout (spec/propose.py); --top-k-trees adds an arm of each as the
reranked top-k tree verified with q = 1, the behaviour before sampled trees.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from eaglespec.api import EagleSpec, set_threads
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Request
from eaglespec.spec import propose


def first_turn(record: dict) -> str:
    return record["turns"][0] if "turns" in record else record["question"]  # MT-bench or GSM8K


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench or GSM8K jsonl")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--trees", nargs="+", default=["16,5,4", "12,4,4", "8,3,4"],
                    help="total_tokens,depth,top_k (eagle2), or eagle1 (EAGLE-1's default layout)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--draft", nargs="+", default=["default"], help="head directories (default: the shipped head)")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeded by the prompt's index")
    ap.add_argument("--top-k-trees", action="store_true",
                    help="with --temperature > 0: also each top-k > 1 tree as the reranked top-k tree (q = 1)")
    args = ap.parse_args()
    set_threads()
    specs = [EagleSpec.load(dtype=args.dtype, draft=d, quant=args.quant) for d in args.draft]
    e = specs[0]
    lines = [x for x in Path(args.data).read_text().splitlines() if x.strip()]
    prompts = [e.encode(first_turn(json.loads(x)))[1] for x in lines[args.skip: args.skip + args.prompts]]
    trees = [TreeConfig("eagle") if t == "eagle1" else TreeConfig("eagle2", *map(int, t.split(",")))
             for t in args.trees]
    # (head index, tree, sampled layout for sampled rows)
    arms = [(0, None, True)] + [(h, tree, True) for tree in trees for h in range(len(specs))]
    if args.top_k_trees:
        arms += [(h, tree, False) for tree in trees if tree.top_k > 1 for h in range(len(specs))]
    acc = [[0, 0.0, 0] for _ in arms]
    for h, tree, sampled in arms:  # warm-up, untimed: kernel builds and first calls stay out of the first arm
        propose.SAMPLED_TREES = sampled
        specs[h].engine.run([Request(prompts[0], "vanilla" if tree is None else tree.method, tree,
                                     SamplingConfig(temperature=args.temperature, seed=0), max_new_tokens=8)])
    for j, ids in enumerate(prompts):
        order = list(enumerate(arms))
        for i, (h, tree, sampled) in order[j % len(arms):] + order[: j % len(arms)]:  # rotate to spread drift
            propose.SAMPLED_TREES = sampled
            sampling = SamplingConfig(temperature=args.temperature, seed=j)
            method = "vanilla" if tree is None else tree.method
            r = Request(ids, method, tree, sampling, max_new_tokens=args.max_new_tokens)
            t0 = time.perf_counter()
            specs[h].engine.run([r])
            acc[i][0] += len(r.pending_tokens)
            acc[i][1] += time.perf_counter() - t0
            acc[i][2] += r.stats.steps
    base = acc[0][0] / acc[0][1]
    heads = ", ".join(args.draft)
    print(f"{e.target.dtype} {e.target.quant}, head {heads}, T={args.temperature}, {len(prompts)} prompts of "
          f"{args.data}, {args.max_new_tokens} new tokens")
    several = len(specs) > 1
    print("| tree (total, depth, top-k) |" + (" head |" if several else "") + " tokens/s | speedup | tau |\n"
          + "|---" * (5 if several else 4) + "|")
    for (h, tree, sampled), (n, wall, steps) in zip(arms, acc):
        name = "vanilla" if tree is None else f"{tree.total_tokens}, {tree.depth}, {tree.top_k}"
        if tree is not None and tree.method == "eagle":
            name = "eagle1 (default layout)"
        if tree is not None and tree.top_k > 1 and args.temperature > 0:
            name += " sampled" if sampled else " top-k"
        head = f" {args.draft[h] if tree is not None else '-'} |" if several else ""
        print(f"| {name} |{head} {n / wall:.1f} | {n / wall / base:.3f}x | {(n - len(prompts)) / max(1, steps):.2f} |")


if __name__ == "__main__":
    main()
