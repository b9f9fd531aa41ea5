"""The benchmark protocol and its metrics.

One process; a warm-up call per method; methods interleaved prompt by prompt (and their order
rotated from one prompt to the next), so that drift on a noisy machine hits them alike; the same
seed for every method on a given prompt, turn and repeat. Each method keeps its own conversation:
MT-bench's second turn follows that method's own first answer.

Greedy runs check losslessness: where a method saw exactly vanilla's prompt tokens, its output
must be vanilla's token for token. For eaglespec's methods a mismatch is a bug: it is printed
loudly and recorded. Baselines (hf, hf-pld, llamacpp) do other arithmetic; theirs is only counted.

n-alpha (--alpha): the eagle-chain method drafts one chain of depth 5 (static tree choices
[[0], [0, 0], ..., [0]*5]). On a chain, a depth-(n+1) draft token is verified only if depths
1..n were accepted, and its draft input then holds n features the head predicted itself, so
n-alpha = accepted at depth n+1 / accepted at depth n (0-alpha: / steps), summed over all steps.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, field


from ..config import SamplingConfig
from ..quant import greedy_exact
from .datasets import BenchItem
from .methods import CHAIN, BaselineCrashed, Method, MethodOutput


@dataclass
class BenchConfig:
    temperature: float = 0.0  # 0 = greedy (and the lossless check)
    max_new_tokens: int = 256
    repeats: int = 1
    seed: int = 0
    warmup_tokens: int = 16
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.repeats < 1:
            raise ValueError("--max-new-tokens and --repeats must be >= 1")
        SamplingConfig(temperature=self.temperature)  # validates the temperature


@dataclass
class Row:
    """One method on one turn of one prompt (one repeat)."""

    dataset: str
    category: str
    question_id: str
    turn: int
    repeat: int
    method: str
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    steps: int
    tau: float
    stop_reason: str
    accept_lengths: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    same_as_vanilla: bool | None = None  # greedy, same prompt tokens as vanilla; else None
    first_diff: int | None = None  # index of the first token that differs from vanilla's

    @property
    def key(self) -> tuple:
        return self.dataset, self.question_id, self.turn, self.repeat


@dataclass
class BenchResult:
    config: BenchConfig
    methods: list[str]
    rows: list[Row]
    setup: dict  # model, head, dtype, device
    notes: list[str] = field(default_factory=list)  # skipped methods, skipped turns
    mismatches: list[str] = field(default_factory=list)  # lossless-check failures in fp32 (bugs)
    # In bf16/fp16 without the row-invariant kernels a tree forward can round differently from
    # one-token decoding, so a near-tie argmax can flip: recorded here, not as bugs.
    rounding_differences: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return summarize(self.rows, self.methods)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _encode(engine, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """Chat-template the conversation, or join it as raw text for a model without a template."""
    if engine.tokenizer.has_chat_template:
        return engine.encode(messages)
    return engine.encode("\n\n".join(m["content"] for m in messages), chat=False)


def _row(item: BenchItem, turn: int, repeat: int, name: str, ids: list[int], out: MethodOutput) -> Row:
    n = len(out.token_ids)
    return Row(item.dataset, item.category, item.question_id, turn, repeat, name, len(ids), n, out.wall_s,
               n / out.wall_s if out.wall_s > 0 else 0.0, out.steps, out.tau, out.stop_reason,
               list(out.accept_lengths), list(out.accepted_per_depth))


def check_against_vanilla(rows: list[Row], prompts: dict[str, list[int]], outs: dict[str, MethodOutput],
                          lossless: dict[str, bool], say, exact: bool = True) -> list[str]:
    """Fill same_as_vanilla / first_diff on a turn's rows; return messages for lossless failures.

    exact: the target's mode guarantees identity (quant.greedy_exact), so any difference is a bug;
    otherwise differences are reported as reduced-precision rounding."""
    ref_ids, ref = prompts["vanilla"], outs["vanilla"].token_ids
    failures = []
    for row in rows:
        if row.method == "vanilla" or prompts[row.method] != ref_ids:
            continue
        diff = first_difference(outs[row.method].token_ids, ref)
        row.same_as_vanilla, row.first_diff = diff is None, diff
        if diff is not None and lossless[row.method]:
            where = (f"{row.method} differs from vanilla on {row.dataset} {row.question_id} turn "
                     f"{row.turn} (repeat {row.repeat}) at new token {diff}")
            if not exact:
                failures.append(f"{where} (reduced-precision rounding at a near-tie; exact in fp32)")
                continue
            msg = f"MISMATCH: {where}: greedy decoding must be lossless; this is a bug"
            say("!" * 20 + " " + msg + " " + "!" * 20)
            failures.append(msg)
    return failures


def run_bench(engine, items: list[BenchItem], methods: list[Method], cfg: BenchConfig,
              notes: list[str] = ()) -> BenchResult:
    """Run every method on every turn of every item, cfg.repeats times; rows in method order."""
    from tqdm import tqdm

    if not methods or methods[0].name != "vanilla":
        raise ValueError("the first method must be vanilla (the reference); build them with build_methods")
    names = [m.name for m in methods]
    lossless = {m.name: m.lossless for m in methods}
    result = BenchResult(cfg, names, [], {"model": engine.source.name, "head": engine.head_name or None,
                                          "dtype": str(engine.target.dtype).replace("torch.", ""),
                                          "device": str(engine.target.device),
                                          "quant": getattr(engine.target, "quant", "none")}, list(notes))
    window = engine.target.config.max_position_embeddings
    exact = greedy_exact(engine.target)  # fp32, or the row-invariant quantised CPU kernels
    text, ids = _encode(engine, [{"role": "user", "content": items[0].turns[0]}])
    warm = min(cfg.warmup_tokens, cfg.max_new_tokens, max(1, window - len(ids)))
    methods = list(methods)

    def crashed(m: Method, e: BaselineCrashed) -> None:  # a baseline's child died: go on without it
        result.notes.append(f"{e}; its rows stop there")
        methods.remove(m)
        names.remove(m.name)

    for m in list(methods):  # warm-up: first calls pay for allocator growth and lazy initialisation
        try:
            m.run(text, ids, warm, SamplingConfig(temperature=cfg.temperature, seed=cfg.seed))
        except BaselineCrashed as e:
            crashed(m, e)
    total = cfg.repeats * sum(len(i.turns) for i in items) * len(methods)
    bar = tqdm(total=total, unit="gen", desc="bench", disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True)
    say = bar.write if cfg.progress else (lambda s: print(s, file=sys.stderr, flush=True))
    for rep in range(cfg.repeats):
        for idx, item in enumerate(items):
            order = methods[idx % len(methods):] + methods[: idx % len(methods)]
            history: dict[str, list[dict[str, str]]] = {n: [] for n in names}
            for turn, user in enumerate(item.turns):
                seed = cfg.seed + 1009 * rep + 31 * idx + turn
                sampling = SamplingConfig(temperature=cfg.temperature, seed=seed)
                prompts = {n: _encode(engine, history[n] + [{"role": "user", "content": user}]) for n in names}
                longest = max(len(p[1]) for p in prompts.values())
                if longest + cfg.max_new_tokens > window:
                    result.notes.append(f"{item.dataset} {item.question_id}: turns from {turn} skipped: "
                                        f"{longest} prompt tokens + {cfg.max_new_tokens} new exceed the "
                                        f"{window}-token context window")
                    bar.update(len(methods) * (len(item.turns) - turn))
                    break
                outs: dict[str, MethodOutput] = {}
                for m in order:
                    if m.name not in names:  # crashed earlier in this conversation
                        continue
                    try:
                        outs[m.name] = m.run(*prompts[m.name], cfg.max_new_tokens, sampling)
                    except BaselineCrashed as e:
                        crashed(m, e)
                    bar.update(1)
                rows = [_row(item, turn, rep, n, prompts[n][1], outs[n]) for n in names]
                if sampling.greedy:
                    found = check_against_vanilla(rows, {n: p[1] for n, p in prompts.items()}, outs, lossless,
                                                  say, exact)
                    (result.mismatches if exact else result.rounding_differences).extend(found)
                result.rows += rows
                for n in names:
                    history[n] += [{"role": "user", "content": user}, {"role": "assistant", "content": outs[n].text}]
                bar.set_postfix_str(" ".join(f"{r.method} {r.tokens_per_s:.0f}" for r in rows) + " tok/s")
    bar.close()
    for m in methods:
        if hasattr(m, "close"):
            m.close()
    return result


# --- metrics -------------------------------------------------------------------------------
@dataclass
class MethodStats:
    """One method over a set of rows (a dataset, a category, or everything)."""

    rows: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    tau: float  # new tokens per target forward after the prefill
    speedup: float | None  # tokens/s over vanilla's tokens/s, both as total tokens / total time
    speedup_mean: float | None  # mean over rows of the per-prompt tokens/s ratio
    identical: int  # greedy rows equal to vanilla's (of `compared`)
    compared: int
    accept_length_hist: dict[str, int] = field(default_factory=dict)  # accepted length -> steps


def method_stats(rows: list[Row], vanilla: dict[tuple, Row]) -> MethodStats:
    tok, wall = sum(r.new_tokens for r in rows), sum(r.wall_s for r in rows)
    steps = sum(r.steps for r in rows)
    tps = tok / wall if wall > 0 else 0.0
    base = [vanilla[r.key] for r in rows if r.key in vanilla]
    btok, bwall = sum(b.new_tokens for b in base), sum(b.wall_s for b in base)
    speedup = tps / (btok / bwall) if base and bwall > 0 and btok > 0 else None
    ratios = [r.tokens_per_s / vanilla[r.key].tokens_per_s for r in rows
              if r.key in vanilla and vanilla[r.key].tokens_per_s > 0]
    hist: dict[int, int] = {}
    for r in rows:
        for n in r.accept_lengths:
            hist[n] = hist.get(n, 0) + 1
    compared = [r for r in rows if r.same_as_vanilla is not None]
    return MethodStats(len(rows), tok, wall, tps, sum(r.new_tokens - 1 for r in rows if r.new_tokens) / steps
                       if steps else 1.0, speedup, statistics.mean(ratios) if ratios else None,
                       sum(1 for r in compared if r.same_as_vanilla), len(compared),
                       {str(k): hist[k] for k in sorted(hist)})


def n_alpha(rows: list[Row], depth: int = 5) -> list[float | None]:
    """n-alpha for n = 0..depth-1 from chain-draft rows (see the module docstring)."""
    steps = sum(r.steps for r in rows)
    acc = [sum(r.accepted_per_depth[d] for r in rows if d < len(r.accepted_per_depth)) for d in range(depth)]
    below = [steps] + acc[:-1]
    return [a / b if b else None for a, b in zip(acc, below)]


def _by_method(rows: list[Row], methods: list[str]) -> dict[str, dict]:
    vanilla = {r.key: r for r in rows if r.method == "vanilla"}
    return {m: asdict(method_stats(rs, vanilla)) for m in methods if (rs := [r for r in rows if r.method == m])}


def summarize(rows: list[Row], methods: list[str]) -> dict:
    """Stats per dataset (and 'all' over several), per MT-bench-style category, and n-alpha where
    measured."""
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    out: dict = {"datasets": datasets, "by_dataset": {}, "by_category": {}, "n_alpha": {}}
    for ds in datasets + (["all"] if len(datasets) > 1 else []):
        rs = rows if ds == "all" else [r for r in rows if r.dataset == ds]
        out["by_dataset"][ds] = _by_method(rs, methods)
        chain = [r for r in rs if r.method == CHAIN]
        if chain:
            out["n_alpha"][ds] = n_alpha(chain)
        cats = list(dict.fromkeys(r.category for r in rs if r.category))
        if ds != "all" and cats:
            out["by_category"][ds] = {c: _by_method([r for r in rs if r.category == c], methods) for c in cats}
    return out
