"""A head's acceptance by chain depth on conversations it did not train on (teacher-forced chains,
as training's n-alpha, train/loss.py chain_accuracy: at depth n the head drafts from its own
outputs of the n steps before): greedy n-alpha (the head's top-1 is the target's) and, for each
draft sharpness s, the acceptance of a sampled draft, sum(min(p, q_s)), with q_s = softmax(s *
draft logits / T) and p = softmax(target logits / T) over the target's whole vocabulary.

Any q keeps the output's distribution exact; s only moves the acceptance. A head trained on soft
targets often drafts a flatter q than the target's p, so s > 1 can raise it. `eaglespec train`
picks s on its validation samples; this measures it on more data, for any head. The value goes in
the head's config.json as "eaglespec": {"draft_sharpness": s} (draft.parse_draft_sharpness).
Two heads compare on the same conversations by running this once for each.

  python scripts/head_acceptance.py --data held_out.jsonl --conversations 100 --temperature 1.0 \\
      --scales 1.0 1.1 1.2 --draft default
Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse

import torch

from eaglespec.api import EagleSpec, set_threads
from eaglespec.train.data import load_conversations, tokenize_conversation
from eaglespec.train.features import target_features
from eaglespec.train.loss import chain_accuracy, implied_tau


def row(name: str, alphas: list[float]) -> str:
    return f"| {name} | " + " | ".join(f"{a:.4f}" for a in alphas) + f" | {implied_tau(alphas):.3f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="held-out conversations (jsonl or ShareGPT json)")
    ap.add_argument("--conversations", type=int, default=100, help="the last N of the file")
    ap.add_argument("--temperature", type=float, default=1.0, help="T of the sampled acceptance")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.1, 1.2], help="draft sharpness values")
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--quant", default="auto")
    args = ap.parse_args()
    if args.temperature <= 0 or any(s <= 0 for s in args.scales) or args.depths < 1:
        ap.error("--temperature and --scales must be > 0, --depths >= 1")
    set_threads()
    spec = EagleSpec.load(dtype="auto", draft=args.draft, quant=args.quant)
    head = spec.head.float()  # as training evaluates it
    convs = load_conversations(args.data).conversations[-args.conversations:]
    total = None
    for conv in convs:
        sample = tokenize_conversation(spec.tokenizer.hf, conv, args.max_length)
        if not sample.num_loss_tokens or len(sample) < 2:
            continue
        features = target_features(spec.target, sample.input_ids)[0]  # [T, H]
        c = chain_accuracy(head, spec.target, torch.tensor(sample.input_ids), features,
                           torch.tensor(sample.loss_mask, dtype=torch.bool), args.depths,
                           scales=tuple(args.scales), temperature=args.temperature)
        total = c if total is None else total.add(c)
    if total is None:
        raise SystemExit("no conversation with an answer token within --max-length")
    now = getattr(spec.head, "draft_sharpness", 1.0)
    print(f"head {args.draft} (draft_sharpness now {now:g}), {len(convs)} conversations of {args.data}, "
          f"{total.totals[0]} positions; acceptance by depth and a chain's implied tau")
    print("| draft | " + " | ".join(f"depth {d}" for d in range(args.depths)) + " | implied tau |")
    print("|---" * (args.depths + 2) + "|")
    print(row("greedy (top-1)", total.alphas()))
    for j, s in enumerate(args.scales):
        print(row(f"sampled, T={args.temperature:g}, s={s:g}", total.sampled_alphas(j)))


if __name__ == "__main__":
    main()
