"""Before / after the batched step, side by side in one process: the single-request reference loop
(generate.generate_tokens + draft.Drafter + verify.py, the code the step replaced) against the
engine, on the same prompts, interleaved prompt by prompt. Prints numbers, asserts nothing.

  python scripts/bench_step_ab.py --questions 8 --max-new-tokens 96 --before-tree 16,5,4 --after-tree 8,3,4

--before-tree / --after-tree: eagle2's total_tokens,depth,top_k for each side (default: the
previous default tree, 16,5,4, before; today's default after).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from eaglespec.api import EagleSpec
from eaglespec.config import TreeConfig
from eaglespec.draft import Drafter
from eaglespec.generate import GenerationStats, generate_tokens
from eaglespec.runtime.engine import Engine, Request

MT_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--data", default=str(MT_BENCH))
    d = TreeConfig()
    ap.add_argument("--before-tree", default="16,5,4", help="total_tokens,depth,top_k of the reference loop")
    ap.add_argument("--after-tree", default=f"{d.total_tokens},{d.depth},{d.top_k}", help="... of the engine")
    args = ap.parse_args()
    before_tree = TreeConfig("eagle2", *map(int, args.before_tree.split(",")))
    after_tree = TreeConfig("eagle2", *map(int, args.after_tree.split(",")))
    torch.set_num_threads(os.cpu_count() or 1)
    e = EagleSpec.load(dtype=args.dtype, draft="default")
    eos = e.tokenizer.eos_token_ids
    qs = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()][: args.questions]
    prompts = [e.encode(q["turns"][0])[1] for q in qs]
    drafter = Drafter(e.head, e.target)
    engines = {"float draft": Engine(e.target, e.head, eos_ids=eos, draft_int8=False),
               "int8 draft": Engine(e.target, e.head, eos_ids=eos)}

    def old(ids, method):
        st = GenerationStats()
        tree = before_tree if method == "eagle2" else None
        toks = [t for c in generate_tokens(e.target, ids, drafter=drafter if tree else None, tree=tree,
                                           max_new_tokens=args.max_new_tokens, eos_ids=eos, stats=st) for t in c]
        return toks, st

    def new(engine):
        def run(ids, method):
            r = Request(ids, method, after_tree if method == "eagle2" else None,
                        max_new_tokens=args.max_new_tokens)
            engine.run([r])
            return r.pending_tokens, r.stats
        return run

    arms = [("before", "vanilla", old), ("before", "eagle2", old)]
    for name, eng in engines.items():
        arms += [(f"after, {name}", "vanilla", new(eng)), (f"after, {name}", "eagle2", new(eng))]
    for label, method, fn in arms:  # warm-up
        fn(prompts[0][:32], method)
    acc = {(a, m): [0, 0.0, 0, 0.0, 0.0] for a, m, _ in arms}
    for i, ids in enumerate(prompts):
        for label, method, fn in arms[i % len(arms):] + arms[: i % len(arms)]:
            t0 = time.perf_counter()
            toks, st = fn(ids, method)
            a = acc[(label, method)]
            a[0] += len(toks)
            a[1] += time.perf_counter() - t0
            a[2] += st.steps
            a[3] += st.draft_s
            a[4] += st.verify_s
    print(f"{e.source.name} {e.target.dtype}, head {e.head_name}, {len(prompts)} MT-bench first turns, "
          f"{args.max_new_tokens} new tokens; eagle2 tree (total_tokens,depth,top_k) before {args.before_tree}, "
          f"after {args.after_tree}")
    print("| code | method | tokens/s | speedup over its vanilla | tau | draft ms/step | verify ms/step |")
    print("|---|---|---|---|---|---|---|")
    for label in dict.fromkeys(a for a, _, _ in arms):
        van = acc[(label, "vanilla")]
        for method in ("vanilla", "eagle2"):
            n, wall, steps, d, v = acc[(label, method)]
            print(f"| {label} | {method} | {n / wall:.1f} | {(n / wall) / (van[0] / van[1]):.3f}x | "
                  f"{(n - len(prompts)) / max(1, steps):.2f} | {1e3 * d / max(1, steps):.1f} | "
                  f"{1e3 * v / max(1, steps):.1f} |")


if __name__ == "__main__":
    main()
