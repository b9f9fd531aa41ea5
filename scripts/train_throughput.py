"""Tokens/s of the two costly phases of `eaglespec train` on a CPU, before/after, interleaved.

features: the target's forward over each sample (what the dump runs), with the target loaded as
  --before-quant (the int4 kernels `--quant auto` keeps for a Q4 GGUF: what training used before)
  and as --after-quant (none: the same GGUF blocks dequantised to bf16, the new default).
train: steps of the loss + backward + AdamW on those features, fp32 (--autocast off, what a CPU
  trained in before) and bf16 autocast (the new default on CPUs with native bf16; fp32 master
  weights and optimizer), each on its own head, same batches; --ttt-steps to price the unroll.

Rounds alternate before and after, so both see the same machine load; tokens are real (unpadded)
tokens. Pin to one core for figures the README can quote:
  OMP_NUM_THREADS=1 taskset -c 0 python scripts/train_throughput.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from eaglespec.api import EagleSpec, cpu_has_native_bf16
from eaglespec.draft import DraftHead, init_head_
from eaglespec.train.data import load_conversations, tokenize_conversation
from eaglespec.train.features import target_features
from eaglespec.train.loss import Batch, eagle_loss
from eaglespec.train.vocab import frequent_tokens


@dataclass
class Rate:
    tokens: int = 0
    seconds: float = 0.0
    per_round: list[float] = field(default_factory=list)

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.per_round.append(tokens / seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def batches_of(samples, feats: list[torch.Tensor], batch_tokens: int) -> list[Batch]:
    """Consecutive samples, sorted by length, in batches of at most batch_tokens padded tokens."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    groups, cur = [], []
    for i in order:
        if cur and len(samples[i]) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    out = []
    for g in groups:
        t = max(len(samples[i]) for i in g)
        tok = torch.zeros(len(g), t, dtype=torch.long)
        feat = torch.zeros(len(g), t, feats[0].shape[-1], dtype=torch.bfloat16)
        mask = torch.zeros(len(g), t, dtype=torch.bool)
        for r, i in enumerate(g):
            n = len(samples[i])
            tok[r, :n] = torch.tensor(samples[i].input_ids)
            feat[r, :n] = feats[i]
            mask[r, :n] = torch.tensor(samples[i].loss_mask, dtype=torch.bool)
        out.append(Batch(tok, feat, mask))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=24, help="packaged ShareGPT conversations measured")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--vocab-conversations", type=int, default=800,
                   help="conversations the draft vocabulary is counted over (a few dozen hold too few distinct "
                        "tokens: the LM head, a large share of a step, would be priced too cheap)")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3, help="before/after alternations per phase")
    p.add_argument("--ttt-steps", type=int, default=1)
    p.add_argument("--before-quant", default="auto")
    p.add_argument("--after-quant", default="none")
    p.add_argument("--before-autocast", default="off", choices=["off", "on"])
    p.add_argument("--after-autocast", default="on", choices=["off", "on"])
    p.add_argument("--phases", default="features,train")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, native bf16: {cpu_has_native_bf16()}", file=sys.stderr)

    before = EagleSpec.load(args.model, quant=args.before_quant).target
    after_engine = EagleSpec.load(args.model, quant=args.after_quant)
    after = after_engine.target
    convs = load_conversations(None, limit=max(4 * args.conversations, args.vocab_conversations)).conversations
    tokenized = [tokenize_conversation(after_engine.tokenizer.hf, c, args.max_length) for c in convs]
    tokenized = [s for s in tokenized if s.num_loss_tokens > 0 and len(s) > 1]
    samples = tokenized[: args.conversations]
    n_tok = sum(len(s) for s in samples)
    phases = args.phases.split(",")
    report: dict = {"samples": len(samples), "tokens": n_tok, "threads": torch.get_num_threads(), "args": vars(args)}

    feats = [target_features(after, s.input_ids)[0].to(torch.bfloat16) for s in samples]  # warm-up, and train's data
    if "features" in phases:
        target_features(before, samples[0].input_ids)
        rates = {"before": Rate(), "after": Rate()}
        chunks = [samples[r::args.rounds] for r in range(args.rounds)]
        for r, chunk in enumerate(chunks):  # each round: the same samples through both, alternating which goes first
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                model = before if name == "before" else after
                t0 = time.perf_counter()
                for s in chunk:
                    target_features(model, s.input_ids)
                rates[name].add(sum(len(s) for s in chunk), time.perf_counter() - t0)
        report["features"] = {k: {"tokens_per_s": v.tokens_per_s, "per_round": v.per_round} for k, v in rates.items()}
        print(f"features: before ({args.before_quant}) {rates['before'].tokens_per_s:.0f} tokens/s, after "
              f"({args.after_quant}) {rates['after'].tokens_per_s:.0f} tokens/s: "
              f"{rates['after'].tokens_per_s / rates['before'].tokens_per_s:.2f}x", file=sys.stderr)

    if "train" in phases:
        batches = batches_of(samples, feats, args.batch_tokens)
        vocab = frequent_tokens(tokenized[: args.vocab_conversations], args.draft_vocab,
                                after.config.eos_token_ids).token_ids
        report["draft_vocab"] = int(vocab.numel())
        runs = {}
        for name, ac in (("before", args.before_autocast), ("after", args.after_autocast)):
            head = init_head_(DraftHead(after.config), 0)
            head.set_vocab(vocab)
            head.train()
            runs[name] = (head, torch.optim.AdamW(head.parameters(), lr=1e-4, betas=(0.9, 0.95)), ac == "on")

        def step(name: str, batch: Batch) -> None:
            head, opt, ac = runs[name]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                parts = eagle_loss(head, after, batch, ttt_steps=args.ttt_steps)
            opt.zero_grad(set_to_none=True)
            parts.total.backward()
            torch.nn.utils.clip_grad_value_(head.parameters(), 0.5)
            opt.step()

        for name in runs:  # warm-up: one step each
            step(name, batches[0])
        rates = {"before": Rate(), "after": Rate()}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for name in order:
                t0 = time.perf_counter()
                for b in batches:
                    step(name, b)
                rates[name].add(n_tok, time.perf_counter() - t0)
        report["train"] = {k: {"tokens_per_s": v.tokens_per_s, "per_round": v.per_round,
                               "median": statistics.median(v.per_round)} for k, v in rates.items()}
        print(f"train (ttt-steps {args.ttt_steps}, {len(batches)} batches, draft vocabulary {vocab.numel()}): before (autocast "
              f"{args.before_autocast}) {rates['before'].tokens_per_s:.0f} tokens/s, after (autocast "
              f"{args.after_autocast}) {rates['after'].tokens_per_s:.0f} tokens/s: "
              f"{rates['after'].tokens_per_s / rates['before'].tokens_per_s:.2f}x", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
