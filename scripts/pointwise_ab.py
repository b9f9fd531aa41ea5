"""The fused CPU ops against the torch code they replaced, end to end: `silu_mul` in the gated MLP,
`argmax_rows` in greedy verification, `topk_logprobs` in drafting (csrc/pointwise.cpp),
`qkv_rope_write` after each attention layer's qkv product (csrc/norm_rope.cpp), and the draft
head's attention on the decode kernel instead of torch's flash kernel. Each prompt
runs vanilla and eagle2 (each tree) with the torch code ("torch") and with the kernels
("kernels"), interleaved prompt by prompt in one process, one thread; prints tokens/s, tau, draft
ms per step, and whether every answer equals the torch arm's. Also times one call of each op at
the default model's sizes. Asserts nothing.

  python scripts/pointwise_ab.py --data ../shared/data/mt_bench/question.jsonl --skip 10 --prompts 6 \
      --quant int8a16 --trees 8,3,4 16,5,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import eaglespec.model as model_mod
import eaglespec.spec.propose as propose_mod
import eaglespec.spec.verify as verify_mod
from eaglespec.api import EagleSpec
from eaglespec.attention import attend
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.kernels import ops_kernel
from eaglespec.kv_cache import RowKVCache
from eaglespec.runtime.engine import Request

KERNELS = {"mlp": model_mod.MLP.forward, "greedy": verify_mod.greedy_tokens, "attend": model_mod.attend,
           "top": propose_mod.Proposer._top, "qkv": RowKVCache.write_rotated}


def torch_mlp(self, x):
    gate, up = self.w_gate_up(x).split(self.inter, dim=-1)
    return self.w_down(self.act(gate) * up)


def torch_greedy(logits):
    return logits.max(-1).indices


def torch_attend(q, k, v, mask, exact=True):
    if not exact:  # draft heads: torch's flash kernel
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return attend(q, k, v, mask, exact)


def torch_top(self, hidden, k, logits=None):
    lp = F.log_softmax(self._logits(hidden) if logits is None else logits.float(), dim=-1)
    v, i = lp.topk(k, dim=-1)
    return v, self.head.to_target_ids(i)


def torch_qkv(*args):
    return None  # Attention.forward then splits, rotates and writes with separate torch operations


TORCH = {"mlp": torch_mlp, "greedy": torch_greedy, "attend": torch_attend, "top": torch_top, "qkv": torch_qkv}


def use(arm: dict) -> None:
    model_mod.MLP.forward, verify_mod.greedy_tokens = arm["mlp"], arm["greedy"]
    model_mod.attend, propose_mod.Proposer._top = arm["attend"], arm["top"]
    RowKVCache.write_rotated = arm["qkv"]


def per_call(f, calls: int = 200) -> float:
    f()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def op_table() -> None:
    ops = ops_kernel()
    gate_up = torch.randn(16, 2 * 1536).bfloat16()
    logits = torch.randn(1, 16, 49152).bfloat16()
    draft = torch.randn(1, 4, 8192).bfloat16()
    rows = [("silu(gate) * up, 16 x 1536", lambda: (lambda g, u: F.silu(g) * u)(*gate_up.split(1536, -1)),
             lambda: ops.silu_mul(gate_up)),
            ("argmax, 16 x 49,152", lambda: logits.max(-1).indices, lambda: ops.argmax_rows(logits)),
            ("log_softmax + top-4, 4 x 8,192", lambda: F.log_softmax(draft.float(), -1).topk(4, -1),
             lambda: ops.topk_logprobs(draft, 4))]
    print("| op | torch (us) | kernel (us) |\n|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {per_call(a):.1f} | {per_call(b):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--trees", nargs="+", default=["8,3,4"], help="eagle2 total_tokens,depth,top_k")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if ops_kernel() is None:
        raise SystemExit("the ops kernel does not build here: nothing to compare")
    op_table()
    eagle = EagleSpec.load(draft="default", quant=args.quant)
    lines = open(args.data, encoding="utf-8").read().splitlines()[args.skip:args.skip + args.prompts]
    prompts = [eagle.encode(json.loads(line)["turns"][0])[1] for line in lines]
    trees = [None] + [tuple(map(int, t.split(","))) for t in args.trees]

    def run(prompt, tree):
        req = Request(prompt, "vanilla" if tree is None else "eagle2", None if tree is None else TreeConfig("eagle2", *tree),
                      SamplingConfig(temperature=0.0), max_new_tokens=args.max_new_tokens)
        t0 = time.perf_counter()
        eagle.engine.run([req])
        return req, time.perf_counter() - t0

    for arm in (TORCH, KERNELS):  # warm-up
        use(arm)
        for tree in trees:
            run(prompts[0], tree)
    res: dict = {}
    for prompt in prompts:
        for tree in trees:
            for name, arm in (("torch", TORCH), ("kernels", KERNELS)):
                use(arm)
                req, wall = run(prompt, tree)
                d = res.setdefault((tree, name), {"tokens": 0, "wall": 0.0, "steps": 0, "draft": 0.0, "out": []})
                d["tokens"] += len(req.pending_tokens)
                d["wall"] += wall
                d["steps"] += req.stats.steps
                d["draft"] += req.stats.draft_s
                d["out"].append(req.pending_tokens)
    use(KERNELS)
    print(f"\n{args.quant}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, T=0, one thread")
    print("| method | arm | tokens/s | x torch arm | x own vanilla | tau | draft ms/step | same tokens as torch arm |")
    print("|---|---|---|---|---|---|---|---|")
    for tree in trees:
        for name in ("torch", "kernels"):
            d, base = res[(tree, name)], res[(None, name)]
            tps = d["tokens"] / d["wall"]
            same = sum(a == b for a, b in zip(d["out"], res[(tree, "torch")]["out"]))
            label = "vanilla" if tree is None else "eagle2 " + ",".join(map(str, tree))
            print(f"| {label} | {name} | {tps:.1f} | {tps / (res[(tree, 'torch')]['tokens'] / res[(tree, 'torch')]['wall']):.2f}x "
                  f"| {tps / (base['tokens'] / base['wall']):.2f}x | {d['tokens'] / d['steps']:.2f} "
                  f"| {1e3 * d['draft'] / d['steps']:.2f} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
