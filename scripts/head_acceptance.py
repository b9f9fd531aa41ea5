"""A head's acceptance by chain depth on conversations it did not train on (teacher-forced chains,
as training's n-alpha: at depth n the head drafts from its own outputs of the n steps before):
greedy n-alpha (the head's top-1 is the target's) and, for each draft sharpness s, the acceptance
of a sampled draft, sum(min(p, q_s)), with q_s = softmax(s * draft logits / T) and
p = softmax(target logits / T) over the target's whole vocabulary.

Any q keeps the output's distribution exact; s only moves the acceptance. A head trained on soft
targets often drafts a flatter q than the target's p, so s > 1 can raise it. Write the best s into
the head's config.json as "eaglespec": {"draft_sharpness": s} (draft.parse_draft_sharpness).
Two heads compare on the same conversations by running this once for each.

  python scripts/head_acceptance.py --data held_out.jsonl --conversations 100 --temperature 1.0 \\
      --scales 1.0 1.1 1.2 --draft default
Prints markdown tables; asserts nothing.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglespec.api import EagleSpec, set_threads
from eaglespec.kv_cache import KVCache
from eaglespec.train.data import load_conversations, tokenize_conversation
from eaglespec.train.features import target_features
from eaglespec.train.loss import chain_mask, implied_tau


@dataclass
class Tally:
    """Sums over scored positions, by depth."""
    greedy: torch.Tensor  # [D] top-1 hits
    sampled: torch.Tensor  # [D, S] sum(min(p, q_s)) for each scale s
    positions: torch.Tensor  # [D]

    @classmethod
    def zeros(cls, depths: int, scales: int) -> "Tally":
        return cls(torch.zeros(depths, dtype=torch.float64), torch.zeros(depths, scales, dtype=torch.float64),
                   torch.zeros(depths, dtype=torch.float64))

    def add(self, other: "Tally") -> None:
        self.greedy += other.greedy
        self.sampled += other.sampled
        self.positions += other.positions


@torch.no_grad()
def chain_acceptance(spec: EagleSpec, ids: list[int], loss_mask: list[int], temperature: float,
                     scales: list[float], depths: int) -> Tally:
    """One conversation's Tally. Position p drafts x[p+2] from the pair (x[p+1], f[p])."""
    target, head = spec.target, spec.head.float()
    tokens = torch.tensor(ids)
    t = tokens.numel() - 1
    scored = torch.tensor(loss_mask, dtype=torch.bool)[1:]  # [t]
    feats = target_features(target, ids)[0].float()  # [T, H]
    emb = target.embed(tokens[1:])[None].float()  # [1, t, H]
    t_logits = F.linear(feats[1:], target.lm_head.weight.float())  # [t, V]: the target at p + 1
    p_all, want = (t_logits / temperature).softmax(-1), t_logits.argmax(-1)
    w_draft = head.lm_weight(target.lm_head.weight).float()  # [Vd, H]
    draft_ids = head.to_target_ids(torch.arange(w_draft.shape[0]))  # [Vd] target id of each row
    cache = KVCache(head.cache_layers, head.config.num_kv_heads, head.config.head_dim, t * depths, 1, emb.dtype, "cpu")
    pos = torch.arange(t)[None]
    tally = Tally.zeros(depths, len(scales))
    out = head(emb, feats[:-1][None], pos, cache)  # depth 0: the real features
    for n in range(depths):
        valid = scored & (torch.arange(t) >= n)  # positions whose chain started at a real feature
        logits = F.linear(head.readout(out[0]), w_draft)[valid]  # [m, Vd]
        tally.greedy[n] = int((draft_ids[logits.argmax(-1)] == want[valid]).sum())
        p = p_all[valid][:, draft_ids]  # [m, Vd]: p outside the draft vocabulary is never drafted
        for j, s in enumerate(scales):
            tally.sampled[n, j] = torch.minimum(p, (logits * (s / temperature)).softmax(-1)).sum().item()
        tally.positions[n] = int(valid.sum())
        if n + 1 < depths:  # depth n+1: position p takes its chain's output at p - 1 as feature
            prev = torch.cat([out[0, :1] * 0, out[0, :-1]], 0)[None]
            out = head.step(emb, prev, pos, cache, chain_mask(t, n + 1, "cpu"))
    return tally


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
    convs = load_conversations(args.data).conversations[-args.conversations:]
    total = Tally.zeros(args.depths, len(args.scales))
    for conv in convs:
        sample = tokenize_conversation(spec.tokenizer.hf, conv, args.max_length)
        if sample.num_loss_tokens and len(sample) > 1:
            total.add(chain_acceptance(spec, sample.input_ids, sample.loss_mask, args.temperature, args.scales,
                                       args.depths))
    n = total.positions.clamp(min=1)
    now = getattr(spec.head, "draft_sharpness", 1.0)
    print(f"head {args.draft} (draft_sharpness now {now:g}), {len(convs)} conversations of {args.data}, "
          f"{int(total.positions[0])} positions; acceptance by depth and a chain's implied tau")
    print("| draft | " + " | ".join(f"depth {d}" for d in range(args.depths)) + " | implied tau |")
    print("|---" * (args.depths + 2) + "|")
    print(row("greedy (top-1)", (total.greedy / n).tolist()))
    for j, s in enumerate(args.scales):
        print(row(f"sampled, T={args.temperature:g}, s={s:g}", (total.sampled[:, j] / n).tolist()))


if __name__ == "__main__":
    main()
