"""Measure a head's draft sharpness s: the acceptance of sampled chain drafts, sum(min(p, q_s)),
by chain depth, where q_s = softmax(s * draft logits / T) and p = softmax(target logits / T) over
the target's whole vocabulary, on conversations the head did not train on (teacher-forced chains,
as training's n-alpha: depth n drafts from the head's own outputs of the n steps before).

Any q keeps the output's distribution exact; s only moves the acceptance. A head trained on soft
targets often drafts a flatter q than the target's p, so s > 1 can raise it. Write the best s into
the head's config.json as "eaglespec": {"draft_sharpness": s} (draft.parse_draft_sharpness).

  python scripts/draft_sharpness.py --data held_out.jsonl --conversations 100 --temperature 1.0 \\
      --scales 1.0 1.1 1.2 --draft default
Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from eaglespec.api import EagleSpec, set_threads
from eaglespec.kv_cache import KVCache
from eaglespec.train.data import load_conversations, tokenize_conversation
from eaglespec.train.features import target_features
from eaglespec.train.loss import chain_mask, implied_tau


@torch.no_grad()
def chain_acceptance(spec: EagleSpec, ids: list[int], loss_mask: list[int], temperature: float,
                     scales: list[float], depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One conversation -> (sum over positions of sum(min(p, q_s)) [depths, len(scales)] fp64,
    scored positions [depths]). Position p drafts x[p+2] from the pair (x[p+1], f[p])."""
    target, head = spec.target, spec.head.float()
    tokens = torch.tensor(ids)
    scored = torch.tensor(loss_mask, dtype=torch.bool)[1:]
    feats = target_features(target, ids)[0].float()  # [T, H]
    t = tokens.numel() - 1
    emb = target.embed(tokens[1:])[None].float()  # [1, t, H]
    p_all = (F.linear(feats[1:], target.lm_head.weight.float()) / temperature).softmax(-1)  # [t, V]
    w_draft = head.lm_weight(target.lm_head.weight).float()  # [Vd, H]
    draft_ids = head.to_target_ids(torch.arange(w_draft.shape[0]))
    cache = KVCache(head.cache_layers, head.config.num_kv_heads, head.config.head_dim, t * depths, 1, emb.dtype, "cpu")
    pos = torch.arange(t)[None]
    sums = torch.zeros(depths, len(scales), dtype=torch.float64)
    counts = torch.zeros(depths)
    out = head(emb, feats[:-1][None], pos, cache)  # depth 0: the real features
    for n in range(depths):
        valid = scored & (torch.arange(t) >= n)  # positions whose chain started at a real feature
        logits = F.linear(head.readout(out[0]), w_draft)[valid]  # [m, Vd]
        p = p_all[valid][:, draft_ids]  # [m, Vd]: p outside the draft vocabulary is never drafted
        for j, s in enumerate(scales):
            sums[n, j] += torch.minimum(p, (logits * (s / temperature)).softmax(-1)).sum().item()
        counts[n] = int(valid.sum())
        if n + 1 < depths:  # depth n+1: position p takes its chain's output at p - 1 as feature
            prev = torch.cat([out[0, :1] * 0, out[0, :-1]], 0)[None]
            out = head.step(emb, prev, pos, cache, chain_mask(t, n + 1, "cpu"))
    return sums, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="held-out conversations (jsonl or ShareGPT json)")
    ap.add_argument("--conversations", type=int, default=100, help="the last N of the file")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.1, 1.2])
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--quant", default="auto")
    args = ap.parse_args()
    if args.temperature <= 0 or any(s <= 0 for s in args.scales):
        ap.error("--temperature and --scales must be > 0")
    set_threads()
    spec = EagleSpec.load(dtype="auto", draft=args.draft, quant=args.quant)
    convs = load_conversations(args.data).conversations[-args.conversations:]
    sums = torch.zeros(args.depths, len(args.scales), dtype=torch.float64)
    counts = torch.zeros(args.depths)
    for conv in convs:
        sample = tokenize_conversation(spec.tokenizer.hf, conv, args.max_length)
        if sample.num_loss_tokens == 0 or len(sample) < 2:
            continue
        s, c = chain_acceptance(spec, sample.input_ids, sample.loss_mask, args.temperature, args.scales, args.depths)
        sums += s
        counts += c
    now = getattr(spec.head, "draft_sharpness", 1.0)
    print(f"head {args.draft} (draft_sharpness now {now:g}), T={args.temperature}, {len(convs)} conversations of {args.data}, "
          f"{int(counts[0])} positions: sum(min(p, q_s)) by depth, and a chain's implied tau")
    print("| s | " + " | ".join(f"depth {n}" for n in range(args.depths)) + " | implied tau |")
    print("|---" * (args.depths + 2) + "|")
    for j, s in enumerate(args.scales):
        alphas = [float(sums[n, j] / max(counts[n], 1)) for n in range(args.depths)]
        print(f"| {s:g} | " + " | ".join(f"{a:.4f}" for a in alphas) + f" | {implied_tau(alphas):.3f} |")


if __name__ == "__main__":
    main()
