"""The benchmark harness: a quick run on a tiny random model writes valid results.json, report.md
and PNGs; the greedy lossless check catches a planted mismatch; dataset loaders read the real
files and name the line of a malformed record; a missing optional baseline is a note, not a crash."""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import SPECIALS, WORDS, randomize_, save_word_tokenizer
from eaglespec.bench import BenchConfig, DatasetError, build_methods, load_dataset, load_datasets, run_bench, write_report
from eaglespec.bench.methods import CHAIN, EngineMethod
from eaglespec.bench.runner import Row, n_alpha, summarize
from eaglespec.cli import main
from eaglespec.weights import ModelSource
from tiny import tiny_config, tiny_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
EOS = SPECIALS.index("<|im_end|>")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny random target (tests/tiny.py) with a word tokenizer, a 512-token window and a random head."""
    from eaglespec.api import EagleSpec
    from eaglespec.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_word_tokenizer(path)
    cfg = tiny_config(vocab=len(SPECIALS) + len(WORDS), max_pos=512, eos=EOS)
    src = ModelSource("hf", path, "tiny")
    e = EagleSpec(tiny_model(cfg, seed=3), load_tokenizer(src, cfg.eos_token_ids), src)
    e.set_draft("random")
    return e


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture
def mixed(tmp_path) -> Path:
    """One file holding all three formats (two MT-bench questions with categories)."""
    return write_jsonl(tmp_path / "mixed.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["the cat sat on the mat", "why did the cat sit"]},
        {"question_id": 2, "category": "math", "turns": ["one two three four"]},
        {"task_id": "HumanEval/0", "prompt": "def red(blue): what"},
        {"question": "how big is the sun"}])


def test_quick_run_writes_results_report_and_plots(engine, mixed, tmp_path):
    items = load_datasets([], data=[mixed])
    methods, notes = build_methods(["vanilla", "eagle", "eagle2", "hf", "hf-pld", "llamacpp"], engine, alpha=True)
    assert [m.name for m in methods] == ["vanilla", "eagle", "eagle2", "hf", "hf-pld", CHAIN]
    assert any("llamacpp skipped" in n for n in notes)
    result = run_bench(engine, items, methods, BenchConfig(max_new_tokens=8, progress=False), notes)
    files = write_report(result, tmp_path / "out")

    data = json.loads(files.results.read_text())
    assert len(data["rows"]) == 5 * len(methods)  # 5 turns in all
    assert {"cpu", "cores", "torch"} <= set(data["machine"]) and data["machine"]["cores"] >= 1
    assert data["setup"] == {"model": "tiny", "head": "random", "dtype": "float32", "device": "cpu", "quant": "none"}
    assert data["mismatches"] == [] and any("llamacpp" in n for n in data["notes"])
    for row in data["rows"]:
        assert row["new_tokens"] >= 1 and row["wall_s"] > 0 and row["tau"] >= 1.0
        if row["method"] != "vanilla" and row["turn"] == 0:
            assert row["same_as_vanilla"] is True, row  # fp32: hf on our weights matches too
    stats = data["summary"]["by_dataset"]["mixed"]
    assert stats["vanilla"]["speedup"] == pytest.approx(1.0) and stats["vanilla"]["tau"] == 1.0
    assert stats["eagle2"]["compared"] >= 4 and stats["eagle2"]["identical"] == stats["eagle2"]["compared"]
    assert sum(stats["eagle"]["accept_length_hist"].values()) == sum(r["steps"] for r in data["rows"]
                                                                     if r["method"] == "eagle")
    assert len(data["summary"]["n_alpha"]["mixed"]) == 5
    assert set(data["summary"]["by_category"]["mixed"]) == {"writing", "math"}

    md = files.report.read_text()
    assert "| method | mixed |" in md and "| method | writing | math |" in md
    assert re.search(r"\| `eagle2` \| \d+\.\d\dx / \d\.\d\d \|", md), md
    assert "n-alpha" in md and "llamacpp skipped" in md
    assert sorted(p.name for p in files.plots) == ["accept_lengths.png", "n_alpha.png", "speedup.png"]
    assert all(p.read_bytes()[:8] == PNG for p in files.plots)


def plant_eagle2_mismatch(monkeypatch, vocab_size: int) -> None:
    """Make eagle2's last generated token differ from the one it really produced."""
    real_run = EngineMethod.run

    def corrupted(self, *args):
        out = real_run(self, *args)
        if self.name == "eagle2":
            out.token_ids[-1] = (out.token_ids[-1] + 1) % vocab_size
        return out

    monkeypatch.setattr(EngineMethod, "run", corrupted)


