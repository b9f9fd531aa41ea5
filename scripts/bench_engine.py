"""Engine benchmark (issue: target engine): prints numbers, asserts nothing.

  1. vanilla tokens/s of eaglespec vs transformers `generate`, same GGUF weights and dtype, one
     process, runs interleaved prompt by prompt, medians;
  2. the forward-cost curve: one target forward of k new tokens after a 512-token context;
  3. cold start (process start -> first token) and peak RSS of `eaglespec generate`.

  python scripts/bench_engine.py --dtype bf16 --max-new-tokens 256 --prompts 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Give me five tips for writing clear technical documentation.",
    "What are the main differences between Python lists and tuples?",
]


def vanilla_vs_hf(dtype: str, max_new: int, n_prompts: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from eaglespec.api import EagleSpec

    engine = EagleSpec.load(dtype=dtype)
    dt = engine.target.dtype
    src = engine.source
    hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32)
    hf = hf.to(dt).eval()
    ours, theirs, same = [], [], []
    for r in range(repeats):
        for p in PROMPTS[:n_prompts]:
            res = engine.generate(p, max_new_tokens=max_new)
            _, ids = engine.encode(p)
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            with torch.inference_mode():
                y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                                min_new_tokens=max_new if res.stop_reason == "max_new_tokens" else 0,
                                eos_token_id=engine.tokenizer.eos_token_ids, pad_token_id=0)
            hf_s = time.perf_counter() - t0
            hf_new = y.shape[1] - len(ids)
            ours.append(res.tokens_per_s)
            theirs.append(hf_new / hf_s)
            same.append(y[0, len(ids):].tolist()[: res.new_tokens] == res.token_ids)
            print(f"  [{r}] eaglespec {res.tokens_per_s:6.1f} tok/s ({res.new_tokens})   "
                  f"transformers {hf_new / hf_s:6.1f} tok/s ({hf_new})   same tokens: {same[-1]}", flush=True)
    out = {"dtype": str(dt), "eaglespec_tok_s": statistics.median(ours), "hf_tok_s": statistics.median(theirs),
           "ratio_median": statistics.median(a / b for a, b in zip(ours, theirs)), "same_tokens": sum(same),
           "runs": len(same)}
    print(json.dumps(out))
    return out


def forward_curve(dtype: str, ctx: int = 512, ks=(1, 2, 4, 8, 16, 32, 64), reps: int = 9) -> dict:
    from eaglespec.api import resolve_dtype
    from eaglespec.weights import load_model

    model, _ = load_model("smollm2-135m-instruct", resolve_dtype(dtype, "cpu"))
    cache = model.new_cache(ctx + max(ks))
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], cache, logits_for="last")
        res = {}
        for k in ks:
            ts = []
            for _ in range(reps):
                cache.truncate(ctx)
                mask = None if k == 1 else torch.ones(k, ctx + k, dtype=torch.bool)
                t0 = time.perf_counter()
                model(torch.randint(0, 1000, (1, k)), torch.full((1, k), ctx), cache, mask)
                ts.append(time.perf_counter() - t0)
            res[k] = statistics.median(ts) * 1e3
    print(f"forward cost after {ctx} tokens ({dtype}): " + ", ".join(f"k={k}: {v:.1f} ms" for k, v in res.items()))
    return res


def cold_start(dtype: str) -> dict:
    """Time to first token and peak RSS of a fresh `eaglespec generate` process."""
    code = (
        "import time, resource, sys; t0 = time.perf_counter()\n"
        "from eaglespec.api import EagleSpec\n"
        f"e = EagleSpec.load(dtype={dtype!r}); s = e.stream('Hello!', max_new_tokens=16)\n"
        "it = iter(s); next(it); first = time.perf_counter() - t0\n"
        "for _ in it: pass\n"
        "long = ' '.join(['The quick brown fox jumps over the lazy dog.'] * 370)\n"
        "r = e.generate(long, max_new_tokens=4096 - len(e.encode(long)[1]), stop=['.'])\n"
        "print(first, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(e.encode(long)[1]))\n"
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    first, rss, n = out.stdout.split()
    res = {"first_token_s": float(first), "process_wall_s": wall, "peak_rss_mb": float(rss), "long_prompt_tokens": int(n)}
    print(f"cold start ({dtype}): first token after {float(first):.1f} s in-process "
          f"(python start included), peak RSS {float(rss):.0f} MB with a {n}-token prompt (cache for 4,096 tokens)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list of: hf,curve,cold")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(os.cpu_count() or 1)
    results = {}
    if "cold" not in skip:
        results["cold_start"] = cold_start(args.dtype)
    if "curve" not in skip:
        results["curve"] = {d: forward_curve(d) for d in ("bf16", "fp32")}
    if "hf" not in skip:
        results["vanilla_vs_hf"] = vanilla_vs_hf(args.dtype, args.max_new_tokens, args.prompts, args.repeats)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
