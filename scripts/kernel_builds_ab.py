"""This checkout's C++ kernels against another revision's builds, side by side in one process:
bitwise equality and speed (medians, arms interleaved). Prints tables, asserts nothing.

Build the other revision's kernels first (each lands in ~/.cache/eaglespec/kernels/<name>_<hash>/):
  git worktree add /tmp/prev REV && (cd /tmp/prev && PYTHONPATH=src python -c \\
    "from eaglespec import kernels; print(kernels.int4_kernel().__file__, kernels.ops_kernel().__file__)")
then pass the two printed .so files:
  python scripts/kernel_builds_ab.py --int4-so A.so --ops-so B.so [--e2e 10 18 --trees 4,2,2 8,3,4 --repeats 3]

int4 linears: the default model's 120 linears (random weights) at M rows; the other build reads
fp32 group parameters when its `int4_gemm` refuses fp16 ones (revisions before 666c871).
attention: 30 layers of a binary tree of T tokens over --context tokens.
the other per-token ops (silu_mul, rms_norm, argmax_rows, topk_logprobs) at 1, 4 and 16 rows.
e2e: two copies of the default model and the shipped head, one on the other builds; MT-bench first
turns, 128 tokens, int4, T=0; every answer must agree across builds and methods.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from eaglespec import kernels
from eaglespec.quant import Int4Linear, int4_from_float

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def load_so(path: str):
    p = Path(path)
    spec = importlib.util.spec_from_file_location(p.stem, p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def old_params(old, x, codes, p16):
    """The parameters in the dtype the other build takes (fp32 before 666c871)."""
    try:
        old.int4_gemm(x, codes, p16)
        return p16
    except RuntimeError:
        return p16.float()


def int4_table(old, new, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(30):
        for n, k in SHAPES:
            w = int4_from_float(torch.randn(n, k, generator=g) * 0.05)
            codes, p16 = kernels.pack_int4(w.q, w.scale, w.zero)
            layers.append((k, codes, p16))
    layers = [(k, c, p, old_params(old, torch.zeros(1, k).bfloat16(), c, p)) for k, c, p in layers]
    print("| rows | other build ms | this build ms | speedup | same bits |\n|---|---|---|---|---|")
    for m in (1, 2, 5, 9, 17):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
        same = all(torch.equal(old.int4_gemm(xs[k], c, po), new.int4_gemm(xs[k], c, p)) for k, c, p, po in layers[:8])
        t = {0: [], 1: []}
        for _ in range(rounds):
            for arm in (0, 1):
                t0 = time.perf_counter()
                for k, c, p, po in layers:
                    old.int4_gemm(xs[k], c, po) if arm == 0 else new.int4_gemm(xs[k], c, p)
                t[arm].append((time.perf_counter() - t0) * 1e3)
        a, b = statistics.median(t[0]), statistics.median(t[1])
        print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {same} |")


def attention_table(old, new, context: int, rounds: int) -> None:
    torch.manual_seed(0)
    print("| tree tokens | other build ms | this build ms | speedup | same bits |\n|---|---|---|---|---|")
    for t in (1, 2, 5, 9, 17, 33):
        s = context + t
        q = torch.randn(1, 9, t, 64).bfloat16()
        k, v = torch.randn(1, 3, s, 64).bfloat16(), torch.randn(1, 3, s, 64).bfloat16()
        mask = torch.zeros(1, t, s, dtype=torch.bool)
        mask[:, :, :context] = True
        for i in range(t):  # node i's ancestors (parent (i - 1) // 2) and itself
            j = i
            while True:
                mask[0, i, context + j] = True
                if j == 0:
                    break
                j = (j - 1) // 2
        m = mask if t > 1 else None
        same = torch.equal(old.decode_attention(q, k, v, m, 0.125), new.decode_attention(q, k, v, m, 0.125))
        times = {0: [], 1: []}
        for _ in range(rounds):
            for arm, mod in ((0, old), (1, new)):
                t0 = time.perf_counter()
                for _ in range(30):
                    mod.decode_attention(q, k, v, m, 0.125)
                times[arm].append((time.perf_counter() - t0) * 1e3)
        a, b = statistics.median(times[0]), statistics.median(times[1])
        print(f"| {t} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {same} |")


def pointwise_table(old, new, rounds: int) -> None:
    """The per-token ops besides attention, at decode, 4-row and 16-row sizes of the default model."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g).bfloat16()
    cases = {}
    for t in (1, 4, 16):
        gate_up, hidden = torch.randn(1, t, 3072, generator=g).bfloat16(), torch.randn(1, t, 576, generator=g).bfloat16()
        logits = torch.randn(t, 49152, generator=g).bfloat16()
        cases[f"silu_mul, {t} x 3072"] = lambda m, x=gate_up: [m.silu_mul(x)]
        cases[f"rms_norm, {t} x 576"] = lambda m, x=hidden: [m.rms_norm(x, w, 1e-5)]
        cases[f"argmax_rows, {t} x 49152"] = lambda m, x=logits: [m.argmax_rows(x)]
    draft = torch.randn(4, 8192, generator=g).bfloat16()
    cases["topk_logprobs (k 4), 4 x 8192"] = lambda m: list(m.topk_logprobs(draft, 4))
    print("| op, shape | other build us | this build us | speedup | same bits |\n|---|---|---|---|---|")
    for name, f in cases.items():
        same = all(torch.equal(a, b) for a, b in zip(f(old), f(new)))
        times = {0: [], 1: []}
        for _ in range(rounds):
            for arm, mod in ((0, old), (1, new)):
                t0 = time.perf_counter()
                for _ in range(20):
                    f(mod)
                times[arm].append((time.perf_counter() - t0) / 20 * 1e6)
        a, b = statistics.median(times[0]), statistics.median(times[1])
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.1f}x | {same} |")


