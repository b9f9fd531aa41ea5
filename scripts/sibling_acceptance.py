"""How often a sampled sibling of each rank is accepted, by depth: P(rank r accepted | ranks < r
drawn from q and rejected), counted from verification's accepted paths on MT-bench first turns.
These figures set tree.SAMPLED_ACCEPT, the priors that shape a sampled tree (tree.sampled_layout).
Prints numbers, asserts nothing.

  python scripts/sibling_acceptance.py --data ../shared/data/mt_bench/question.jsonl --skip 10 --prompts 30

The tree is a bushy sampled layout (every rank < top-k tried at the shallow depths) of the given
size, so each rank is reached often enough to count.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import Counter
from pathlib import Path

from eaglespec import tree as tree_mod
from eaglespec.api import EagleSpec, set_threads
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.runtime.engine import Request
from eaglespec.spec import propose
from eaglespec.spec import step as step_mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="MT-bench jsonl")
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tree", default="21,3,4", help="total_tokens,depth,top_k of the bushy layout")
    ap.add_argument("--draft", default="default")
    args = ap.parse_args()
    if args.temperature <= 0:
        ap.error("--temperature must be > 0: greedy rows draft top-k trees, not sampled ones")
    n, depth, top_k = map(int, args.tree.split(","))
    # Every rank equally likely to the layout: siblings before depth, so each rank is tried.
    propose.sampled_layout = functools.partial(tree_mod.sampled_layout, accept=(0.4,))
    tried, hit = Counter(), Counter()
    verify = step_mod.verify

    def counting(tree, logits, sampling, step, **kw):
        acc = verify(tree, logits, sampling, step, **kw)
        for b in range(tree.batch_size):
            par = tree.parents[b].tolist()
            kids = [[i for i in range(len(par)) if par[i] == j] for j in range(len(par))]
            path, count = acc.path[b].tolist(), int(acc.count[b])
            for d in range(count):  # the accepted node at depth d tried its children in rank order
                nxt = path[d + 1] if d + 1 < count else None
                for r, c in enumerate(kids[path[d]]):
                    tried[d, r] += 1
                    if c == nxt:
                        hit[d, r] += 1
                        break
        return acc

    step_mod.verify = counting
    set_threads()
    spec = EagleSpec.load(dtype="auto", draft=args.draft, quant="auto")
    lines = [x for x in Path(args.data).read_text().splitlines() if x.strip()]
    tree = TreeConfig("eagle2", n, depth, top_k)
    print("layout:", tree_mod.static_layout(propose.sampled_layout(n, depth, top_k)).choices)
    for j, line in enumerate(lines[args.skip: args.skip + args.prompts]):
        ids = spec.encode(json.loads(line)["turns"][0])[1]
        sampling = SamplingConfig(temperature=args.temperature, seed=j)
        spec.engine.run([Request(ids, "eagle2", tree, sampling, max_new_tokens=args.max_new_tokens)])
    print(f"T={args.temperature}, {args.prompts} prompts: accepted / tried by depth and rank")
    for d in range(depth):
        print(f"depth {d}: " + "  ".join(f"rank {r} {hit[d, r] / tried[d, r]:.3f} ({tried[d, r]})"
                                         for r in range(top_k) if tried[d, r]))


if __name__ == "__main__":
    main()
