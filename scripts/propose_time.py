"""Median time of one drafting call (Proposer.propose) per step, by tree and temperature, on
MT-bench first turns through the engine (the shipped head, int4). Prints numbers, asserts nothing.

  python scripts/propose_time.py --data ../shared/data/mt_bench/question.jsonl --trees 4,3,1:1 4,2,2:1 8,3,4:1 8,3,4:0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from eaglespec.api import EagleSpec, set_threads
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Request
from eaglespec.spec import propose


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--trees", nargs="+", default=["4,3,1:1", "4,2,2:1", "8,3,4:1", "8,3,4:0"],
                    help="total_tokens,depth,top_k:temperature")
    ap.add_argument("--draft", default="default")
    args = ap.parse_args()
    times: list[float] = []
    plain = propose.Proposer.propose

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = plain(self, *a, **kw)
        times.append(time.perf_counter() - t0)
        return out

    propose.Proposer.propose = timed
    set_threads()
    spec = EagleSpec.load(dtype="auto", draft=args.draft, quant="auto")
    lines = [x for x in Path(args.data).read_text().splitlines() if x.strip()]
    prompts = [spec.encode(json.loads(x)["turns"][0])[1] for x in lines[args.skip: args.skip + args.prompts]]
    print("| tree | T | propose, median ms | steps |\n|---|---|---|---|")
    for arm in args.trees:
        sizes, temp = arm.split(":")
        tree, temperature = TreeConfig("eagle2", *map(int, sizes.split(","))), float(temp)
        warm = Request(prompts[0], "eagle2", tree, SamplingConfig(temperature=temperature, seed=0), max_new_tokens=8)
        spec.engine.run([warm])  # untimed: first calls and the lane's setup
        times.clear()
        for j, ids in enumerate(prompts):
            sampling = SamplingConfig(temperature=temperature, seed=j)
            spec.engine.run([Request(ids, "eagle2", tree, sampling, max_new_tokens=args.max_new_tokens)])
        print(f"| {sizes} | {temperature:g} | {1000 * statistics.median(times):.2f} | {len(times)} |")


if __name__ == "__main__":
    main()
