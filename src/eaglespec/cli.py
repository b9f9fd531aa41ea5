"""`eaglespec` command line: generate, chat (train and bench register their own subcommands).

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from .config import (MAX_TREE_DEPTH, MAX_TREE_TOKENS, MAX_TREE_TOPK, QUANT_SAMPLED_TREE, QUANT_TREE, SAMPLED_TREE,
                     TILES_SAMPLED_TREE, SamplingConfig, TreeConfig)
from .files import read_text_limited
from .quant import QUANT_MODES
from .runtime.request import GenerationError, check_text
from .weights import DEFAULT_MODEL


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit 2)."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model id, .gguf file or Hugging Face checkpoint directory (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="auto: bf16 on CUDA and CPUs with AVX512-BF16/AMX, else fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_quant_arg(p)


def add_quant_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default="auto", choices=list(QUANT_MODES),
                   help="target linear layers on a CPU in bf16: auto keeps a GGUF's 4-bit (int4) or 8-bit (int8; "
                        "int8a16 where the CPU has AMX) weights quantised and float checkpoints float; "
                        "int8a16: int8 weights, 16-bit activations, trees nearly free on AMX; "
                        "none: dequantised float weights")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    add_tree_args(p)
    add_sampling_args(p)


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """Speculation options (method, head, tree): shared by generate, chat and serve."""
    p.add_argument("--method", default="vanilla", choices=["vanilla", "eagle", "eagle2"])
    p.add_argument("--draft", default=None,
                   help="draft head: default | random | random3 (EAGLE-3) | PATH (EAGLE-1/2 or EAGLE-3 head)")
    d = TreeConfig()
    # Default None: an option given where it does not apply is refused, not silently ignored.
    p.add_argument("--total-tokens", type=int, default=None,
                   help=f"eagle2 tree size incl. root, 1..{MAX_TREE_TOKENS} (default: the tree of the head's tau "
                        "table with the most tokens/s on this machine, timed once and cached, for a head that "
                        f"ships one, as the default head does; else {d.total_tokens}; "
                        f"{QUANT_TREE['total_tokens']} under --quant int4/int8; sampled requests get chains of "
                        f"{QUANT_SAMPLED_TREE['total_tokens']} (int4/int8), {TILES_SAMPLED_TREE['total_tokens']} "
                        f"(int8a16) or {SAMPLED_TREE['total_tokens']} (float))")
    p.add_argument("--depth", type=int, default=None,
                   help=f"eagle2 drafting depth, 1..{MAX_TREE_DEPTH} (default {d.depth}; {QUANT_TREE['depth']} "
                        f"under --quant int4/int8; a sampled request's chain: its size - 1)")
    p.add_argument("--topk", type=int, default=None,
                   help=f"eagle2 children per expanded node, 1..{MAX_TREE_TOPK} (default {d.top_k}; "
                        f"{QUANT_TREE['top_k']} under --quant int4/int8; 1 for sampled requests; a sampled "
                        "request's tree with top-k > 1 is a fixed layout of that size whose siblings are drawn "
                        "from the head)")
    p.add_argument("--tree-choices", default=None, help="eagle static tree: JSON list of paths")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-chat", action="store_true", help="raw text prompt, no chat template")


def sampling_from(args) -> SamplingConfig:
    try:
        return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:  # the config's messages start with its field's name: name the option instead
        raise UsageError(f"--{str(e).split()[0].replace('_', '-')}: {e}") from None


TREE_SIZES = (("--total-tokens", "total_tokens", MAX_TREE_TOKENS), ("--depth", "depth", MAX_TREE_DEPTH),
              ("--topk", "topk", MAX_TREE_TOPK))


def check_options(args, command: str) -> None:
    """Refuse options that do not apply to this command or method (silently ignoring them misleads)."""
    check_tree_options(args)
    if args.no_chat and command == "chat":
        raise UsageError("--no-chat does not apply to chat (it always uses the chat template)")
    if args.no_chat and args.system is not None:
        raise UsageError("--system needs the chat template; it does not apply with --no-chat")
    if args.system is not None:
        check_text(args.system, "--system", empty_ok=True)


def check_tree_options(args) -> None:
    """Tree options given for a method they do not apply to are refused."""
    sizes = [flag for flag, name, _ in TREE_SIZES if getattr(args, name) is not None]
    if sizes and args.method != "eagle2":
        raise UsageError(f"{', '.join(sizes)}: tree sizes apply to --method eagle2 only, not {args.method}")
    if args.tree_choices and args.method != "eagle":
        raise UsageError(f"--tree-choices: a static tree applies to --method eagle only, not {args.method}")


def tree_from(args) -> TreeConfig | None:
    if args.method == "vanilla":
        return None
    from .tree import load_choices

    kw = {}
    for flag, name, top in TREE_SIZES:
        value = getattr(args, name)
        if value is not None:
            if not 1 <= value <= top:  # the caches are sized from these: bounded, with the bound stated
                raise UsageError(f"{flag} must be between 1 and {top}, got {value}")
            kw["top_k" if name == "topk" else name] = value
    if args.tree_choices:
        kw["choices"] = load_choices(args.tree_choices)
    # None: the engine's default (Engine.default_tree: timed for this machine, or config.default_tree)
    return TreeConfig(method=args.method, **kw) if kw else None


@dataclass
class PromptItem:
    """One conversation to run: a plain prompt (one turn) or MT-bench style turns."""

    turns: list[str]
    question_id: object = None
    where: str = "--prompt"  # for messages: "--prompts FILE:LINE"


MAX_PROMPTS_BYTES = 64 << 20  # bounded, so --prompts /dev/zero is refused instead of filling memory


def read_prompts(path: str) -> list[PromptItem]:
    """Every line is checked before the model loads: a malformed line ends the run (naming it) before
    anything ran. A prompt that is well formed but cannot run (too long) is skipped at run time."""
    try:
        lines = read_text_limited(path, MAX_PROMPTS_BYTES).splitlines()
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise UsageError(f"--prompts {path}: cannot read ({e.__class__.__name__}: {e})") from None
    items = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"--prompts {path}:{no}: not valid JSON ({e.msg})") from None
        where = f"--prompts {path}:{no}"
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            item = PromptItem([rec["prompt"]], rec.get("question_id", rec.get("id")), where)
        elif isinstance(rec, dict) and isinstance(rec.get("turns"), list) and rec["turns"] \
                and all(isinstance(t, str) for t in rec["turns"]):
            item = PromptItem(list(rec["turns"]), rec.get("question_id"), where)
        else:
            raise UsageError(f'{where}: expected {{"prompt": str}} or {{"turns": [str, ...]}}')
        for t in item.turns:
            check_text(t, f"{where}: prompt")  # lone surrogates (JSON "\\ud800"), empty prompts
        items.append(item)
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
        try:
            stream = engine.stream(prompt, method=args.method, max_new_tokens=args.max_new_tokens,
                                   sampling=sampling, tree=tree, chat=not args.no_chat, system=args.system,
                                   stop=args.stop)
        except GenerationError as e:  # name where the prompt came from (line and turn)
            turn_no = f" (turn {i + 1})" if len(item.turns) > 1 else ""
            raise GenerationError(f"{item.where}{turn_no}: {e}") from None
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
    if args.prompt is not None:
        check_text(args.prompt, "--prompt")  # invalid UTF-8 in the argument, empty prompts: before loading
    check_options(args, "generate")
    items = [PromptItem([args.prompt])] if args.prompt is not None else read_prompts(args.prompts)
    sampling, tree = sampling_from(args), tree_from(args)
    set_threads()
    engine = EagleSpec.load(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    if args.method != "vanilla" or args.draft:
        engine.set_draft(args.draft or "default")
    print(f"# loaded {engine.source.name} ({engine.target.dtype}, {args.device}, quant {engine.target.quant}) in {engine.load_s:.1f} s",
          file=sys.stderr)

    def emit(result, item, turn_index, turn_text):
        if args.json:
            rec = {"question_id": item.question_id, "turn": turn_index, **result.to_dict(), "user": turn_text}
            print(json.dumps(rec), flush=True)
        else:
            print(f"# {result.new_tokens} tokens in {result.wall_s:.2f} s = {result.tokens_per_s:.1f} tokens/s"
                  + (f", tau {result.tau:.2f}" if args.method != "vanilla" else ""), file=sys.stderr)

    # A prompts file is run to the end, like `train` skips bad records: a prompt that cannot run
    # (too long for the context) is skipped with a note, and the exit code says something was.
    skipped = []
    for item in items:
        try:
            run_conversation(engine, item, args, sampling, tree, emit)
        except GenerationError as e:
            if len(items) == 1:
                raise
            skipped.append(str(e))
            print(f"# skipped {e}", file=sys.stderr, flush=True)
    if skipped:
        raise UsageError(f"skipped {len(skipped)} of {len(items)} prompts (the others ran); first: {skipped[0]}")
    return 0


def cmd_chat(args) -> int:
    from .api import EagleSpec, set_threads

    check_options(args, "chat")
    sampling, tree = sampling_from(args), tree_from(args)
    set_threads()
    engine = EagleSpec.load(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    if args.method != "vanilla" or args.draft:
        engine.set_draft(args.draft or "default")
    print(f"eaglespec chat with {engine.source.name} ({args.method}); /reset clears, /quit or Ctrl-D ends, "
          "Ctrl-C stops an answer.")
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except UnicodeDecodeError:
            print("eaglespec: refused: that line is not valid UTF-8 text", file=sys.stderr)
            continue
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        turn = messages + [{"role": "user", "content": line}]
        try:
            stream = engine.stream(turn, method=args.method, max_new_tokens=args.max_new_tokens,
                                   sampling=sampling, tree=tree, system=args.system, stop=args.stop)
        except GenerationError as e:  # this message cannot run (too long, invalid text): the chat goes on
            print(f"eaglespec: refused: {e}; the conversation is kept (/reset clears it)", file=sys.stderr)
            continue
        sys.stdout.write("bot> ")
        try:
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # stop this answer, as chat tools do; the conversation stays as it was
            stream.close()  # cancels the request and frees its row
            print("\n  [interrupted: answer dropped]")
            continue
        r = stream.result
        print(f"\n  [{r.new_tokens} tokens, {r.tokens_per_s:.1f} tokens/s"
              + (f", tau {r.tau:.2f}]" if args.method != "vanilla" else "]"))
        messages = turn + [{"role": "assistant", "content": r.text}]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglespec", description="EAGLE speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for a prompt or a prompts file")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompts", default=None,
                   help='jsonl: {"prompt": ...} or {"question_id", "turns": [...]}; a malformed line stops the '
                        "run before it starts, a prompt too long to run is skipped (exit code 2 at the end)")
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
    from .serve.cli import register as serve_register  # imports only argparse; the server loads on use

    out.append(serve_register)
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
