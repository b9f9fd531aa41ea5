"""Speculative-decoding benchmark on MT-bench (both turns, greedy): prints numbers, asserts nothing.

Methods run interleaved turn by turn in one process, so machine drift hits them alike. For each
method: tokens/s, speedup over vanilla (total tokens / total time), tau, draft and verify ms per
step against one vanilla token, acceptance by depth, and whether the tokens equal vanilla's.

  python scripts/bench_spec.py --draft default --dtype fp32 --questions 10 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from eaglespec.api import EagleSpec
from eaglespec.config import TreeConfig

MT_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--methods", default="vanilla,eagle,eagle2")
    ap.add_argument("--total-tokens", type=int, default=None)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--data", default=str(MT_BENCH))
    ap.add_argument("--out", default=None, help="write per-turn results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    engine = EagleSpec.load(dtype=args.dtype, draft=args.draft)
    methods = args.methods.split(",")
    d = TreeConfig()
    tree_kw = dict(total_tokens=args.total_tokens or d.total_tokens, depth=args.depth or d.depth,
                   top_k=args.topk or d.top_k)
    questions = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    questions = questions[: args.questions]
    print(f"{engine.source.name} {engine.target.dtype}, head {engine.head_name}, {len(questions)} questions x 2 turns, "
          f"{args.max_new_tokens} new tokens, tree {tree_kw}")
    # Warm-up: first calls pay for allocator growth and lazy init.
    for m in methods:
        engine.generate("Hello", method=m, max_new_tokens=8, tree=TreeConfig(method=m, **tree_kw) if m != "vanilla" else None)
    rows = {m: [] for m in methods}
    history = {m: {} for m in methods}
    for q in questions:
        for turn_i, turn in enumerate(q["turns"]):
            vanilla_ids = None
            for m in methods:
                msgs = history[m].setdefault(q["question_id"], [])
                msgs.append({"role": "user", "content": turn})
                tree = TreeConfig(method=m, **tree_kw) if m != "vanilla" else None
                r = engine.generate(list(msgs), method=m, max_new_tokens=args.max_new_tokens, tree=tree)
                msgs.append({"role": "assistant", "content": r.text})
                if m == "vanilla":
                    vanilla_ids = r.token_ids
                same = None if vanilla_ids is None or turn_i > 0 else r.token_ids == vanilla_ids
                rows[m].append({"qid": q["question_id"], "turn": turn_i, "new_tokens": r.new_tokens, "wall_s": r.wall_s,
                                "steps": r.steps, "tau": r.tau, "draft_s": r.draft_s, "verify_s": r.verify_s,
                                "accepted_per_depth": r.accepted_per_depth, "same_as_vanilla": same,
                                "token_ids": r.token_ids})
            line = "  ".join(f"{m} {rows[m][-1]['new_tokens'] / rows[m][-1]['wall_s']:5.1f} t/s tau {rows[m][-1]['tau']:.2f}"
                             for m in methods)
            print(f"q{q['question_id']} t{turn_i}: {line}", flush=True)
    summary = {}
    base = rows.get("vanilla")
    base_tps = sum(r["new_tokens"] for r in base) / sum(r["wall_s"] for r in base) if base else None
    for m in methods:
        rs = rows[m]
        tok = sum(r["new_tokens"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        depth: list[int] = []
        for r in rs:
            for i, c in enumerate(r["accepted_per_depth"]):
                depth += [0] * (i + 1 - len(depth))
                depth[i] += c
        s = {"tokens_per_s": tok / wall, "tau": sum(r["tau"] * r["steps"] for r in rs) / max(1, steps),
             "draft_ms_per_step": 1e3 * sum(r["draft_s"] for r in rs) / max(1, steps),
             "verify_ms_per_step": 1e3 * sum(r["verify_s"] for r in rs) / max(1, steps),
             "accept_rate_by_depth": [c / max(1, steps) for c in depth],
             "first_turn_identical": f"{sum(1 for r in rs if r['same_as_vanilla'])}/{sum(1 for r in rs if r['turn'] == 0)}"}
        if base_tps:
            s["speedup"] = s["tokens_per_s"] / base_tps
            if m != "vanilla":
                s["speedup_mean_of_ratios"] = statistics.mean(
                    (r["new_tokens"] / r["wall_s"]) / (b["new_tokens"] / b["wall_s"]) for r, b in zip(rs, base))
        summary[m] = s
    if base:
        summary["vanilla"]["ms_per_token"] = 1e3 / base_tps
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