def e2e_table(old_int4, old_ops, data: str, first: int, last: int, trees: list[str], repeats: int = 1) -> None:
    from eaglespec.api import EagleSpec
    from eaglespec.config import SamplingConfig, TreeConfig
    from eaglespec.runtime.engine import Request

    new_ops = kernels.ops_kernel()
    other, this = EagleSpec.load(draft="default"), EagleSpec.load(draft="default")
    for mod in other.target.modules():
        if isinstance(mod, Int4Linear) and mod._vnni is not None:
            mod._vnni, mod.params = old_int4, old_params(old_int4, torch.zeros(1, mod.in_features).bfloat16(),
                                                         mod.codes, mod.params)
    lines = Path(data).read_text().splitlines()[first:last]
    prompts = [this.encode(json.loads(x)["turns"][0])[1] for x in lines]
    arms = [("vanilla", None)] + [("eagle2", TreeConfig("eagle2", *map(int, t.split(",")))) for t in trees]
    acc: dict = {}
    answers: dict[int, set] = {}
    for n, ids in enumerate(prompts * repeats):
        j = n % len(prompts)  # the prompt; its answer must be the same on every pass
        builds = [("other", other, old_ops), ("this", this, new_ops)]
        for name, es, ops in builds[:: 1 if n % 2 == 0 else -1]:
            kernels._loaded["ops"] = ops  # the attention, norm and RoPE kernels are looked up per call
            for method, tree in arms:
                r = Request(ids, method, tree, SamplingConfig(temperature=0.0), max_new_tokens=128)
                t0 = time.perf_counter()
                es.engine.run([r])
                a = acc.setdefault((name, method, tree and tree.total_tokens), [0, 0.0])
                a[0] += len(r.pending_tokens)
                a[1] += time.perf_counter() - t0
                answers.setdefault(j, set()).add(tuple(r.pending_tokens))
    kernels._loaded["ops"] = new_ops
    print("| method | other build tokens/s | this build tokens/s | this / other |\n|---|---|---|---|")
    for method, tree in arms:
        key = tree and tree.total_tokens
        (n0, s0), (n1, s1) = acc[("other", method, key)], acc[("this", method, key)]
        label = method if tree is None else f"eagle2 ({tree.total_tokens}, {tree.depth}, {tree.top_k})"
        print(f"| {label} | {n0 / s0:.1f} | {n1 / s1:.1f} | {(n1 / s1) / (n0 / s0):.3f}x |")
    print("every answer identical across builds and methods:", all(len(v) == 1 for v in answers.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--int4-so", required=True)
    ap.add_argument("--ops-so", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--e2e", type=int, nargs=2, metavar=("FIRST", "LAST"), help="MT-bench lines to run end to end")
    ap.add_argument("--data", default="../shared/data/mt_bench/question.jsonl")
    ap.add_argument("--trees", nargs="*", default=["4,2,2", "8,3,4"])
    ap.add_argument("--repeats", type=int, default=1, help="passes over the e2e prompts (tokens/s summed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old_int4, old_ops = load_so(args.int4_so), load_so(args.ops_so)
    new_int4, new_ops = kernels.int4_kernel(), kernels.ops_kernel()
    if new_int4 is None or new_ops is None:
        raise SystemExit("this checkout's kernels cannot run here (see eaglespec.kernels)")
    print("int4 linears (120, random weights):")
    int4_table(old_int4, new_int4, args.rounds)
    print(f"\nattention, 30 layers, {args.context} context tokens:")
    attention_table(old_ops, new_ops, args.context, args.rounds)
    print("\nthe other per-token ops (us a call):")
    pointwise_table(old_ops, new_ops, args.rounds)
    if args.e2e:
        print()
        e2e_table(old_int4, old_ops, args.data, *args.e2e, args.trees, args.repeats)


if __name__ == "__main__":
    main()
