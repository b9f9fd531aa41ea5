"""The benchmark harness: the EAGLE papers' speedup / tau tables, measured on this machine.

    from eaglespec.api import EagleSpec
    from eaglespec.bench import BenchConfig, build_methods, load_datasets, run_bench, write_report

    engine = EagleSpec.load(draft="default")
    items = load_datasets(["mt_bench", "gsm8k"], limit=10)
    methods, notes = build_methods(["vanilla", "eagle2", "hf-pld"], engine)
    result = run_bench(engine, items, methods, BenchConfig(), notes=notes)
    write_report(result, "bench-out")

`eaglespec bench` (bench/cli.py) is the same thing behind a command line.
"""

from .datasets import BenchItem, DatasetError, load_dataset, load_datasets
from .methods import Method, MethodOutput, build_methods
from .report import write_report
from .runner import BenchConfig, BenchResult, Row, run_bench, summarize

__all__ = [
    "BenchConfig", "BenchItem", "BenchResult", "DatasetError", "Method", "MethodOutput", "Row",
    "build_methods", "load_dataset", "load_datasets", "run_bench", "summarize", "write_report",
]
