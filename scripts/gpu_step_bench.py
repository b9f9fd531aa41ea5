"""The batched step on a GPU: vanilla and eagle2 with CUDA graphs, and lossless checks.

Prints a markdown report (and writes it to --out if given); asserts nothing. Needs no download:
a Llama-2-7B-shaped target with random bf16 weights for speed, a small random fp32 model for
exactness. On a CPU, --small runs the same code at toy sizes (fixed shapes instead of graphs).

  python scripts/gpu_step_bench.py --out gpu_step.md            # on a CUDA machine
  python scripts/gpu_step_bench.py --small --device cpu         # smoke test
"""

from __future__ import annotations

import argparse
import time

import torch

from eaglespec.config import ModelConfig, SamplingConfig, TreeConfig
from eaglespec.draft import init_random_head
from eaglespec.model import Transformer
from eaglespec.runtime.engine import Engine, Request

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                 num_kv_heads=32, max_position_embeddings=4096)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
           max_position_embeddings=1024)


def random_target(shape: dict, dtype, device, seed=0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(ModelConfig(**shape))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.7 / p.shape[-1] ** 0.5)
    return model.to(dtype).eval().requires_grad_(False)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def per_token_ms(engine: Engine, prompt: list[int], method: str, tree, new_tokens: int, device) -> tuple[float, float, list[int]]:
    """(ms per new token after the first, tau, tokens) for one request alone."""
    req = engine.submit(Request(prompt, method, tree, SamplingConfig(), new_tokens))
    engine.step()  # prefill + first step (warm-up and capture happen in the first steps)
    for _ in range(4):
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    done_before = len(req.pending_tokens)
    while not req.done:
        engine.step()
    sync(device)
    wall = time.perf_counter() - t0
    toks = req.pending_tokens
    made = len(toks) - done_before
    steps = req.stats.steps - 5
    return 1e3 * wall / max(1, made), made / max(1, steps), toks


def kernel_ms(model: Transformer, device, n=20) -> float:
    """GPU time of one one-token forward's kernels (profiler), for the launch-overhead ratio."""
    from torch.profiler import ProfilerActivity, profile

    from eaglespec.kv_cache import RowKVCache

    c = model.config
    cache = RowKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 1024, 1, model.dtype, device)
    tok = torch.ones(1, 1, dtype=torch.long, device=device)
    pos = torch.full((1, 1), 511, device=device)
    cache.prepare(pos, 512)
    with torch.inference_mode():
        model(tok, pos, cache, None)
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                model(tok, pos, cache, None)
            sync(device)
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / n / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy shapes (a smoke test on a CPU)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = args.device
    cuda = torch.device(dev).type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    lines = [f"# batched step on {torch.cuda.get_device_name() if cuda else 'cpu'} (torch {torch.__version__})", ""]

    # 1. exactness: fp32 greedy, eagle2 / eagle with a random head == vanilla, graphs on and off.
    small = random_target(TOY if args.small else dict(TOY, hidden_size=512, num_layers=4, num_heads=8,
                                                      num_kv_heads=4, intermediate_size=1024), torch.float32, dev)
    head = init_random_head(small.config, seed=1, device=dev)
    prompts = [[(7 * i + j) % small.config.vocab_size for j in range(5 + 9 * i)] for i in range(6)]
    ref = Engine(small, head).run([Request(p, "vanilla", None, SamplingConfig(), 48) for p in prompts])
    ref_tokens = [r.pending_tokens for r in ref]
    for method in ("eagle2", "eagle"):
        for graphs in ([False, True] if cuda else [False]):
            eng = Engine(small, head, cuda_graphs=graphs, fixed_shapes=True, max_batch=4)
            got = eng.run([Request(p, method, TreeConfig(method), SamplingConfig(), 48) for p in prompts])
            same = sum(r.pending_tokens == want for r, want in zip(got, ref_tokens))
            lines.append(f"- fp32 greedy {method}, batch 4, graphs {graphs}: {same}/{len(prompts)} identical to vanilla")

    # 2. speed: Llama-2-7B-shaped bf16 target, random head.
    shape = TOY if args.small else LLAMA2_7B
    dtype = torch.float32 if args.small else torch.bfloat16
    big = random_target(shape, dtype, dev)
    bhead = init_random_head(big.config, seed=2, dtype=dtype, device=dev)
    prompt = list(range(1, 200))
    rows = []
    for label, graphs in (("eager", False), ("cuda graphs", True)):
        if graphs and not cuda:
            continue
        for method in ("vanilla", "eagle2"):
            eng = Engine(big, bhead, cuda_graphs=graphs, max_batch=1)
            tree = TreeConfig("eagle2", total_tokens=60, depth=6, top_k=10) if method == "eagle2" else None
            ms, tau, _ = per_token_ms(eng, prompt, method, tree, args.new_tokens, dev)
            rows.append((label, method, ms, tau))
            del eng
    k_ms = kernel_ms(big, dev) if cuda else float("nan")
    lines += ["", f"Target {'toy' if args.small else 'Llama-2-7B-shaped'} {dtype}, one-token forward kernels: "
              f"{k_ms:.2f} ms", "", "| step | method | ms / step | tau | x vanilla step | x kernel time |",
              "|---|---|---|---|---|---|"]
    van = {label: ms for label, m, ms, _ in rows if m == "vanilla"}
    for label, method, ms, tau in rows:
        step_ms = ms * tau  # ms per token x tokens per step
        lines.append(f"| {label} | {method} | {step_ms:.2f} | {tau:.2f} | {step_ms / van[label]:.2f}x | "
                     f"{step_ms / k_ms:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
