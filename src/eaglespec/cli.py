"""`eaglespec` command line: generate, chat (train and bench register their own subcommands).

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import SamplingConfig, TreeConfig
from .weights import DEFAULT_MODEL


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit 2)."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model id, .gguf file or Hugging Face checkpoint directory (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="auto: bf16 on CUDA and CPUs with AVX512-BF16/AMX, else fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="vanilla", choices=["vanilla", "eagle", "eagle2"])
    p.add_argument("--draft", default=None, help="draft head: default | random | PATH (eagle/eagle2)")
    d = TreeConfig()
    p.add_argument("--total-tokens", type=int, default=d.total_tokens, help="eagle2 tree size incl. root")
    p.add_argument("--depth", type=int, default=d.depth, help="eagle2 drafting depth")
    p.add_argument("--topk", type=int, default=d.top_k, help="eagle2 children per expanded node")
    p.add_argument("--tree-choices", default=None, help="eagle static tree: JSON list of paths")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-chat", action="store_true", help="raw text prompt, no chat template")


def sampling_from(args) -> SamplingConfig:
    if args.temperature is None or math.isnan(args.temperature):
        raise UsageError("--temperature must be a number >= 0")
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def tree_from(args) -> TreeConfig | None:
    if args.method == "vanilla":
        return None
    from .tree import load_choices

    kw = {}
    if args.tree_choices:
        kw["choices"] = load_choices(args.tree_choices)
    return TreeConfig(method=args.method, total_tokens=args.total_tokens, depth=args.depth, top_k=args.topk, **kw)


@dataclass
class PromptItem:
    """One conversation to run: a plain prompt (one turn) or MT-bench style turns."""

    turns: list[str]
    question_id: object = None


def read_prompts(path: str) -> list[PromptItem]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompts {path}: cannot read ({e.__class__.__name__}: {e})") from None
    items = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"--prompts {path}:{no}: not valid JSON ({e.msg})") from None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            items.append(PromptItem([rec["prompt"]], rec.get("question_id", rec.get("id"))))
        elif isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"] \
                and all(isinstance(t, str) for t in rec["turns"]):
            items.append(PromptItem(list(rec["turns"]), rec.get("question_id")))
        else:
            raise UsageError(f'--prompts {path}:{no}: expected {{"prompt": str}} or {{"turns": [str, ...]}}')
    if not items:
        raise UsageError(f"--prompts {path}: no prompts in the file")
    return items


def run_conversation(engine, item: PromptItem, args, sampling, tree, emit) -> None:
    """Ask each turn after the model's own previous answer; emit(result, item, turn_index)."""
    messages: list[dict[str, str]] = []
    raw = ""
    for i, turn in enumerate(item.turns):
        if args.no_chat:
            raw += turn
            prompt = raw
        else:
            messages.append({"role": "user", "content": turn})
            prompt = list(messages)
        stream = engine.stream(prompt, method=args.method, max_new_tokens=args.max_new_tokens, sampling=sampling,
                               tree=tree, chat=not args.no_chat, system=args.system, stop=args.stop)
        if not args.json:
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        result = stream.run() if stream.result is None else stream.result
        if args.no_chat:
            raw += result.text
        else:
            messages.append({"role": "assistant", "content": result.text})
        emit(result, item, i, turn)


def cmd_generate(args) -> int:
    from .api import EagleSpec, set_threads

    if (args.prompt is None) == (args.prompts is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompts FILE")
    items = [PromptItem([args.prompt])] if args.prompt is not None else read_prompts(args.prompts)
    sampling, tree = sampling_from(args), tree_from(args)
    set_threads()
    engine = EagleSpec.load(args.model, dtype=args.dtype, device=args.device)
    if args.method != "vanilla" or args.draft:
        engine.set_draft(args.draft or "default")
    print(f"# loaded {engine.source.name} ({engine.target.dtype}, {args.device}) in {engine.load_s:.1f} s",
          file=sys.stderr)

    def emit(result, item, turn_index, turn_text):
        if args.json:
            rec = {"question_id": item.question_id, "turn": turn_index, **result.to_dict(), "user": turn_text}
            print(json.dumps(rec), flush=True)
        else:
            print(f"# {result.new_tokens} tokens in {result.wall_s:.2f} s = {result.tokens_per_s:.1f} tokens/s"
                  + (f", tau {result.tau:.2f}" if args.method != "vanilla" else ""), file=sys.stderr)

    for item in items:
        run_conversation(engine, item, args, sampling, tree, emit)
    return 0


def cmd_chat(args) -> int:
    from .api import EagleSpec, set_threads

    sampling, tree = sampling_from(args), tree_from(args)
    set_threads()
    engine = EagleSpec.load(args.model, dtype=args.dtype, device=args.device)
    if args.method != "vanilla" or args.draft:
        engine.set_draft(args.draft or "default")
    print(f"eaglespec chat with {engine.source.name} ({args.method}); /reset clears, /quit or Ctrl-D ends.")
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        stream = engine.stream(list(messages), method=args.method, max_new_tokens=args.max_new_tokens,
                               sampling=sampling, tree=tree, system=args.system, stop=args.stop)
        sys.stdout.write("bot> ")
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        r = stream.result
        print(f"\n  [{r.new_tokens} tokens, {r.tokens_per_s:.1f} tokens/s"
              + (f", tau {r.tau:.2f}]" if args.method != "vanilla" else "]"))
        messages.append({"role": "assistant", "content": r.text})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglespec", description="EAGLE speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for a prompt or a prompts file")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompts", default=None, help='jsonl: {"prompt": ...} or {"question_id", "turns": [...]}')
    g.add_argument("--json", action="store_true", help="one JSON object per prompt (per turn) on stdout")
    add_model_args(g)
    add_decoding_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat")
    add_model_args(c)
    add_decoding_args(c)
    c.set_defaults(func=cmd_chat)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands owned by other modules (train, bench) register themselves here."""
    out = []
    try:
        from .train.cli import register as train_register

        out.append(train_register)
    except ImportError:
        pass
    try:
        from .bench.cli import register as bench_register

        out.append(bench_register)
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\neaglespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except (ValueError, OSError) as e:  # our errors subclass ValueError; their messages say what to do
        if os.environ.get("EAGLESPEC_DEBUG"):
            raise
        print(f"eaglespec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
