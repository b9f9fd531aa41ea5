"""How much each way of rounding the target's products costs in output quality, simulated in
fp64 on the fp32 dequantised default model: weights float or per-row int8, activations float, int8
per group of G inputs (G = 32 is the int4 / int8 modes' rounding), int8 per row, or 16-bit per row
(the int8a16 mode). Teacher-forced on conversations (a jsonl with "messages", as `eaglespec
regenerate` writes), first 256 tokens each; prints the top-1 agreement with the unrounded model and
the mean NLL of the real next tokens. Asserts nothing.

  python scripts/act_quant_probe.py --data runs/s11/data.jsonl --conversations 12
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from eaglespec.quant import layer_linears, set_submodule
from eaglespec.tokenizer import load_tokenizer
from eaglespec.weights import DEFAULT_MODEL, load_model

# name -> (weights per-row int8, activation rounding: None float, "row16", or a group size (0: the row))
ARMS = {
    "float weights, int8 acts per 32 (int4 mode)": (False, 32),
    "int8 weights, float acts": (True, None),
    "int8 weights, 16-bit acts per row (int8a16)": (True, "row16"),
    "int8 weights, int8 acts per 32 (int8 mode)": (True, 32),
    "int8 weights, int8 acts per 64": (True, 64),
    "int8 weights, int8 acts per row": (True, 0),
}


def round_rows_int8(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(w / s).clamp(-127, 127) * s


def round_acts(x: torch.Tensor, how) -> torch.Tensor:
    """x [M, K] fp32 -> the values the kernel multiplies."""
    if how is None:
        return x
    m, k = x.shape
    levels, g = (32639, k) if how == "row16" else (127, how or k)
    xg = x.reshape(m, k // g, g)
    d = xg.abs().amax(-1, keepdim=True) / levels
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xg * inv) * d).reshape(m, k)


class Rounded(nn.Module):
    def __init__(self, lin: nn.Module, int8_weights: bool, acts) -> None:
        super().__init__()
        w = lin.weight.detach().float()
        self.w = (round_rows_int8(w) if int8_weights else w).double()
        self.bias, self.acts = lin.bias, acts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = round_acts(x.reshape(-1, x.shape[-1]).float(), self.acts)
        y = (x2.double() @ self.w.T).float().reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, src = load_model(DEFAULT_MODEL, torch.float32, "cpu", quant="none")
    tok = load_tokenizer(src, target.config.eos_token_ids)
    lines = [json.loads(x) for x in open(args.data) if x.strip()][: args.conversations]
    seqs = [torch.tensor(tok.encode_chat(c["messages"], add_generation_prompt=False)[: args.tokens]) for c in lines]
    linears, head = dict(layer_linears(target)), target.lm_head

    @torch.inference_mode()
    def logits() -> list[torch.Tensor]:
        return [target(s[None], torch.arange(len(s))[None], target.new_cache(len(s) + 1), logits_for="all").logits[0].float()
                for s in seqs]

    ref = logits()
    n = sum(len(s) - 1 for s in seqs)
    nll_ref = sum(F.cross_entropy(r[:-1], s[1:], reduction="sum").item() for r, s in zip(ref, seqs)) / n
    print(f"{len(seqs)} conversations, {n} positions; NLL of the unrounded model {nll_ref:.4f}")
    print("| products | top-1 agreement | NLL |")
    print("|---|---|---|")
    for name, (int8_weights, acts) in ARMS.items():
        for path, lin in linears.items():
            set_submodule(target, path, Rounded(lin, int8_weights, acts))
        target.lm_head = Rounded(head, int8_weights, acts)
        out = logits()
        agree = sum(int((r[:-1].argmax(-1) == o[:-1].argmax(-1)).sum()) for r, o in zip(ref, out))
        nll = sum(F.cross_entropy(o[:-1], s[1:], reduction="sum").item() for o, s in zip(out, seqs)) / n
        print(f"| {name} | {agree / n:.4f} | {nll:.4f} |", flush=True)


if __name__ == "__main__":
    main()
