"""`eaglespec bench`: speedup / tau / losslessness of every method on MT-bench, HumanEval, GSM8K.

    eaglespec bench --datasets mt_bench,humaneval,gsm8k,alpaca --limit 80 --draft default --out bench-out
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..config import TreeConfig
from ..cli import add_quant_arg
from ..files import atomic_write_text
from ..weights import DEFAULT_MODEL
from .datasets import DATASETS
from .methods import METHODS


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", type=_csv, default=None,
                   help=f"comma-separated: {','.join(DATASETS)} (default: all four, or none when --data is given)")
    p.add_argument("--data", action="append", default=[], metavar="FILE",
                   help="an extra jsonl dataset in MT-bench, HumanEval or GSM8K format (repeatable)")
    p.add_argument("--mt-bench", default=None, metavar="FILE", help="MT-bench question.jsonl (FastChat format)")
    p.add_argument("--gsm8k", default=None, metavar="FILE", help='GSM8K jsonl with a "question" per line')
    p.add_argument("--alpaca", default=None, metavar="FILE", help="Alpaca instructions in MT-bench format")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    p.add_argument("--categories", type=_csv, default=None, help="MT-bench categories to keep, e.g. writing,coding")
    p.add_argument("--methods", type=_csv, default=list(METHODS), help=f"comma-separated: {','.join(METHODS)}")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, with the lossless check")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", action="store_true", help="also run depth-5 chain drafts and report n-alpha")
    p.add_argument("--out", required=True, help="directory for results.json, report.md and the plots")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model id, .gguf file or checkpoint directory")
    p.add_argument("--draft", default="default", help="draft head: default | random | random3 | PATH (EAGLE-1/2 or EAGLE-3)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cpu")
    add_quant_arg(p)
    p.add_argument("--total-tokens", type=int, default=None, help="eagle2 tree size incl. root (default: "
                   "the engine's: tuned for this machine where the head ships a tau table, else config.default_tree)")
    p.add_argument("--depth", type=int, default=None, help="eagle2 drafting depth")
    p.add_argument("--topk", type=int, default=None, help="eagle2 children per expanded node")
    p.add_argument("--tree-choices", default=None, help="eagle static tree: JSON list of paths")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="throughput mode: first turns of all prompts queued at once, B requests in flight per "
                        "engine method, against batch size 1 (writes throughput.json and throughput.md)")


def cmd_bench(args) -> int:
    from ..api import EagleSpec, set_threads
    from ..tree import load_choices
    from .datasets import load_datasets
    from .methods import build_methods, check_names
    from .report import write_report
    from .runner import BenchConfig, run_bench

    if not args.methods:  # `--methods ""` would otherwise run vanilla alone and report success
        raise ValueError(f"--methods is empty; give one or more of {','.join(METHODS)}")
    check_names(args.methods)
    cfg = BenchConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                      seed=args.seed, progress=not args.no_progress)
    names = args.datasets if args.datasets is not None else ([] if args.data else list(DATASETS))
    paths = {k: v for k, v in (("mt_bench", args.mt_bench), ("gsm8k", args.gsm8k), ("alpaca", args.alpaca)) if v}
    items = load_datasets(names, limit=args.limit, categories=args.categories, paths=paths, data=args.data)
    set_threads()
    engine = EagleSpec.load(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    if any(m in ("eagle", "eagle2") for m in args.methods) or args.alpha:
        engine.set_draft(args.draft)
    base = engine.engine.default_tree("eagle2")  # this machine's, where the head ships a tau table
    kw = {"choices": load_choices(args.tree_choices)} if args.tree_choices else {}
    tree = TreeConfig(total_tokens=base.total_tokens if args.total_tokens is None else args.total_tokens,
                      depth=base.depth if args.depth is None else args.depth,
                      top_k=base.top_k if args.topk is None else args.topk, **kw)
    if args.batch_size is not None:
        return _cmd_throughput(args, engine, items, tree)
    methods, notes = build_methods(args.methods, engine, tree, alpha=args.alpha)
    for n in notes:
        print(f"# note: {n}", file=sys.stderr)
    turns = sum(len(i.turns) for i in items)
    print(f"# {engine.source.name} ({engine.target.dtype}, quant {engine.target.quant}), head {engine.head_name or '-'}: {len(items)} prompts, "
          f"{turns} turns x {len(methods)} methods x {cfg.repeats} repeats", file=sys.stderr)
    result = run_bench(engine, items, methods, cfg, notes)
    # The command line as typed, when this process is the eaglespec command (not a test calling main()).
    typed = Path(sys.argv[0]).name in ("eaglespec", "__main__.py")
    files = write_report(result, args.out, command="eaglespec " + shlex.join(sys.argv[1:]) if typed else None)
    print(files.report.read_text())
    print(f"# wrote {files.results}, {files.report}, {', '.join(str(p) for p in files.plots)}", file=sys.stderr)
    if result.rounding_differences:
        print(f"eaglespec bench: {len(result.rounding_differences)} outputs differ from vanilla by reduced-precision "
              f"rounding at near-ties (exact in fp32); see {files.report}", file=sys.stderr)
    if result.mismatches:
        print(f"eaglespec bench: {len(result.mismatches)} LOSSLESS MISMATCHES (bugs); see {files.report}",
              file=sys.stderr)
        return 1
    return 0


def _cmd_throughput(args, engine, items, tree) -> int:
    import json

    from .throughput import run_throughput, throughput_table

    if args.batch_size < 1:
        print("eaglespec bench: --batch-size must be >= 1", file=sys.stderr)
        return 2
    engine_methods = [m for m in args.methods if m in ("vanilla", "eagle", "eagle2")]
    skipped = [m for m in args.methods if m not in engine_methods]
    if skipped:
        print(f"# note: --batch-size measures eaglespec's engine methods only; skipped {', '.join(skipped)}",
              file=sys.stderr)
    result = run_throughput(engine, items, engine_methods, tree, args.batch_size, args.max_new_tokens,
                            args.temperature, args.seed)
    out = Path(args.out)
    atomic_write_text(out / "throughput.json", json.dumps(result.to_dict(), indent=2))
    table = throughput_table(result)
    atomic_write_text(out / "throughput.md", f"# Throughput ({result.setup})\n\n{table}")
    print(table)
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark methods: speedup, tau, losslessness; tables and plots")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
