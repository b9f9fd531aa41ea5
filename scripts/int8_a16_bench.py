"""The default model's 121 products (30 layers x qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536, plus the 49152x576 LM head) at M rows, by mode: `int4` (W4A8 layers, W8A8 head), `int8`
(W8A8), `int8a16` on VNNI and on AMX tiles (csrc/int8_a16_gemm.cpp). Distinct random weights per
layer, so nothing stays in cache, as in a real forward. ms, medians, modes interleaved round by
round in one process; prints a markdown table, asserts nothing.

  python scripts/int8_a16_bench.py --rounds 7 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eaglespec import kernels
from eaglespec.quant import Int4Linear, Int8Linear, int4_from_float

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--ms", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    def weight(shape):
        return (torch.randn(*shape, generator=g) * 0.05).bfloat16()

    floats = [weight(s) for _ in range(args.layers) for s in SHAPES] + [weight(HEAD)]
    a16 = [Int8Linear(w, None, acts="a16") for w in floats]  # packed codes shared by both a16 paths
    modes = {
        "int4": [Int4Linear(int4_from_float(w), None, torch.bfloat16) for w in floats[:-1]] + [Int8Linear(floats[-1], None)],
        "int8": [Int8Linear(w, None) for w in floats],
        "int8a16, VNNI": a16,
    }
    amx = kernels.amx_tiles()
    if amx:
        modes["int8a16, AMX"] = a16
    del floats
    ms = [int(m) for m in args.ms.split(",")]
    times = {(name, m): [] for name in modes for m in ms}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for m in ms:
                xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
                for name, layers in modes.items():
                    for lin in a16:
                        lin.amx = name.endswith("AMX")
                    t0 = time.perf_counter()
                    for lin in layers:
                        lin(xs[lin.in_features])
                    if r:  # round 0 warms up
                        times[(name, m)].append((time.perf_counter() - t0) * 1e3)
    print(f"{len(a16)} products, ms (median of {args.rounds}, {args.threads} threads){'' if amx else '; no AMX here'}")
    print("| mode | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    for name in modes:
        med = [statistics.median(times[(name, m)]) for m in ms]
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in med) + " |")


if __name__ == "__main__":
    main()
