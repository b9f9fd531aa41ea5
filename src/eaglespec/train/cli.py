"""`eaglespec train` (and `torchrun -m eaglespec.train`): data -> features -> trained draft head.

Every phase resumes: finished feature shards are skipped, and --resume continues training from
out/checkpoint.pt with optimizer, schedule, RNG and data position.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

import torch

from .loop import TrainConfig


def peak_rss_gib() -> float:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def add_train_args(p: argparse.ArgumentParser) -> None:
    from ..quant import QUANT_MODES
    from ..weights import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="target dtype")
    p.add_argument("--quant", default=None, choices=list(QUANT_MODES),
                   help="the target's linears while training (default: none on CUDA and CPUs with native bf16, "
                        "a GGUF's 4-bit blocks dequantised to --dtype, 2x faster there for the feature dump's long "
                        "forwards; else auto, the package's integer kernels. int4/auto also saves memory on large "
                        "targets)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", default=None, help="ShareGPT json/jsonl or OpenAI messages jsonl (default: packaged ShareGPT)")
    p.add_argument("--out", required=True, help="work directory: features/, checkpoint.pt, head/")
    p.add_argument("--max-conversations", type=int, default=None, help="use the first N usable conversations")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per conversation (truncated)")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--shard-size", type=int, default=64, help="conversations per feature shard")
    p.add_argument("--features", default=None, metavar="DIR",
                   help="feature store (default OUT/features); runs may share one, and a larger "
                        "--max-conversations extends it, keeping the shards already dumped")
    p.add_argument("--online", action="store_true", help="compute features inside the loop instead of dumping")
    p.add_argument("--regenerate", action="store_true",
                   help="replace assistant turns with the target's own answers before training "
                        "(out/regenerated.jsonl; `eaglespec regenerate` makes such a file on its own)")
    p.add_argument("--regenerate-max-tokens", type=int, default=512, help="tokens per regenerated answer")
    p.add_argument("--regenerate-temperature", type=float, default=0.0, help="0: greedy answers")
    p.add_argument("--regenerate-batch", type=int, default=32, help="answers decoded together")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="reduced draft vocabulary: the N most frequent answer tokens (0 = the target's full vocabulary)")
    p.add_argument("--draft-vocab-data", default=None, metavar="FILE",
                   help="also count this dataset's answer tokens for --draft-vocab (e.g. the original answers "
                        "when training on regenerated ones, whose vocabulary is narrower)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True, help="fc bias (EAGLE-1/2: yes)")
    p.add_argument("--head", default="eagle", choices=["eagle", "eagle3"],
                   help="eagle: EAGLE-1/2 head (the target's top feature, its LM head); eagle3: three fused "
                        "target layers, its own LM head over --draft-vocab, no feature regression "
                        "(EAGLE-3's recipe adds --ttt-steps 7)")
    p.add_argument("--head-layers", type=int, default=None, metavar="N",
                   help="eagle: decoder layers in the head (default 1, as EAGLE; more layers draft better and "
                        "cost more per draft step). With --init-head: grow that head to N layers, the new ones "
                        "starting as identity (zero output projections), so training starts from its skill")
    p.add_argument("--target-layers", type=int, nargs=3, default=None, metavar=("LOW", "MID", "HIGH"),
                   help="eagle3: the target layers whose entering hidden states are fused (default 2, L/2, L-3)")
    p.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this head (ours or a released EAGLE-1/2/3 checkpoint) instead of a random "
                        "one: fine-tune it on new data, or train it further; its kind, target layers and draft "
                        "vocabulary are kept (--head must match). --draft-vocab N above an EAGLE-1/2 head's "
                        "size widens its vocabulary: its tokens plus the next most frequent answer tokens (the "
                        "head scores the target's own LM-head rows, so nothing new is learned from scratch)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    d = TrainConfig()
    for f in fields(TrainConfig):
        if f.name == "betas":
            p.add_argument("--betas", type=float, nargs=2, default=list(d.betas))
            continue
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=type(getattr(d, f.name)), default=getattr(d, f.name))


def config_from(args) -> TrainConfig:
    kw = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    kw["betas"] = tuple(kw["betas"])
    return TrainConfig(**kw)


def init_distributed(device: str) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), world


def usable_conversations(args, rank: int):
    """The conversations to train on, or an error saying why there are none (before any work)."""
    from .data import DataError, load_conversations

    report = load_conversations(args.data)
    if not report.conversations:
        raise DataError(f"no usable conversation in {args.data or 'the packaged ShareGPT data'} (one needs an "
                        f"assistant reply to a user turn): {report.summary()}")
    if rank == 0:
        print(report.summary(), file=sys.stderr)
    skip = getattr(args, "skip", 0)
    convs = report.conversations[skip:]
    if not convs:
        raise DataError(f"--skip {skip} leaves none of the {len(report.conversations):,} usable conversations")
    return convs[: args.max_conversations] if args.max_conversations else convs


def build_samples(engine, args, convs, rank: int):
    from .data import DataError, split_train_val, tokenize_conversation

    if args.regenerate:
        from .regenerate import RegenConfig, load_regenerated, regenerate

        path = Path(args.out) / "regenerated.jsonl"
        cfg = RegenConfig(args.regenerate_max_tokens, args.max_length, args.regenerate_temperature,
                          seed=args.seed, batch=args.regenerate_batch)
        if rank == 0:
            print(regenerate(engine, convs, path, cfg, progress=not args.no_progress).summary(), file=sys.stderr)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            torch.distributed.barrier()
        convs = load_regenerated(path, convs)
    hf = engine.tokenizer.hf
    samples = [tokenize_conversation(hf, c, args.max_length) for c in convs]
    samples = [s for s in samples if s.num_loss_tokens > 0 and len(s) > 1]
    if not samples:
        raise DataError(f"no conversation has an assistant token within the first --max-length {args.max_length} "
                        "tokens; raise --max-length")
    split = split_train_val(list(range(len(samples))), args.val_fraction, args.seed)
    if not split.train:
        raise DataError(f"--val-fraction {args.val_fraction} leaves no training sample out of {len(samples)}")
    return samples, list(split.train), list(split.val)


def vocab_samples(args, tokenizer) -> list:
    """The extra samples whose answer tokens --draft-vocab-data adds to the count."""
    if not getattr(args, "draft_vocab_data", None):
        return []
    from .data import DataError, load_conversations, tokenize_conversation

    report = load_conversations(args.draft_vocab_data)
    if not report.conversations:
        raise DataError(f"--draft-vocab-data {args.draft_vocab_data}: no usable conversation ({report.summary()})")
    return [tokenize_conversation(tokenizer, c, args.max_length) for c in report.conversations]


def new_head(args, target, samples, train_ids: list[int], val_ids: list[int], rank: int, extra_vocab=()):
    """The head to train, seeded: EAGLE-1/2 (`--head eagle`) or EAGLE-3, with its draft vocabulary
    (the --draft-vocab most frequent answer tokens of the training split)."""
    from ..config import ConfigError
    from ..draft import DraftHead, init_head_
    from ..eagle3 import check_target_layers, default_target_layers, init_eagle3_head
    from .vocab import coverage, frequent_tokens

    torch.manual_seed(args.seed)
    cfg, device = target.config, target.device
    if args.head_layers not in (None, 1) and args.head == "eagle3":
        raise ConfigError("--head-layers applies to EAGLE-1/2 heads (an EAGLE-3 head has one midlayer)")
    if getattr(args, "init_head", None):
        return start_head(args, target, samples, train_ids, val_ids, rank, extra_vocab)
    ids = None
    if args.draft_vocab and args.draft_vocab < cfg.vocab_size:
        dv = frequent_tokens([samples[i] for i in train_ids] + list(extra_vocab), args.draft_vocab, cfg.eos_token_ids)
        ids = dv.token_ids
        if rank == 0:
            val_cov = coverage(ids, [samples[i] for i in val_ids]) if val_ids else float("nan")
            print(f"draft vocabulary: {ids.numel():,} of {cfg.vocab_size:,} tokens, covering "
                  f"{dv.train_coverage:.1%} of training and {val_cov:.1%} of validation answer tokens", file=sys.stderr)
    if args.head == "eagle":
        head = init_head_(DraftHead(cfg, bias=args.bias, num_layers=args.head_layers or 1), args.seed)
        if ids is not None:
            head.set_vocab(ids)
        return head.to(device)
    layers = check_target_layers(args.target_layers or default_target_layers(cfg.num_layers), cfg.num_layers)
    head = init_eagle3_head(cfg, args.seed, draft_vocab=None if ids is None else ids.numel(), target_layers=layers)
    if ids is not None:
        head.set_vocab(ids)
    with torch.no_grad():
        # Warm start: the LM head reads norm(hidden) like the target's (its rows for the draft
        # vocabulary, times the target's final norm scale), so training starts from the target's
        # own readout instead of noise.
        rows = target.lm_head.weight[head.to_target_ids(torch.arange(head.draft_vocab, device=device))].float()
        scale = target.norm(torch.ones(1, cfg.hidden_size, device=device, dtype=target.dtype)).float()[0]
        head.lm_head.weight.copy_(rows * scale)
    return head.to(device)


def start_head(args, target, samples, train_ids: list[int], val_ids: list[int], rank: int, extra_vocab=()):
    """`--init-head`: the saved head, in fp32 and trainable, after checking it is the kind asked for.
    Its draft vocabulary and target layers come with it (they index its weights); an EAGLE-1/2
    head's vocabulary may be widened (`--draft-vocab` above its size)."""
    from ..config import ConfigError
    from ..draft import grow_head_, load_head
    from ..eagle3 import Eagle3Head, check_target_layers
    from .vocab import coverage, widen_vocab

    head = load_head(args.init_head, target.config, dtype=torch.float32, device=target.device)
    kind = "eagle3" if isinstance(head, Eagle3Head) else "eagle"
    if kind != args.head:
        raise ConfigError(f"--init-head {args.init_head} is an {'EAGLE-3' if kind == 'eagle3' else 'EAGLE-1/2'} "
                          f"head; pass --head {kind} to train it")
    if kind == "eagle3" and args.target_layers and \
            check_target_layers(args.target_layers, target.config.num_layers) != tuple(head.target_layers):
        raise ConfigError(f"--init-head {args.init_head} reads target layers {list(head.target_layers)}, "
                          f"not --target-layers {list(args.target_layers)}")
    if args.head_layers and kind == "eagle" and args.head_layers != head.cache_layers:
        if args.head_layers < head.cache_layers:
            raise ConfigError(f"--init-head {args.init_head} has {head.cache_layers} layers; --head-layers "
                              f"{args.head_layers} would drop some (pass at least {head.cache_layers})")
        grow_head_(head, args.head_layers, args.seed)
        if rank == 0:
            print(f"grown to {args.head_layers} layers (the new ones start as identity)", file=sys.stderr)
    held = head.draft_vocab
    if args.draft_vocab and args.draft_vocab != held:
        if kind == "eagle3" or args.draft_vocab < held:
            why = "an EAGLE-3 head's LM head rows are its own weights" if kind == "eagle3" else \
                "it would drop tokens the head was trained on"
            raise ConfigError(f"--init-head {args.init_head} has a draft vocabulary of {held:,} tokens; "
                              f"--draft-vocab {args.draft_vocab:,} cannot change it ({why})")
        # Widening costs no training: an EAGLE-1/2 head scores the target's own LM-head rows, and
        # its features regress the target's, so the new rows' logits are already meaningful.
        wide = widen_vocab(head.vocab, [samples[i] for i in train_ids] + list(extra_vocab), args.draft_vocab,
                           target.config.vocab_size, target.config.eos_token_ids)
        head.set_vocab(wide)
        if rank == 0:
            print(f"draft vocabulary widened from {held:,} to {head.draft_vocab:,} tokens", file=sys.stderr)
    if rank == 0:
        ids = head.to_target_ids(torch.arange(head.draft_vocab)) if kind == "eagle3" else head.vocab
        vocab = "the full vocabulary" if ids is None else f"its draft vocabulary of {ids.numel():,} tokens" + (
            f", covering {coverage(ids.cpu(), [samples[i] for i in val_ids]):.1%} of validation answer tokens"
            if val_ids else "")
        print(f"starting from {args.init_head} ({kind} head, {vocab})", file=sys.stderr)
    return head.train().requires_grad_(True)


