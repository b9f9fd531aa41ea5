"""The reference decode loop (one request, host-side trees): the oracle the batched engine is tested against.

Vanilla decoding is speculative decoding with no draft.

Every step scores a tree in one target forward. Without a draft the tree is only its root (the
newest token), which is exactly plain autoregressive decoding; with a draft it is the drafted
tree. Verification picks the accepted path, both KV caches keep just that path, and the
accepted tokens stream out, cut exactly at EOS, a stop string or max_new_tokens.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from .config import SamplingConfig, TreeConfig
from .draft import Drafter
from .model import Transformer
from .runtime.request import GenerationError, GenerationStats, StopChecker, check_request, cut_at_stop_string  # noqa: F401
from .sampling import make_generator, next_token
from .tree import Tree
from .verify import verify


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tree_budget(tree_cfg: TreeConfig | None) -> int:
    if tree_cfg is None:
        return 1
    return len(tree_cfg.choices) + 1 if tree_cfg.method == "eagle" else tree_cfg.total_tokens


@torch.inference_mode()
def generate_tokens(
    target: Transformer,
    prompt_ids: list[int],
    *,
    drafter: Drafter | None = None,
    tree: TreeConfig | None = None,
    sampling: SamplingConfig | None = None,
    max_new_tokens: int | None = 256,
    eos_ids: list[int] = (),
    stop_strings: list[str] = (),
    decode=None,
    stats: GenerationStats | None = None,
) -> Iterator[list[int]]:
    """Yield lists of new token ids as they are accepted; fill `stats` as it goes.

    drafter None = vanilla decoding. max_new_tokens None = until the context window is full.
    """
    sampling = sampling or SamplingConfig()
    stats = stats if stats is not None else GenerationStats()
    if drafter is not None and tree is None:
        tree = TreeConfig()
    window = target.config.max_position_embeddings
    n = len(prompt_ids)
    check_request(window, n, max_new_tokens)
    device = target.device
    budget = _tree_budget(tree if drafter is not None else None)
    # Size the cache to the request, not the model's maximum context.
    capacity = window if max_new_tokens is None else min(window, n + max_new_tokens + budget)
    cache = target.new_cache(capacity)
    gen = make_generator(sampling.seed, device) if not sampling.greedy else None
    # max_new_tokens None: stop when prompt + output fill the window (the same bound
    # check_request puts on max_new_tokens), reported as context_full.
    stop = StopChecker(list(eos_ids), list(stop_strings),
                       max_new_tokens if max_new_tokens is not None else window - n, decode)

    t0 = time.perf_counter()
    prompt = torch.tensor(prompt_ids, device=device)[None]
    # The target layers an EAGLE-3 head fuses (none for EAGLE-1/2: it reads the final features).
    layers = tuple(drafter.head.target_layers or ()) if drafter is not None else ()
    out = target(prompt, torch.arange(n, device=device)[None], cache, logits_for="last", hidden_layers=layers)
    token = next_token(out.logits[0, -1], sampling, gen)
    state = None
    if drafter is not None:
        # Draft pairs (x[t+1], f[t]) for t = 0..n-1: the prompt shifted by one, then the new token.
        # Drafting appends up to (depth - 1) * top_k uncommitted slots (eagle2), or fewer than
        # `budget` (eagle), past the committed ones.
        drafter.reset(capacity + max(budget * max(tree.depth, 8), tree.depth * tree.top_k))
        shifted = torch.tensor(prompt_ids[1:] + [token], device=device)
        state = drafter.extend(shifted, drafter.head.target_features(out)[0])
    _sync(device)
    stats.prefill_s = time.perf_counter() - t0
    reason = stop.push(token)
    stats.new_tokens = 1
    stats.wall_s = time.perf_counter() - t0
    yield [token]

    while not reason:
        ctx = cache.length
        room = capacity - ctx
        if room < 1:
            reason = "context_full"
            break
        ta = time.perf_counter()
        if drafter is None:
            t = Tree.from_parents([token], [-1])
        else:
            t = drafter.draft(token, state, tree, room)
        tb = time.perf_counter()
        mask = None
        if t.size > 1:
            mask = torch.ones(t.size, ctx + t.size, dtype=torch.bool, device=device)
            mask[:, ctx:] = t.mask.to(device)
        out = target(t.tokens.to(device)[None], t.positions(ctx).to(device)[None], cache, mask, hidden_layers=layers)
        acc = verify(t, out.logits[0], sampling, gen)
        cache.compact(ctx, acc.nodes)
        _sync(device)
        tc = time.perf_counter()
        emitted: list[int] = []
        for tok in acc.tokens + [acc.bonus]:
            emitted.append(tok)
            reason = stop.push(tok)
            if reason:
                break
        if drafter is not None and not reason:
            feats = drafter.head.target_features(out)[0, acc.nodes]  # [T, F]
            state = drafter.extend(torch.tensor(emitted, device=device), feats)
        _sync(device)
        td = time.perf_counter()
        stats.record_step(len(emitted), acc.length, t.size, (tb - ta) + (td - tc), tc - tb)
        stats.new_tokens += len(emitted)
        stats.wall_s = time.perf_counter() - t0
        token = emitted[-1]
        yield emitted
    if reason == "max_new_tokens" and max_new_tokens is None:
        reason = "context_full"
    stats.stop_reason = reason
    stats.wall_s = time.perf_counter() - t0
