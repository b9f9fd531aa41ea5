"""The training-time test's attention at a stage's shapes, forward and backward on one thread: SDPA
over all (s+1)T keys with the dense chain mask against attention.ChainMask.attend (query chunks over
the visible keys), for unrolled steps s = 1..3. Prints milliseconds and the largest difference of
outputs and gradients; asserts nothing.

  OMP_NUM_THREADS=1 python scripts/chain_attention_cost.py --chunk 128
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from eaglespec import attention
from eaglespec.attention import ChainMask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=attention.CHAIN_CHUNK, help="queries per SDPA call")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=511, help="T: pairs per sequence")
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("NH", "NKV", "HD"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.chunk < 1 or args.length < 1 or args.repeats < 1:
        ap.error("--chunk, --length and --repeats must be >= 1")
    attention.CHAIN_CHUNK = args.chunk
    torch.manual_seed(0)
    b, t, (nh, nkv, hd) = args.batch, args.length, args.heads
    print(f"B {b}, T {t}, {nh} query heads over {nkv} key/value heads of {hd}, chunks of {args.chunk}; "
          f"{torch.get_num_threads()} thread(s)")
    print("| step s | dense mask, ms | ChainMask, ms | x | max difference |")
    print("|---|---|---|---|---|")
    for s in (1, 2, 3):
        mask = ChainMask(t, s)
        dense_mask = mask.dense()
        q = torch.randn(b, nh, t, hd, requires_grad=True)
        k = torch.randn(b, nkv, (s + 1) * t, hd, requires_grad=True)
        v = torch.randn(b, nkv, (s + 1) * t, hd, requires_grad=True)
        go = torch.randn(b, nh, t, hd)

        def dense():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, enable_gqa=nkv != nh)

        def chunks():
            return mask.attend(q, k, v)

        results, ms = {}, {"dense": [], "chunks": []}
        for _ in range(args.repeats):
            for name, fn in (("dense", dense), ("chunks", chunks)):
                t0 = time.perf_counter()
                out = fn()
                grads = torch.autograd.grad(out, (q, k, v), go)
                ms[name].append(1e3 * (time.perf_counter() - t0))
                results[name] = (out.detach(), *grads)
        diff = max(float((x - y).abs().max()) for x, y in zip(results["dense"], results["chunks"]))
        d, c = min(ms["dense"]), min(ms["chunks"])
        print(f"| {s} | {d:.0f} | {c:.0f} | {d / c:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
