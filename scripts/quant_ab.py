"""Quant modes side by side (default: bf16 float weights against --quant auto, the GGUF's 4-bit
weights), vanilla and eagle2 with the shipped head, interleaved prompt by prompt in one process on
MT-bench first turns, with llama.cpp on the same GGUF. Prints tokens/s, ratios to the first mode's
vanilla, tau and whether each speculative answer equals its mode's vanilla.

  python scripts/quant_ab.py --data ../shared/data/mt_bench/question.jsonl --prompts 8 --max-new-tokens 256
  python scripts/quant_ab.py --data ... --quants int4,int8a16 --trees 2,1,1 8,3,4 --no-llamacpp
  python scripts/quant_ab.py --data ... --quants int8a16 --attention vector,amx --no-llamacpp

--attention runs every mode once per attention path (csrc's vector code, or its AMX tiles:
EAGLESPEC_AMX set per run); each answer is compared with the vanilla of its own mode and path.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from eaglespec.api import EagleSpec
from eaglespec.bench.methods import BaselineCrashed, load_llamacpp
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--trees", nargs="+", default=["8,3,4", "4,2,2"], help="eagle2 total_tokens,depth,top_k")
    ap.add_argument("--quants", default="none,auto", help="modes to compare; ratios are to the first one's vanilla")
    ap.add_argument("--attention", default=None, help="attention paths to compare, e.g. vector,amx (default: "
                    "the one this CPU uses)")
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1)
    loaded = {q: EagleSpec.load(dtype="bf16", draft="default", quant=q) for q in args.quants.split(",")}
    paths = args.attention.split(",") if args.attention else [None]
    # A mode: a quant mode, with an attention path when comparing them ("int8a16/amx").
    quants = [q if p is None else f"{q}/{p}" for q in loaded for p in paths]
    engines = {m: loaded[m.split("/")[0]] for m in quants}
    lines = [x for x in Path(args.data).read_text().splitlines() if x.strip()][: args.prompts]
    arms = [(q, None) for q in engines] + [(q, t) for q in engines for t in args.trees]
    first = engines[quants[0]]
    llamacpp, note = (None, "llama.cpp not run (--no-llamacpp)") if args.no_llamacpp else load_llamacpp(first, 4096)
    if llamacpp is None:
        print(f"# {note}")
    else:
        arms.append(("llamacpp", None))
    stats = {a: [0, 0.0, 0, 0] for a in arms}  # tokens, seconds, forwards, identical answers
    for j, line in enumerate(lines):
        order = arms[j % len(arms):] + arms[: j % len(arms)]  # rotate to spread drift
        answers = {}
        for quant, tree in order:
            e = first if quant == "llamacpp" else engines[quant]
            ids = e.encode(json.loads(line)["turns"][0])[1]
            if quant == "llamacpp":
                try:
                    out = llamacpp.run("", ids, args.max_new_tokens, SamplingConfig())
                except BaselineCrashed as e:  # reported, not fatal
                    print(f"# {e}")
                    arms.remove(("llamacpp", None))
                    del stats[("llamacpp", None)]
                    continue
                s = stats[(quant, tree)]
                s[0] += len(out.token_ids)
                s[1] += out.wall_s
                s[2] += len(out.token_ids) - 1
                answers[(quant, tree)] = list(out.token_ids)
                continue
            if "/" in quant:
                os.environ["EAGLESPEC_AMX"] = "1" if quant.split("/")[1] == "amx" else "0"
            cfg = None if tree is None else TreeConfig("eagle2", *map(int, tree.split(",")))
            r = Request(ids, "vanilla" if tree is None else "eagle2", cfg, max_new_tokens=args.max_new_tokens)
            t0 = time.perf_counter()
            e.engine.run([r])
            s = stats[(quant, tree)]
            s[0] += len(r.pending_tokens)
            s[1] += time.perf_counter() - t0
            s[2] += r.stats.steps
            answers[(quant, tree)] = list(r.pending_tokens)
        for quant, tree in [a for a in arms if a in answers]:
            stats[(quant, tree)][3] += answers[(quant, tree)] == answers[(quants[0] if quant == "llamacpp" else quant, None)]
    base = stats[(quants[0], None)][0] / stats[(quants[0], None)][1]
    print(f"{len(lines)} MT-bench first turns, {args.max_new_tokens} new tokens, bf16, {torch.get_num_threads()} threads")
    print(f"| quant | method (tree) | tokens/s | x {first.target.quant} vanilla | x same-quant vanilla | tau | identical to its vanilla |")
    # llama.cpp's row: "same-quant vanilla" is itself; "identical" compares with the first mode's vanilla.
    print("|---|---|---|---|---|---|---|")
    for quant, tree in arms:
        tok, sec, steps, same = stats[(quant, tree)]
        own = stats[(quant, None)][0] / stats[(quant, None)][1]
        name = "vanilla" if tree is None else f"eagle2 ({tree})"
        label = "llama.cpp (same GGUF)" if quant == "llamacpp" else \
            engines[quant].target.quant + ("" if "/" not in quant else f", {quant.split('/')[1]} attention")
        print(f"| {label} | {name} | {tok / sec:.1f} | {tok / sec / base:.2f}x | "
              f"{tok / sec / own:.2f}x | {(tok - len(lines)) / max(steps, 1):.2f} | {same}/{len(lines)} |")


if __name__ == "__main__":
    main()
