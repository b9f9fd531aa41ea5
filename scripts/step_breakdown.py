"""Where an eagle2 step's time goes on a CPU: drafting (propose: the head's int8 products by shape,
its attention, the rest), committing the accepted pairs, and the target's forward (its linears,
its attention, the rest), per step, next to a vanilla decode's forward. Wall-clock timers around
the calls (perf_counter), MT-bench first turns, T=0, one thread. The target's forwards include
each request's prefill, spread over its steps. The parts are timed around module calls, so the
decoder layers run their modules (`direct.DIRECT` off) unless --direct, which times the phases of
the path the package takes (its products and attention are then not split out). Asserts nothing.

  python scripts/step_breakdown.py --data ../shared/data/mt_bench/question.jsonl --skip 10 --prompts 4 \
      --quant int8a16 --tree 16,5,4
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

import eaglespec.attention as attention_mod
import eaglespec.direct as direct_mod
import eaglespec.quant as quant_mod
import eaglespec.spec.propose as propose_mod
from eaglespec.api import EagleSpec
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.model import Transformer
from eaglespec.runtime.engine import Request

totals: collections.Counter = collections.Counter()
phase: list[str | None] = [None]


def timed_phase(owner, name: str, label: str) -> None:
    """Time owner.name as a phase: calls inside it are charged to `label`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        outer, phase[0] = phase[0], label
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0
            phase[0] = outer

    setattr(owner, name, wrapper)


def timed_part(owner, name: str, label) -> None:
    """Time owner.name inside whatever phase is running; label(args) names the part."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if phase[0] is None:
            return inner(*args, **kwargs)
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        totals[f"{phase[0]}: {label(args)}"] += time.perf_counter() - t0
        return out

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--tree", default="16,5,4", help="eagle2 total_tokens,depth,top_k")
    ap.add_argument("--direct", action="store_true", help="the decoder layers' direct path (direct.py) on")
    args = ap.parse_args()
    torch.set_num_threads(1)
    direct_mod.DIRECT = args.direct
    eagle = EagleSpec.load(draft="default", quant=args.quant)
    timed_phase(propose_mod.Proposer, "propose", "draft")
    timed_phase(propose_mod.Proposer, "commit", "commit")
    timed_phase(Transformer, "forward", "target forward")
    timed_part(quant_mod.Int8Linear, "forward", lambda a: f"int8 product {a[0].out_features}x{a[0].in_features}")
    timed_part(quant_mod.Int4Linear, "forward", lambda a: f"int4 product {a[0].out_features}x{a[0].in_features}")
    timed_part(attention_mod, "kernel_attention", lambda a: "attention")
    lines = open(args.data, encoding="utf-8").read().splitlines()[args.skip:args.skip + args.prompts]
    prompts = [eagle.encode(json.loads(line)["turns"][0])[1] for line in lines]
    tree = TreeConfig("eagle2", *map(int, args.tree.split(",")))
    for method in ("vanilla", "eagle2"):
        def run(prompt):
            req = Request(prompt, method, tree if method == "eagle2" else None, SamplingConfig(temperature=0.0),
                          max_new_tokens=args.max_new_tokens)
            eagle.engine.run([req])
            return req

        run(prompts[0])
        totals.clear()
        reqs = [run(p) for p in prompts]
        steps = sum(r.stats.steps for r in reqs)
        tokens = sum(len(r.pending_tokens) for r in reqs)
        print(f"\n{method} ({args.tree if method == 'eagle2' else 'one token'}), {args.quant}: {steps} steps, "
              f"tau {tokens / steps:.2f}; ms per step")
        for label in sorted(totals):
            print(f"  {label:45} {1e3 * totals[label] / steps:7.3f}")


if __name__ == "__main__":
    main()
