"""The decoder layers' direct path (eaglespec/direct.py) against their modules, in one process
(--switch direct), all layers as one LayerStack call against the per-layer direct path
(--switch stack), or drafting through csrc/draft_runner.cpp against the Proposer's torch ops
(--switch native):
vanilla and eagle2 trees on MT-bench first turns, T=0 (or --temperature, seeded), the arms interleaved per prompt (their
order alternating by repeat) so that the machine's drift hits both. Checks that every output is
identical between the arms; prints tokens/s of each arm and their ratio.

  python scripts/direct_ab.py --data ../shared/data/mt_bench/question.jsonl --skip 10 --prompts 8 \
      --trees 3,2,1 4,2,2 6,3,2 8,3,4 16,5,4 [--switch stack | native]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eaglespec import direct
from eaglespec.spec import propose
from eaglespec.api import EagleSpec
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Request


# --switch: (module, flag, (label on, label off))
SWITCHES = {"direct": (direct, "DIRECT", ("direct", "modules")), "stack": (direct, "STACK", ("stack", "per-layer")),
            "native": (propose, "NATIVE", ("native", "torch-ops"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--trees", nargs="*", default=["4,2,2"], help="eagle2 total_tokens,depth,top_k")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeded by the prompt's index")
    ap.add_argument("--eagle", action="store_true", help="also EAGLE-1 with its default static tree")
    ap.add_argument("--switch", choices=tuple(SWITCHES), default="direct",
                    help="what the arms toggle: direct.DIRECT (modules off), direct.STACK (per-layer off) or "
                         "propose.NATIVE (torch-op drafting off)")
    args = ap.parse_args()
    owner, attr, labels = SWITCHES[args.switch]
    torch.set_num_threads(1)
    eagle = EagleSpec.load(draft="default", quant=args.quant)
    lines = open(args.data, encoding="utf-8").read().splitlines()[args.skip:args.skip + args.prompts]
    prompts = [eagle.encode(json.loads(line)["turns"][0])[1] for line in lines]
    arms = [("vanilla", None)] + [(t, TreeConfig("eagle2", *map(int, t.split(",")))) for t in args.trees]
    if args.eagle:
        arms.append(("eagle", TreeConfig("eagle")))

    def run(prompt: list[int], tree: TreeConfig | None) -> Request:
        sampling = SamplingConfig(temperature=args.temperature, seed=prompts.index(prompt))
        req = Request(prompt, "vanilla" if tree is None else tree.method, tree, sampling,
                      max_new_tokens=args.max_new_tokens)
        eagle.engine.run([req])
        return req

    run(prompts[0], arms[-1][1])  # warm-up (and the tree tuner's cache, if any)
    seconds: dict = {}
    tokens: dict = {}
    outputs: dict = {}
    for rep in range(args.repeats):
        for prompt in prompts:
            for name, tree in arms:
                for on in ((True, False) if rep % 2 == 0 else (False, True)):
                    setattr(owner, attr, on)
                    t0 = time.perf_counter()
                    req = run(prompt, tree)
                    seconds[name, on] = seconds.get((name, on), 0.0) + time.perf_counter() - t0
                    tokens[name, on] = tokens.get((name, on), 0) + len(req.pending_tokens)
                    outputs.setdefault((name, on), []).append(list(req.pending_tokens))
    setattr(owner, attr, True)
    for name, _ in arms:
        on, off = tokens[name, True] / seconds[name, True], tokens[name, False] / seconds[name, False]
        print(f"{name:8} {labels[0]} {on:6.1f} tok/s, {labels[1]} {off:6.1f} tok/s, {on / off:.3f}x, "
              f"identical {outputs[name, True] == outputs[name, False]}")


if __name__ == "__main__":
    main()