def test_planted_mismatch_is_caught_and_reported(engine, mixed, tmp_path, monkeypatch, capsys):
    plant_eagle2_mismatch(monkeypatch, engine.target.config.vocab_size)
    items = load_datasets([], data=[mixed], limit=1)
    methods, _ = build_methods(["vanilla", "eagle2"], engine)
    result = run_bench(engine, items, methods, BenchConfig(max_new_tokens=6, progress=False))
    assert "MISMATCH: eagle2 differs from vanilla" in capsys.readouterr().err
    assert result.mismatches and all("eagle2" in m for m in result.mismatches)
    bad = [r for r in result.rows if r.method == "eagle2" and r.same_as_vanilla is False]
    assert bad and bad[0].first_diff == bad[0].new_tokens - 1
    assert "MISMATCHES" in write_report(result, tmp_path).report.read_text()


def test_bf16_difference_is_reported_as_rounding_not_a_bug(engine, mixed, tmp_path, monkeypatch, capsys):
    """In bf16 a difference from vanilla is near-tie rounding (README): recorded and reported, but
    not as a lossless failure, which only fp32 can show."""
    import copy

    from eaglespec.api import EagleSpec

    e16 = EagleSpec(copy.deepcopy(engine.target).to(torch.bfloat16), engine.tokenizer, engine.source)
    e16.set_draft("random")
    plant_eagle2_mismatch(monkeypatch, e16.target.config.vocab_size)
    methods, _ = build_methods(["vanilla", "eagle2"], e16)
    result = run_bench(e16, load_datasets([], data=[mixed], limit=1), methods,
                       BenchConfig(max_new_tokens=6, progress=False))
    assert result.mismatches == [] and "MISMATCH" not in capsys.readouterr().err
    assert result.rounding_differences and all("eagle2" in m for m in result.rounding_differences)
    report = write_report(result, tmp_path).report.read_text()
    assert "Differences from vanilla in bfloat16" in report and "MISMATCHES" not in report


