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
favour smaller trees. `EAGLESPEC_TREE_TUNING=0` keeps the static defaults (config.default_tree).
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
from typing import TYPE_CHECKING, Callable

import torch

from ..config import ConfigError, SamplingConfig, TreeConfig

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

KINDS = ("greedy", "sampled")  # T = 0 and T > 0 (sampled requests draft chains: top_k 1)
CACHE_VERSION = 1


@dataclass
class TreeChoice:
    """The tree picked for one kind of request, and what it was picked from."""
    tree: TreeConfig
    speedup: float  # expected tokens/s over vanilla's: tau * vanilla step / tree step
    step_ms: dict[str, float] = field(default_factory=dict)  # "n,d,k" (and "vanilla") -> ms a step


def tree_key(tree: TreeConfig) -> str:
    return f"{tree.total_tokens},{tree.depth},{tree.top_k}"


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
                sizes = [int(x) for x in str(key).split(",")]
                if len(sizes) != 3:
                    raise ValueError("three sizes: total_tokens, depth, top_k")
                tree = TreeConfig("eagle2", *sizes)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{where}: tree_tau[{kind!r}] key {key!r} is not a tree 'n,d,k' ({e})") from None
            if kind == "sampled" and tree.top_k != 1:
                raise ConfigError(f"{where}: sampled requests draft chains; tree {key!r} has top_k {tree.top_k}")
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 1.0 <= tau <= tree.depth + 1:
                raise ConfigError(f"{where}: tree_tau[{kind!r}][{key!r}] must be a number in [1, depth + 1], "
                                  f"got {tau!r}")
        out[kind] = {k: float(v) for k, v in table.items()}
    return out


def enabled() -> bool:
    return os.environ.get("EAGLESPEC_TREE_TUNING", "1") != "0"


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eaglespec" / "trees.json"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(engine: "Engine", kind: str, taus: dict[str, float]) -> str:
    """What the timing depends on: the CPU, threads, the target's shapes and mode, the trees."""
    t = engine.target
    cfg = t.config
    parts = [CACHE_VERSION, _cpu_name(), torch.get_num_threads(), str(t.device), str(t.dtype),
             getattr(t, "quant", "none"), cfg.hidden_size, cfg.num_layers, cfg.vocab_size,
             cfg.intermediate_size, torch.__version__, kind, sorted(taus)]
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


def time_step(engine: "Engine", tree: TreeConfig | None, temperature: float, rounds: int = 3,
              short: int = 4, long: int = 28) -> float:
    """Seconds per step of `tree` (None: vanilla) on the engine's target, batch 1: the difference
    between a long and a short run over their difference in steps (the prefill cancels), median
    of `rounds` (where timer noise leaves no positive difference, as on tiny test models, the long
    run's time per step). The prompt is fixed token ids; the caller turns EOS off while timing."""
    from .engine import Request

    vocab = engine.target.config.vocab_size
    prompt = [(17 + 7919 * i) % vocab for i in range(96)]
    method = "vanilla" if tree is None else "eagle2"
    per_step, whole = [], []
    for r in range(rounds + 1):  # the first round warms up (first calls, kernel builds)
        runs = []
        for n in (short, long):
            req = Request(prompt, method, tree, SamplingConfig(temperature=temperature, seed=r), max_new_tokens=n)
            t0 = time.perf_counter()
            engine.run([req])
            runs.append((time.perf_counter() - t0, max(req.stats.steps, 1)))
        (ta, sa), (tb, sb) = runs
        if r:
            whole.append(tb / sb)  # prefill included: the fallback for steps too short to time apart
            if sb > sa and tb > ta:
                per_step.append((tb - ta) / (sb - sa))
    times = sorted(per_step or whole)
    return times[len(times) // 2]


def choose(taus: dict[str, float], step_s: Callable[[TreeConfig | None], float]) -> TreeChoice:
    """The tree of `taus` ("n,d,k" -> tau) with the most tokens per second, tau / step_s(tree);
    step_s(None) is vanilla's step, one token each. Ties go to the smaller tree (listed first)."""
    base = step_s(None)
    ms = {"vanilla": 1e3 * base}
    best: tuple[float, TreeConfig] | None = None
    for key in sorted(taus, key=lambda k: tuple(map(int, k.split(",")))):
        tree = TreeConfig("eagle2", *map(int, key.split(",")))
        cost = step_s(tree)
        ms[key] = 1e3 * cost
        speedup = taus[key] * base / cost
        if best is None or speedup > best[0] * 1.000001:
            best = (speedup, tree)
    assert best is not None
    return TreeChoice(best[1], best[0], ms)


def tune(engine: "Engine", kind: str, taus: dict[str, float]) -> TreeChoice:
    """The tree for `kind` requests on this machine: from the cache, else timed now (once)."""
    path, key = cache_path(), cache_key(engine, kind, taus)
    entry = _read_cache(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("step_ms"), dict) and \
            {"vanilla", *taus} <= set(entry["step_ms"]):
        cached = entry["step_ms"]
        return choose(taus, lambda t: cached["vanilla" if t is None else tree_key(t)] / 1e3)
    print(f"eaglespec: timing {len(taus)} eagle2 trees for {kind} requests on this machine "
          f"(once; cached in {path})", file=sys.stderr, flush=True)
    temperature = 1.0 if kind == "sampled" else 0.0
    eos, engine.eos_ids = engine.eos_ids, []  # every run takes all its tokens
    try:
        choice = choose(taus, lambda t: time_step(engine, t, temperature))
    finally:
        engine.eos_ids = eos
    _write_cache(path, key, {"step_ms": choice.step_ms, "tree": tree_key(choice.tree),
                             "speedup": round(choice.speedup, 3)})
    log.info("eaglespec: %s requests get eagle2 tree %s (expected %.2fx vanilla)", kind,
             tree_key(choice.tree), choice.speedup)
    return choice
