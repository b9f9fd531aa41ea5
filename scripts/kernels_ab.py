"""Greedy vanilla decode tokens/s: new kernels vs the model as it was (torch kernels, torch ops),
and bf16 none as it was; interleaved round by round in one process, medians. Prints a markdown
table; asserts nothing.

  python scripts/kernels_ab.py 64      # new tokens per round
"""
import os
import statistics
import sys
import time

import torch

from eaglespec import quant
from eaglespec.api import set_threads
from eaglespec.weights import DEFAULT_MODEL, load_model
set_threads()
new = load_model(DEFAULT_MODEL, torch.bfloat16, quant="int4")[0]
quant.INT4_KERNEL = quant.INT8_KERNEL = "torch"
old = load_model(DEFAULT_MODEL, torch.bfloat16, quant="int4")[0]
bf16 = load_model(DEFAULT_MODEL, torch.bfloat16, quant="none")[0]
arms = {"int4, new kernels": (new, "1"), "int4, as before": (old, "0"), "bf16 none, as before": (bf16, "0")}
N, CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 64, 256
res = {k: [] for k in arms}
with torch.inference_mode():
    for r in range(4):
        for name, (m, kern) in arms.items():
            os.environ["EAGLESPEC_KERNELS"] = kern
            cache = m.new_cache(CTX + N + 1)
            ids = torch.randint(0, 1000, (1, CTX), generator=torch.Generator().manual_seed(r))
            tok = m(ids, torch.arange(CTX)[None], cache, logits_for="last").logits[0, -1].argmax().view(1, 1)
            t0 = time.perf_counter()
            for i in range(N):
                tok = m(tok, torch.tensor([[CTX + i]]), cache, logits_for="last").logits[0, -1].argmax().view(1, 1)
            if r:
                res[name].append(N / (time.perf_counter() - t0))
base = statistics.median(res["bf16 none, as before"])
for name, v in res.items():
    print(f"| {name} | {statistics.median(v):.1f} tok/s | {statistics.median(v) / base:.2f}x |")
