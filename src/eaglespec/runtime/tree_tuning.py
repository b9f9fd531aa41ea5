"""Measured tree defaults: the eagle2 tree a request gets when it names none, chosen for this
machine from the head's acceptance and this machine's cost of a step.

Owns: reading a head's table of tau by tree (`tree_tau` in its config.json's "eaglespec" block,
measured once per head on MT-bench prompts: it depends on the head and the target, not the CPU),
timing one speculative step per tree of that table on the engine's own target (once per machine,
target, quant and thread count; cached in ~/.cache/eaglespec/trees.json), and picking the tree
with the most tokens per second, tau / step time.

Why: a tree's worth is tau over its step's cost, and the cost of scoring a tree depends on the CPU
far more than tau does. On AMX tiles a 16-node tree costs the target about one decode; on AVX2
vectors the int4 products of 8 rows cost 2.5x one. Defaults measured on one machine made eagle2
0.76x vanilla on another (README, "AVX2 CPUs and measured tree defaults").

The timing is at batch 1 (latency): a server's batched steps share the target's products and may
favour smaller trees. `EAGLESPEC_TREE_TUNING=0` keeps the static defaults (config.default_tree);
`EAGLESPEC_TREE_TUNING=retime` times again and replaces the cached timings (for a machine that was
busy the first time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import ConfigError, SamplingConfig, TreeConfig

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

KINDS = ("greedy", "sampled")  # T = 0 and T > 0 (sampled requests draft chains and sampled layouts)
CACHE_VERSION = 2  # 2: the least of per-round medians (session 27); 1's picks are timed again


@dataclass
class TreeChoice:
    """The tree picked for one kind of request, and what it was picked from."""
    tree: TreeConfig
    speedup: float  # expected tokens/s over vanilla's: tau * vanilla step / tree step
    step_ms: dict[str, float] = field(default_factory=dict)  # "n,d,k" (and "vanilla") -> ms a step


def tree_key(tree: TreeConfig) -> str:
    return f"{tree.total_tokens},{tree.depth},{tree.top_k}"


def _sizes(key: str) -> tuple[int, int, int]:
    """"n,d,k" -> (total_tokens, depth, top_k); ValueError for anything else."""
    sizes = tuple(int(x) for x in str(key).split(","))
    if len(sizes) != 3:
        raise ValueError("three sizes: total_tokens, depth, top_k")
    return sizes


def _tree(key: str) -> TreeConfig | None:
    return None if key == "vanilla" else TreeConfig("eagle2", *_sizes(key))


def parse_tree_tau(raw: object, where: str) -> dict[str, dict[str, float]]:
    """A head's `tree_tau` -> {"greedy"|"sampled": {"n,d,k": tau}}; a clear error for a bad one."""
    if not isinstance(raw, dict) or not set(raw) <= set(KINDS):
        raise ConfigError(f"{where}: tree_tau must map 'greedy' / 'sampled' to tables, got {raw!r}")
    out: dict[str, dict[str, float]] = {}
    for kind, table in raw.items():
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"{where}: tree_tau[{kind!r}] must be a non-empty table of 'n,d,k': tau")
        for key, tau in table.items():
            try:
                tree = _tree(key)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{where}: tree_tau[{kind!r}] key {key!r} is not a tree 'n,d,k' ({e})") from None
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 1.0 <= tau <= tree.depth + 1:
                raise ConfigError(f"{where}: tree_tau[{kind!r}][{key!r}] must be a number in [1, depth + 1], "
                                  f"got {tau!r}")
        out[kind] = {k: float(v) for k, v in table.items()}
    return out


def enabled() -> bool:
    return os.environ.get("EAGLESPEC_TREE_TUNING", "1") != "0"


def retime() -> bool:
    """EAGLESPEC_TREE_TUNING=retime: ignore the cached timings, time again and replace them."""
    return os.environ.get("EAGLESPEC_TREE_TUNING", "1") == "retime"