def cmd_train(args) -> int:
    from ..api import EagleSpec, batched_quant_default, set_threads
    from .features import dump_features, layers_to_dump, shard_path, write_manifest
    from .loop import SampleStore, train

    set_threads()
    out = Path(args.out)
    if not args.resume and (out / "checkpoint.pt").is_file():  # before any work: a rerun must not erase a run
        raise ValueError(f"{out} holds a training run (checkpoint.pt): pass --resume to continue it, or another "
                         "--out to start a new one (its features can be shared with --features)")
    rank, world = init_distributed(args.device)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device.startswith("cuda") and world > 1 else args.device
    convs = usable_conversations(args, rank)  # bad data is refused before the model loads
    engine = EagleSpec.load(args.model, dtype=args.dtype, device=device,
                            quant=args.quant or batched_quant_default(device))
    target = engine.target
    samples, train_ids, val_ids = build_samples(engine, args, convs, rank)  # before features/ is written
    n_tok = sum(len(s) for s in samples)
    if rank == 0:
        print(f"{len(samples):,} samples, {n_tok:,} tokens ({sum(s.num_loss_tokens for s in samples):,} assistant); "
              f"{len(train_ids):,} train / {len(val_ids):,} validation", file=sys.stderr)
    head = new_head(args, target, samples, train_ids, val_ids, rank, vocab_samples(args, engine.tokenizer.hf))
    layers = tuple(head.target_layers or ())  # hidden states the head reads (EAGLE-3)
    feat_dir = Path(args.features) if args.features else out / "features"
    if args.online:
        from .online import OnlineStore

        store = OnlineStore(target, samples, layers)
    else:
        dumped = layers_to_dump(feat_dir, layers)
        if rank == 0:
            write_manifest(feat_dir, {"model": engine.source.name, "dtype": str(target.dtype), "quant": target.quant,
                                      "max_length": args.max_length, "samples": len(samples), "tokens": n_tok,
                                      "shard_size": args.shard_size, "data": str(args.data or "sharegpt"),
                                      "regenerate": bool(args.regenerate), "hidden_layers": list(dumped)})
        if world > 1:
            torch.distributed.barrier()
        rep = dump_features(target, samples, feat_dir, args.shard_size, rank, world, dumped,
                            progress=not args.no_progress)
        if world > 1:
            torch.distributed.barrier()
        if rank == 0:  # each rank dumps its own shards; this line covers rank 0's share
            print(rep.summary() + (f" (rank 0's {rep.shards_total} of {world} ranks' shards)" if world > 1 else ""),
                  file=sys.stderr)
        n_shards = (len(samples) + args.shard_size - 1) // args.shard_size
        store = SampleStore([shard_path(feat_dir, i) for i in range(n_shards)], layers)
    cfg = config_from(args)
    extra = {"target": engine.source.name, "samples": len(samples), "tokens": n_tok, "head": args.head,
             "draft_vocab": head.draft_vocab}
    state = train(head, target, store, train_ids, val_ids, out, cfg, resume=args.resume, rank=rank, world=world,
                  progress=not args.no_progress, head_extra=extra)
    if rank == 0:
        metrics = json.loads((out / "metrics.json").read_text())
        print(f"done: {state.step} steps; head in {out / 'head'}; n-alpha "
              f"{[round(a, 3) for a in metrics.get('n_alpha', [])]}, implied tau {metrics.get('implied_tau', 0):.2f}, "
              f"draft sharpness {metrics.get('draft_sharpness', 1.0):g}; "
              f"peak memory {peak_rss_gib():.1f} GiB", file=sys.stderr)
    if world > 1:
        # Every rank leaves its last collective before any tears the group down: a rank that
        # destroys (or exits) while a peer's gloo transfer is in flight can abort that peer
        # ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def cmd_regenerate(args) -> int:
    from ..api import EagleSpec, batched_quant_default, set_threads
    from .regenerate import RegenConfig, regenerate

    set_threads()
    cfg = RegenConfig(args.max_new_tokens, args.max_length, args.temperature, args.top_p, args.seed, args.batch)
    convs = usable_conversations(args, 0)
    engine = EagleSpec.load(args.model, dtype=args.dtype, device=args.device,
                            quant=args.quant or batched_quant_default(args.device))
    report = regenerate(engine, convs, Path(args.out), cfg, progress=not args.no_progress)
    print(report.summary(), file=sys.stderr)
    return 0


