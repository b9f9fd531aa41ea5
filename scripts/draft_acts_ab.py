"""Int8 drafting with 8-bit activations (the W8A8 VNNI kernel) against 16-bit ones (the W8A16
kernel on AMX tiles, what a CPU with AMX now drafts with), side by side in one process: two
engines on the same int8a16 target weights, eagle2 at batch 1 and in batches, interleaved batch
by batch, one thread, T=0. Prints tokens/s, tau and drafting ms per request-step; asserts nothing.

  python scripts/draft_acts_ab.py --data ../shared/data/mt_bench/question.jsonl --skip 10 --prompts 8 \
      --tree 8,3,4 --batches 1,4
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import eaglespec.spec.draft_quant as draft_quant
from eaglespec.api import EagleSpec
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tree", default="8,3,4", help="eagle2 total_tokens,depth,top_k")
    ap.add_argument("--batches", default="1,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    chosen = draft_quant._acts
    draft_quant._acts = lambda in_features: "a8"  # the first engine's proposer: 8-bit activations
    engines = {"a8": EagleSpec.load(draft="default", quant="int8a16")}
    tree = TreeConfig("eagle2", *map(int, args.tree.split(",")))
    lines = open(args.data, encoding="utf-8").read().splitlines()[args.skip:args.skip + args.prompts]
    prompts = [json.loads(line)["turns"][0] for line in lines]

    def run(eagle, batch):
        reqs = [Request(eagle.encode(q)[1], "eagle2", tree, SamplingConfig(temperature=0.0),
                        max_new_tokens=args.max_new_tokens) for q in batch]
        t0 = time.perf_counter()
        eagle.engine.run(reqs)
        return reqs, time.perf_counter() - t0

    run(engines["a8"], prompts[:1])  # builds its proposer while _acts says "a8"
    draft_quant._acts = chosen
    engines["a16 where tiles run"] = EagleSpec.load(draft="default", quant="int8a16")
    run(engines["a16 where tiles run"], prompts[:1])
    res: dict = {}
    for size in map(int, args.batches.split(",")):
        for i in range(0, len(prompts), size):
            for name, eagle in engines.items():
                reqs, wall = run(eagle, prompts[i:i + size])
                d = res.setdefault((size, name), {"tokens": 0, "wall": 0.0, "steps": 0, "draft": 0.0})
                d["tokens"] += sum(len(r.pending_tokens) for r in reqs)
                d["wall"] += wall
                d["steps"] += sum(r.stats.steps for r in reqs)
                d["draft"] += sum(r.stats.draft_s for r in reqs)
    print(f"eagle2 {args.tree}, int8a16 target, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    print("| batch | draft activations | tokens/s | tau | draft ms per request-step |\n|---|---|---|---|---|")
    for (size, name), d in res.items():
        print(f"| {size} | {name} | {d['tokens'] / d['wall']:.1f} | {d['tokens'] / d['steps']:.2f} "
              f"| {1e3 * d['draft'] / d['steps']:.2f} |")


if __name__ == "__main__":
    main()
