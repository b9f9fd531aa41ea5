"""int4 linear kernels on the default model's shapes: torch's `_weight_int4pack_mm_for_cpu` against
the package's W4A8 VNNI kernel (csrc/int4_gemm.cpp). The 30 layers' four linears (qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536) with distinct random weights, so nothing stays in
cache; ms for all 120 products at M rows; kernels interleaved round by round in one process,
medians. Prints a markdown table; asserts nothing.

  python scripts/int4_kernel_bench.py --rounds 7 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eaglespec.quant import Int4Linear, int4_from_float

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    arms: dict[str, list[Int4Linear]] = {"torch": [], "vnni": []}
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = int4_from_float(torch.randn(n, k, generator=g) * 0.05)
            for name, layers in arms.items():
                layers.append(Int4Linear(w, None, torch.bfloat16, kernel=name))
    if any(lin.kernel != "vnni" for lin in arms["vnni"]):
        raise SystemExit("the VNNI kernel is not available here (see eaglespec.kernels.int4_kernel)")
    ms = [int(m) for m in args.ms.split(",")]
    times = {(name, m): [] for name in arms for m in ms}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for m in ms:
                xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
                for name, layers in arms.items():
                    t0 = time.perf_counter()
                    for lin in layers:
                        lin(xs[lin.in_features])
                    if r:  # round 0 warms up
                        times[(name, m)].append((time.perf_counter() - t0) * 1e3)
    print(f"ms for {len(arms['torch'])} products (median of {args.rounds}, {args.threads} threads)")
    print("| kernel | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    med = {key: statistics.median(v) for key, v in times.items()}
    for name in arms:
        print(f"| {name} | " + " | ".join(f"{med[(name, m)]:.1f}" for m in ms) + " |")
    print("| torch / vnni | " + " | ".join(f"{med[('torch', m)] / med[('vnni', m)]:.2f}x" for m in ms) + " |")


if __name__ == "__main__":
    main()