def add_regenerate_args(p: argparse.ArgumentParser) -> None:
    from ..quant import QUANT_MODES
    from ..weights import DEFAULT_MODEL

    from .regenerate import RegenConfig

    d = RegenConfig()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--quant", default=None, choices=list(QUANT_MODES),
                   help="target weights (default: none on CUDA and CPUs with native bf16, where batched decoding "
                        "is fastest in the float dtype; else auto, the package's integer kernels)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", default=None, help="ShareGPT json/jsonl or OpenAI messages jsonl (default: packaged ShareGPT)")
    p.add_argument("--out", required=True, help="output jsonl (appended to; a rerun resumes)")
    p.add_argument("--skip", type=int, default=0, help="start after the first N usable conversations")
    p.add_argument("--max-conversations", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens per answer")
    p.add_argument("--max-length", type=int, default=d.max_length, help="tokens per conversation")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0: greedy")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch", type=int, default=d.batch, help="answers decoded together")
    p.add_argument("--no-progress", action="store_true")


def register(sub) -> None:
    p = sub.add_parser("train", help="train an EAGLE draft head (features, loss, checkpoints, resume)")
    add_train_args(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("regenerate", help="rewrite a dataset's answers with the target itself (batched, resumable)")
    add_regenerate_args(p)
    p.set_defaults(func=cmd_regenerate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglespec.train", description="train an EAGLE draft head")
    add_train_args(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_train(args)
    except (ValueError, OSError) as e:
        if os.environ.get("EAGLESPEC_DEBUG"):
            raise
        print(f"eaglespec train: error: {e}", file=sys.stderr)
        return 2