def cache_path() -> Path:
    from ..kernels import cache_root

    return cache_root().parent / "trees.json"  # beside the built kernels: ~/.cache/eaglespec


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _code_fingerprint() -> str:
    """The package's version and its CPU kernels' sources: a faster kernel changes the timings."""
    from .. import __version__
    from ..kernels import CSRC

    h = hashlib.sha256(__version__.encode())
    for p in sorted(CSRC.glob("*")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _head_shape(head) -> list:
    """What a draft step costs besides the target: the head's kind, layers and draft-vocabulary rows
    (its LM-head product is per draft step; a widened vocabulary makes the step dearer)."""
    if head is None:
        return []
    return [head.kind, head.cache_layers, head.draft_vocab]


def cache_key(engine: "Engine", kind: str, taus: dict[str, float]) -> str:
    """What the timing depends on: the CPU, threads, the target's shapes and mode, the head's shape,
    the code, the trees."""
    t = engine.target
    cfg = t.config
    parts = [CACHE_VERSION, _cpu_name(), torch.get_num_threads(), str(t.device), str(t.dtype),
             getattr(t, "quant", "none"), cfg.hidden_size, cfg.num_layers, cfg.vocab_size,
             cfg.intermediate_size, _head_shape(engine.head), torch.__version__, _code_fingerprint(), kind,
             sorted(taus)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, entry: dict) -> None:
    """Merge one entry in; atomic (a concurrent writer's entry may be lost, never the file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only home: the choice still holds for this process
        log.warning("eaglespec: could not cache the tree timings in %s (%s)", path, e)


def _step_seconds(engine: "Engine", key: str, temperature: float, new_tokens: int, seed: int,
                  context: int) -> list[float]:
    """The engine steps of one batch-1 request with tree `key` on a fixed prompt of `context`
    token ids, each timed; the first (it also prefills the prompt) left out."""
    from .engine import Request

    vocab = engine.target.config.vocab_size
    prompt = [(17 + 7919 * i) % vocab for i in range(context)]
    tree = _tree(key)
    req = engine.submit(Request(prompt, "vanilla" if tree is None else "eagle2", tree,
                                SamplingConfig(temperature=temperature, seed=seed), max_new_tokens=new_tokens))
    times = []
    while not req.done:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if req.error is not None:
        raise req.error
    return times[1:]


def time_steps(engine: "Engine", keys: list[str], temperature: float, rounds: int = 3,
               new_tokens: int = 16, context: int = 160) -> dict[str, float]:
    """Seconds per step of each tree `key` ("n,d,k", or "vanilla") on the engine's target at batch
    1, after a `context`-token prompt (about a chat turn's), after one untimed warm-up request
    (kernel builds, first calls). Each round runs one request of `new_tokens` per tree, the trees
    interleaved and every step timed alone; a round's figure for a tree is the median of its steps
    (which drops a shape's first call). The result is each tree's least figure over `rounds` rounds:
    other work on the machine only ever adds time, so a tree must be slowed in every round to lose
    (the median over two rounds picked three different trees in four timings made under load;
    README, "Session 27"). Rounds alternate direction, so no tree always
    runs after the same one. The caller turns EOS off while timing. About 24 s for the shipped
    head's greedy table (8 trees) and 29 s for its sampled one (10) on one core of an AVX2 EPYC;
    prefills are most of it."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    context = max(1, min(context, engine.window - new_tokens - 64))  # room for a tree past the answer
    _step_seconds(engine, keys[-1], temperature, 4, 0, context)
    best: dict[str, float] = {}
    for r in range(1, rounds + 1):
        for key in (keys if r % 2 else keys[::-1]):
            times = sorted(_step_seconds(engine, key, temperature, new_tokens, r, context))
            if not times:
                raise RuntimeError(f"tree {key}: no step to time (new_tokens {new_tokens})")
            best[key] = min(best.get(key, float("inf")), times[len(times) // 2])
    return {key: best[key] for key in keys}


def choose(taus: dict[str, float], step_ms: dict[str, float]) -> TreeChoice:
    """The tree of `taus` ("n,d,k" -> tau) with the most tokens per second, tau / step_ms[key];
    step_ms["vanilla"] is vanilla's step, one token each. Ties go to the smaller tree."""
    base = step_ms["vanilla"]
    best: tuple[float, TreeConfig] | None = None
    for key in sorted(taus, key=_sizes):
        speedup = taus[key] * base / step_ms[key]
        if best is None or speedup > best[0] * 1.000001:
            best = (speedup, _tree(key))
    assert best is not None
    return TreeChoice(best[1], best[0], {k: step_ms[k] for k in ("vanilla", *taus)})


def tune(engine: "Engine", kind: str, taus: dict[str, float]) -> TreeChoice:
    """The tree for `kind` requests on this machine: from the cache, else timed now (once)."""
    path, key = cache_path(), cache_key(engine, kind, taus)
    entry = None if retime() else _read_cache(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("step_ms"), dict) and \
            {"vanilla", *taus} <= set(entry["step_ms"]):
        return choose(taus, entry["step_ms"])
    print(f"eaglespec: timing {len(taus)} eagle2 trees for {kind} requests on this machine "
          f"(once; cached in {path})", file=sys.stderr, flush=True)
    eos, engine.eos_ids = engine.eos_ids, []  # every run takes all its tokens
    try:
        seconds = time_steps(engine, ["vanilla", *taus], 1.0 if kind == "sampled" else 0.0)
    finally:
        engine.eos_ids = eos
    choice = choose(taus, {k: 1e3 * v for k, v in seconds.items()})
    _write_cache(path, key, {"step_ms": choice.step_ms, "tree": tree_key(choice.tree),
                             "speedup": round(choice.speedup, 3)})
    log.info("eaglespec: %s requests get eagle2 tree %s (expected %.2fx vanilla)", kind,
             tree_key(choice.tree), choice.speedup)
    return choice