def test_a_baseline_that_crashes_is_a_note_not_the_end(engine, mixed, tmp_path):
    """A child process that dies mid-run (llama.cpp segfaulted on one machine): the run goes on."""
    import subprocess

    from eaglespec.bench.methods import LlamaCppMethod

    items = load_datasets([], data=[mixed])
    methods, notes = build_methods(["vanilla", "eagle2"], engine)
    # A "llama.cpp" child that answers the warm-up, then dies with SIGSEGV on the next request.
    script = ("import json, os, signal, sys\n"
              "sys.stdin.readline(); print(json.dumps({'tokens': [5], 'wall_s': 0.01}), flush=True)\n"
              "sys.stdin.readline(); os.kill(os.getpid(), signal.SIGSEGV)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    methods.append(LlamaCppMethod(proc, [], engine.tokenizer.decode))
    result = run_bench(engine, items, methods, BenchConfig(max_new_tokens=6, progress=False), notes)
    assert any("llamacpp crashed" in n and "signal" in n for n in result.notes), result.notes
    assert {r.method for r in result.rows} == {"vanilla", "eagle2"}
    assert len(result.rows) == 5 * 2 and result.mismatches == []


def test_missing_llamacpp_is_skipped_with_a_note(engine, monkeypatch):
    monkeypatch.setattr(engine, "source", ModelSource("gguf", Path("model.gguf"), "model"))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    methods, notes = build_methods(["vanilla", "llamacpp"], engine)
    assert [m.name for m in methods] == ["vanilla"]
    assert len(notes) == 1 and "llama-cpp-python is not installed" in notes[0]


def test_cli_bench_on_a_checkpoint(tmp_path, mixed, isolated_cache, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = tmp_path / "ckpt"
    cfg = LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=EOS, pad_token_id=None)
    randomize_(LlamaForCausalLM(cfg), seed=5).save_pretrained(str(ckpt), safe_serialization=True)
    save_word_tokenizer(ckpt)
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"question_id": "a1", "category": "", "turns": ["the sun sat"]}])
    rc = main(["bench", "--model", str(ckpt), "--dtype", "fp32", "--data", str(mixed), "--methods",
               "vanilla,eagle2,hf-pld,llamacpp", "--draft", "random", "--max-new-tokens", "6",
               "--datasets", "alpaca", "--alpaca", str(alpaca),
               "--categories", "writing", "--out", str(tmp_path / "out"), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "llamacpp skipped" in err and "## Speedup over vanilla / tau" in out
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {r["question_id"] for r in data["rows"]} == {"1", "HumanEval/0", "4", "a1"}  # math filtered out
    assert {r["dataset"] for r in data["rows"]} == {"mixed", "alpaca"}
    assert (tmp_path / "out" / "speedup.png").read_bytes()[:8] == PNG


def test_metrics_on_known_rows():
    def row(method: str, qid: str, tokens: int, wall: float, steps: int, apd=()) -> Row:
        return Row("d", "", qid, 0, 0, method, 5, tokens, wall, tokens / wall, steps, 0.0, "", [], list(apd))

    rows = [row("vanilla", "a", 11, 1.0, 10), row("vanilla", "b", 21, 1.0, 20),
            row(CHAIN, "a", 11, 0.5, 5, [4, 2, 1, 1, 0]), row(CHAIN, "b", 21, 2.0, 5, [4, 2, 1, 0, 0])]
    s = summarize(rows, ["vanilla", CHAIN])["by_dataset"]["d"][CHAIN]
    assert s["speedup"] == pytest.approx((32 / 2.5) / (32 / 2.0))  # total tokens over total time
    assert s["speedup_mean"] == pytest.approx((22 / 11 + 10.5 / 21) / 2)  # mean of per-prompt ratios
    assert s["tau"] == pytest.approx(30 / 10)
    assert n_alpha([r for r in rows if r.method == CHAIN]) == pytest.approx([0.8, 0.5, 0.5, 0.5, 0.0])


# --- datasets ------------------------------------------------------------------------------
def need_shared(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared is only in the development checkout)")
    return path


def test_mt_bench_real_file():
    items = load_dataset("mt_bench", need_shared(SHARED / "mt_bench" / "question.jsonl"))
    assert len(items) == 80 and all(len(i.turns) == 2 for i in items)
    assert len({i.category for i in items}) == 8 and items[0].question_id == "81"
    coding = load_datasets(["mt_bench"], categories=["coding"], limit=3,
                           paths={"mt_bench": SHARED / "mt_bench" / "question.jsonl"})
    assert len(coding) == 3 and {i.category for i in coding} == {"coding"}
    with pytest.raises(DatasetError, match="--categories poetry: not in the data; available: coding"):
        load_datasets(["mt_bench"], categories=["poetry"], paths={"mt_bench": SHARED / "mt_bench" / "question.jsonl"})


def test_humaneval_from_the_package():
    items = load_dataset("humaneval")
    assert len(items) == 164 and items[0].question_id == "HumanEval/0"
    assert all(len(i.turns) == 1 and "def " in i.turns[0] for i in items)  # the prompt is the function stub


def test_gsm8k_real_file():
    items = load_dataset("gsm8k", need_shared(SHARED / "gsm8k" / "train.jsonl"), limit=80)
    assert len(items) == 80 and items[0].turns[0].startswith("Natalia sold clips")


def test_alpaca_real_file():
    """EAGLE's fourth set runs like the others: by name, one turn per instruction."""
    items = load_dataset("alpaca", need_shared(SHARED / "alpaca" / "question.jsonl"))
    assert len(items) == 80 and all(len(i.turns) == 1 and i.dataset == "alpaca" for i in items)
    assert items[0].question_id == "0" and items[0].turns[0].startswith("What would be the best type of exercise")
    both = load_datasets(["alpaca", "gsm8k"], limit=2, paths={"alpaca": SHARED / "alpaca" / "question.jsonl",
                                                              "gsm8k": need_shared(SHARED / "gsm8k" / "train.jsonl")})
    assert [i.dataset for i in both] == ["alpaca", "alpaca", "gsm8k", "gsm8k"]


def test_missing_file_says_which_flag(tmp_path):
    with pytest.raises(DatasetError, match="--mt-bench FILE"):
        load_dataset("mt_bench", tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="--alpaca FILE"):
        load_dataset("alpaca", tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="unknown dataset 'spec_bench'; choose from mt_bench, humaneval, gsm8k, alpaca"):
        load_dataset("spec_bench")


@pytest.mark.parametrize("name,records,needle", [
    ("mt_bench", [{"question_id": 1, "turns": ["hi"]}, "", "{not json"], r"\.jsonl:3: not valid JSON"),
    ("mt_bench", [{"question_id": 1, "turns": ["hi"]}, {"question_id": 2, "turns": "hi"}],
     r'\.jsonl:2: "turns" must be a non-empty list'),
    ("gsm8k", [{"question": "q"}, {"answer": "42"}], r'\.jsonl:2: "question" must be a non-empty string'),
    ("gsm8k", ["[1, 2]"], r"\.jsonl:1: expected a JSON object"),
    ("data", [{"turns": ["a"]}, {"text": "b"}], r"\.jsonl:2: expected MT-bench"),
])
def test_malformed_line_is_named(tmp_path, name, records, needle):
    path = write_jsonl(tmp_path / f"{name}.jsonl", records)
    with pytest.raises(DatasetError, match=needle):
        load_datasets([], data=[path]) if name == "data" else load_dataset(name, path)


def test_malformed_humaneval_gz_is_named(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n" + '{"task_id": 1, "prompt": 3}\n')
    with pytest.raises(DatasetError, match=r"HumanEval\.jsonl\.gz:2: \"prompt\" must be"):
        load_dataset("humaneval", path)
