"""Forward cost of the default model by quant mode: k new tokens (a binary tree: node i's parent is
(i - 1) // 2, so most nodes' ancestors are not contiguous) after a 512-token context, k = 1..64; modes interleaved round by round in one process,
medians. Also prices the row-invariant (exact) attention, ours (csrc/attention.cpp) and the torch
ops version, against the plain and flash kernels, its AMX tile path against its vector path, and the package's VNNI kernels (int4 linears, int8 LM head and int8 linears) against torch's.
Prints a markdown table; asserts nothing.

  python scripts/forward_cost.py --rounds 7
  python scripts/forward_cost.py --arms "bf16 int4;bf16 int4, torch kernels"   # only these rows
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from eaglespec import attention, quant
from eaglespec.weights import DEFAULT_MODEL, load_model


def binary_tree(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([k, k] ancestor mask, [k] depths) of the tree where node i's parent is (i - 1) // 2."""
    anc = torch.zeros(k, k, dtype=torch.bool)
    for i in range(k):
        if i:
            anc[i] = anc[(i - 1) // 2]
        anc[i, i] = True
    return anc, anc.sum(1) - 1


def forward_ms(model, ctx: torch.Tensor, k: int, cache) -> float:
    """k = 0: one token with no mask, as plain decoding calls the model."""
    n = ctx.shape[1]
    cache.truncate(n)
    tokens = torch.randint(0, 1000, (1, max(k, 1)))
    anc, depth = binary_tree(max(k, 1))
    mask = torch.cat([torch.ones(max(k, 1), n, dtype=torch.bool), anc], 1)[None] if k else None
    t0 = time.perf_counter()
    model(tokens, (n + depth)[None], cache, mask=mask)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ks", default="0,1,2,4,8,16,32,64", help="0: one token without a mask (plain decoding)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arms", default="", help="row names to run, separated by ';' (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(x) for x in args.ks.split(",")]
    rows = {  # row -> (mode, int4 / int8 kernels, attention kernel)
        "bf16 none": ("none", "vnni", "exact"), "bf16 int8": ("int8", "vnni", "exact"),
        "bf16 int4": ("int4", "vnni", "exact"), "bf16 int4, plain attention": ("int4", "vnni", "plain"),
        "bf16 int4, flash attention": ("int4", "vnni", "sdpa"),
        "bf16 int4, torch ops exact attention": ("int4", "vnni", "torch-exact"),
        "bf16 int4, torch kernels": ("int4", "torch", "exact"),
        "bf16 int8, torch kernels": ("int8", "torch", "exact"),
        "bf16 int8a16": ("int8a16", "vnni", "exact"),
        # exact attention on its vector path where the default is AMX tiles (EAGLESPEC_AMX=0)
        "bf16 int4, vector attention": ("int4", "vnni", "exact-vector"),
        "bf16 int8a16, vector attention": ("int8a16", "vnni", "exact-vector"),
    }
    if args.arms:
        rows = {name: rows[name] for name in args.arms.split(";")}
    models, arms = {}, {}
    for name, (mode, kernel, attn) in rows.items():
        if (mode, kernel) not in models:
            quant.INT4_KERNEL = quant.INT8_KERNEL = kernel  # read when the layers are built
            models[(mode, kernel)] = load_model(args.model, torch.bfloat16, quant=mode)[0]
        arms[name] = (models[(mode, kernel)], attn)
    quant.INT4_KERNEL = quant.INT8_KERNEL = "vnni"
    ctx = torch.randint(0, 1000, (1, args.context))
    caches = {}
    with torch.inference_mode():
        for name, (model, _) in arms.items():
            cache = model.new_cache(args.context + max(ks) + 1)
            model(ctx, torch.arange(args.context)[None], cache, logits_for="none")
            caches[name] = cache
        times = {(name, k): [] for name in arms for k in ks}
        for r in range(args.rounds + 1):
            for k in ks:
                for name, (model, kernel) in arms.items():
                    os.environ["EAGLESPEC_AMX"] = "0" if kernel == "exact-vector" else "1"
                    attention.DECODE_KERNEL = "exact" if kernel == "exact-vector" else kernel
                    ms = forward_ms(model, ctx, k, caches[name])
                    if r:  # round 0 warms up
                        times[(name, k)].append(ms)
        attention.DECODE_KERNEL = "exact"
    print(f"{args.model}: ms per forward of k new tokens after {args.context} "
          f"(median of {args.rounds}, {args.threads} threads); x = cost / the same mode's first column")
    print("| mode | " + " | ".join("decode (k=1, no mask)" if k == 0 else f"k={k}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    for name in arms:
        med = [statistics.median(times[(name, k)]) for k in ks]
        print(f"| {name} | " + " | ".join(f"{m:.1f} ({m / med[0]:.2f}x)" for m in med) + " |")


if __name__ == "__main__":
    main()
