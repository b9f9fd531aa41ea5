"""Benchmark outputs: results.json (rows, summary, machine facts), report.md (the papers' table
shape: a row per method, a column per dataset, cells "speedup / tau") and PNG plots."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from ..files import atomic_write_text
from .runner import BenchResult


@dataclass
class ReportFiles:
    results: Path
    report: Path
    plots: list[Path] = field(default_factory=list)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": version("transformers"),
            "llama_cpp_python": version("llama_cpp_python"), "eaglespec": version("eaglespec"),
            "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _grid(by: dict[str, dict], methods: list[str], cols: list[str], cell) -> list[str]:
    """A row per method, a column per key of `by` (dataset or category)."""
    rows = [[f"`{m}`"] + [cell(by[c][m]) if m in by.get(c, {}) else "-" for c in cols]
            for m in methods if any(m in by.get(c, {}) for c in cols)]
    return _table(["method"] + cols, rows)


def speedup_tau(s: dict) -> str:
    return f"{_fmt(s['speedup'], '.2f', 'x')} / {s['tau']:.2f}"


def markdown(result: BenchResult, summary: dict, machine: dict, command: str | None) -> str:
    cfg, setup, methods = result.config, result.setup, result.methods
    by, cols = summary["by_dataset"], list(summary["by_dataset"])  # the datasets, then 'all' if several
    out = ["# eaglespec bench", "",
           f"Model `{setup['model']}` ({setup['dtype']}, {setup['device']}), draft head `{setup['head']}`; "
           f"temperature {cfg.temperature:g}, max_new_tokens {cfg.max_new_tokens}, repeats {cfg.repeats}, "
           f"seed {cfg.seed}.", "",
           f"Machine: {machine['cpu']}, {machine['cores']} cores ({machine['torch_threads']} torch threads); "
           f"torch {machine['torch']}, transformers {machine['transformers']}.", ""]
    if command:
        out += ["Command:", "", f"    {command}", ""]
    out += [f"## Speedup over vanilla / tau (T={cfg.temperature:g})", "",
            *_grid(by, methods, cols, speedup_tau), "",
            "Speedup: total new tokens / total time, over vanilla's on the same prompts. tau: new tokens "
            "per target forward after the prefill (1.00 by construction for vanilla, hf and llamacpp).", "",
            "## Tokens per second", "", *_grid(by, methods, cols, lambda s: f"{s['tokens_per_s']:.1f}"), "",
            "## Speedup as the mean of per-prompt ratios", "",
            *_grid(by, methods, cols, lambda s: _fmt(s["speedup_mean"], ".2f", "x")), ""]
    for ds, cats in summary["by_category"].items():
        out += [f"## {ds} by category (speedup / tau)", "", *_grid(cats, methods, list(cats), speedup_tau), ""]
    if cfg.temperature == 0:
        out += ["## Lossless check (greedy): identical to vanilla / compared", "",
                *_grid(by, methods[1:], cols, lambda s: f"{s['identical']}/{s['compared']}"), "",
                "Compared where a method saw exactly vanilla's prompt tokens (a second turn after a "
                "different first answer is not). eaglespec's methods must match always; hf, hf-pld and "
                "llamacpp compute differently and may drift.", ""]
    if summary["n_alpha"]:
        rows = [[ds] + [_fmt(a, ".3f") for a in alphas] for ds, alphas in summary["n_alpha"].items()]
        out += ["## n-alpha (chain drafts of depth 5)", "",
                *_table(["dataset"] + [f"{n}-alpha" for n in range(5)], rows), ""]
    hists = {m: s["accept_length_hist"] for m, s in by[cols[-1]].items() if s["accept_length_hist"]}
    if hists:
        top = max(int(k) for h in hists.values() for k in h)
        rows = [[f"`{m}`"] + [f"{100 * h.get(str(n), 0) / sum(h.values()):.1f}" for n in range(1, top + 1)]
                for m, h in hists.items()]
        out += [f"## Accepted length per step, % of steps ({cols[-1]})", "",
                *_table(["method"] + [str(n) for n in range(1, top + 1)], rows), ""]
    if result.mismatches:
        out += ["## MISMATCHES (lossless decoding broken: bugs)", ""] + [f"- {m}" for m in result.mismatches] + [""]
    if result.rounding_differences:
        out += [f"## Differences from vanilla in {result.setup.get('dtype')} ({len(result.rounding_differences)})", "",
                "A tree forward rounds differently from one-token decoding in reduced precision, so a "
                "near-tie argmax can flip; in fp32 the outputs are identical (the tests prove it).", ""]
        out += [f"- {m}" for m in result.rounding_differences] + [""]
    if result.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    return "\n".join(out)


def plot(summary: dict, methods: list[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    by, datasets = summary["by_dataset"], summary["datasets"]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(datasets) * len(methods) / 3), 3.6))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ys = [(by[d].get(m) or {}).get("speedup") or 0.0 for d in datasets]
        ax.bar([i + j * width for i in range(len(datasets))], ys, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("speedup over vanilla")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "speedup.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    overall = by[list(by)[-1]]  # 'all', or the only dataset
    hists = {m: s["accept_length_hist"] for m, s in overall.items() if s["accept_length_hist"] and m != "vanilla"}
    if hists:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        width = 0.8 / len(hists)
        for j, (m, h) in enumerate(hists.items()):
            total = sum(h.values())
            offset = (j - (len(hists) - 1) / 2) * width  # bars centred on their integer length
            ax.bar([int(k) + offset for k in h], [v / total for v in h.values()], width, label=m)
        ax.set_xticks(sorted({int(k) for h in hists.values() for k in h}))
        ax.set_xlabel("tokens accepted per step (bonus included)")
        ax.set_ylabel("share of steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out / "accept_lengths.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    if summary["n_alpha"]:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for ds, alphas in summary["n_alpha"].items():
            ax.plot(range(len(alphas)), [a if a is not None else float("nan") for a in alphas], marker="o", label=ds)
        ax.set_xlabel("n (draft-predicted features in the input)")
        ax.set_ylabel("n-alpha (acceptance rate)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out / "n_alpha.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def write_report(result: BenchResult, out_dir: str | Path, command: str | None = None) -> ReportFiles:
    """Write results.json, report.md and the plots into out_dir (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary, machine = result.summary(), machine_facts()
    data = {"command": command, "machine": machine, "setup": result.setup, "config": asdict(result.config),
            "methods": result.methods, "notes": result.notes, "mismatches": result.mismatches,
            "rounding_differences": result.rounding_differences,
            "summary": summary, "rows": [asdict(r) for r in result.rows]}
    files = ReportFiles(out / "results.json", out / "report.md")
    # Atomic, like the checkpoints: a killed run never leaves half a results file behind.
    atomic_write_text(files.results, json.dumps(data, indent=1))
    atomic_write_text(files.report, markdown(result, summary, machine, command))
    files.plots = plot(summary, result.methods, out)
    return files
