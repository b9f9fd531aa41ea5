"""The VNNI kernels against torch's on the default model's shapes, ms, medians, kernels interleaved
round by round in one process; prints markdown tables, asserts nothing.
- int4: the 30 layers' four linears (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
  with distinct random weights, so nothing stays in cache: all 120 products at M rows,
  `_weight_int4pack_mm_for_cpu` vs the W4A8 kernel (csrc/int4_gemm.cpp).
- LM head (49152x576 per-row int8, 28 MB; `--no-head` skips it): `_weight_int8pack_mm` vs the
  W8A8 kernel (csrc/int8_gemm.cpp).

  python scripts/int4_kernel_bench.py --rounds 7 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from eaglespec.quant import Int4Linear, Int8Linear, int4_from_float

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-head", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    arms: dict[tuple[str, str], list[nn.Module]] = {("int4", "torch"): [], ("int4", "vnni"): []}
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = int4_from_float(torch.randn(n, k, generator=g) * 0.05)
            for table, kernel in arms:
                arms[(table, kernel)].append(Int4Linear(w, None, torch.bfloat16, kernel=kernel))
    if not args.no_head:
        head = (torch.randn(*HEAD, generator=g) * 0.05).bfloat16()
        for kernel in ("torch", "vnni"):
            arms[("head", kernel)] = [Int8Linear(head, None, kernel=kernel)]
    if any(lin.kernel != kernel for (_, kernel), layers in arms.items() for lin in layers):
        raise SystemExit("a VNNI kernel is not available here (see eaglespec.kernels)")
    ms = [int(m) for m in args.ms.split(",")]
    times = {(arm, m): [] for arm in arms for m in ms}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for m in ms:
                xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
                for arm, layers in arms.items():
                    t0 = time.perf_counter()
                    for lin in layers:
                        lin(xs[lin.in_features])
                    if r:  # round 0 warms up
                        times[(arm, m)].append((time.perf_counter() - t0) * 1e3)
    med = {key: statistics.median(v) for key, v in times.items()}
    titles = {"int4": f"{4 * args.layers} int4 linears", "head": "LM head, per-row int8"}
    for table in dict.fromkeys(t for t, _ in arms):
        print(f"\n{titles[table]}: ms (median of {args.rounds}, {args.threads} threads)")
        print("| kernel | " + " | ".join(f"M={m}" for m in ms) + " |")
        print("|---|" + "---|" * len(ms))
        for kernel in ("torch", "vnni"):
            print(f"| {kernel} | " + " | ".join(f"{med[((table, kernel), m)]:.1f}" for m in ms) + " |")
        print("| torch / vnni | " + " | ".join(
            f"{med[((table, 'torch'), m)] / med[((table, 'vnni'), m)]:.2f}x" for m in ms) + " |")


if __name__ == "__main__":
    main()
