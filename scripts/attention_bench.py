"""The decode attention kernel's two paths (csrc/attention.cpp's vectors, csrc/attention_amx.cpp's
AMX tiles) side by side: one layer call of a tree of T tokens over a context, the default model's
shapes (9 query heads, 3 kv heads, head_dim 64), medians of interleaved rounds, one thread. Also
prints each path's largest error against fp32 attention and checks that every tree token equals
itself decoded alone (bit for bit) on the tile path. Asserts nothing else.

  python scripts/attention_bench.py --context 256 --tokens 1,5,9,17
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from eaglespec.kernels import ops_kernel


def tree_mask(t: int, context: int) -> torch.Tensor:
    """[1, T, context + T]: the context, the root (first tree token) and each token itself."""
    m = torch.zeros(1, t, context + t, dtype=torch.bool)
    m[:, :, :context] = True
    m[0, :, context] = True
    for i in range(t):
        m[0, i, context + i] = True
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", default="1,5,9,17")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mod = ops_kernel()
    if mod is None:
        raise SystemExit("the ops kernel could not be built here")
    amx = mod.attention_amx_ready()
    paths = [False, True] if amx else [False]
    print(f"AMX tiles: {'yes' if amx else 'no (vector path only)'}; context {args.context}, one thread")
    print("| tree tokens | " + " | ".join("vector us" if not p else "AMX us" for p in paths) + " | max error vs fp32 |")
    print("|---|" + "---|" * (len(paths) + 1))
    g = torch.Generator().manual_seed(0)
    for t in map(int, args.tokens.split(",")):
        s = args.context + t
        q = torch.randn(1, 9, t, 64, generator=g).bfloat16()
        # keys and values as the cache holds them: views into a longer buffer
        k, v = (torch.randn(1, 3, s + 64, 64, generator=g).bfloat16()[:, :, :s] for _ in range(2))
        m = tree_mask(t, args.context)
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(3, 1),
                                             v.float().repeat_interleave(3, 1), attn_mask=m[:, None])
        errors = [(mod.decode_attention(q, k, v, m, 0.125, p).float() - ref).abs().max().item() for p in paths]
        if amx:
            full = mod.decode_attention(q, k, v, m, 0.125, True)
            for i in range(t):
                vis = m[0, i].nonzero().flatten()
                alone = mod.decode_attention(q[:, :, i:i + 1], k[:, :, vis], v[:, :, vis], None, 0.125, True)
                assert torch.equal(alone, full[:, :, i:i + 1]), f"token {i} differs from itself alone"
        times = {p: [] for p in paths}
        for p in paths:  # warm up
            for _ in range(args.calls // 5):
                mod.decode_attention(q, k, v, m, 0.125, p)
        for _ in range(args.rounds):
            for p in paths:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    mod.decode_attention(q, k, v, m, 0.125, p)
                times[p].append((time.perf_counter() - t0) / args.calls * 1e6)
        cols = " | ".join(f"{statistics.median(times[p]):.1f}" for p in paths)
        print(f"| {t} | {cols} | " + " / ".join(f"{e:.4f}" for e in errors) + " |")


if __name__ == "__main__":
    main()
