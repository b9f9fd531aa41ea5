"""The command line: every bad input ends with exit code 2 and one `eaglespec: error:` line (no
traceback); good input on a tiny checkpoint gives the documented JSON records and streamed text."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglespec.cli import main

ERR = "eaglespec: error:"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_error(rc: int, err: str, *needles: str, only_line: bool = True) -> str:
    """Exit 2, no traceback, exactly one error line (the last); with only_line, nothing else on
    stderr (errors found after the model loaded follow its one '# loaded ...' info line)."""
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip("\n").splitlines()
    errors = [line for line in lines if line.startswith(ERR)]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    if only_line:
        assert len(lines) == 1, err
    else:
        assert all(line.startswith("# ") for line in lines[:-1]), err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


@pytest.fixture
def ckpt(tiny_chat_checkpoint) -> str:
    return str(tiny_chat_checkpoint)


@pytest.fixture(autouse=True)
def _cache(isolated_cache, monkeypatch):
    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)


def gen(ckpt: str, *extra: str) -> list[str]:
    return ["generate", "--model", ckpt, "--dtype", "fp32", *extra]


# --- bad models ----------------------------------------------------------------------------
def test_unknown_model_id(capsys):
    rc, out, err = run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi")
    assert_error(rc, err, "unknown model 'no-such-model'", "smollm2-135m-instruct")
    assert out == ""


def test_missing_gguf_file(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--model", tmp_path / "absent.gguf", "--prompt", "hi")
    assert_error(rc, err, "absent.gguf")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}))
    rc, _, err = run(capsys, "generate", "--model", tmp_path, "--prompt", "hi")
    assert_error(rc, err, "unsupported architecture", "GPT2LMHeadModel")


def test_dir_without_config(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--model", tmp_path, "--prompt", "hi")
    assert_error(rc, err, "config.json")


@pytest.mark.parametrize("how", ["random", "truncated_header", "magic_only"])
def test_corrupt_gguf(capsys, tmp_path, how):
    p = tmp_path / "bad.gguf"
    p.write_bytes({"random": np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8).tobytes(),
                   "truncated_header": b"GGUF\x03\x00\x00\x00\x05",
                   "magic_only": b"GGUF"}[how])
    rc, _, err = run(capsys, "generate", "--model", p, "--prompt", "hi")
    assert_error(rc, err, "bad.gguf")


def test_truncated_safetensors(capsys, ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, _, err = run(capsys, *gen(str(d), "--prompt", "hello"))
    assert_error(rc, err, "corrupt or truncated safetensors")


def test_missing_chat_template(capsys, ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    for f in d.glob("chat_template.*"):
        f.unlink()
    rc, _, err = run(capsys, *gen(str(d), "--prompt", "hello"))
    assert_error(rc, err, "no chat template", "--no-chat", only_line=False)
    rc, out, err = run(capsys, *gen(str(d), "--prompt", "hello", "--no-chat", "--max-new-tokens", "2"))
    assert rc == 0, err


# --- requests that cannot fit ----------------------------------------------------------------
def test_prompt_longer_than_context(capsys, ckpt):
    rc, out, err = run(capsys, *gen(ckpt, "--no-chat", "--prompt", " ".join(["hello"] * 40)))
    assert_error(rc, err, "40 tokens", "context window of 32", only_line=False)
    assert out == ""


def test_prompt_exactly_filling_context(capsys, ckpt):
    rc, _, err = run(capsys, *gen(ckpt, "--no-chat", "--prompt", " ".join(["cat"] * 32)))
    assert_error(rc, err, "context window of 32", only_line=False)


def test_max_new_tokens_cannot_fit(capsys, ckpt):
    rc, _, err = run(capsys, *gen(ckpt, "--no-chat", "--prompt", "hello world", "--max-new-tokens", "100"))
    assert_error(rc, err, "--max-new-tokens", "at most 30", only_line=False)


@pytest.mark.parametrize("n", ["0", "-3"])
def test_max_new_tokens_not_positive(capsys, ckpt, n):
    rc, _, err = run(capsys, *gen(ckpt, "--no-chat", "--prompt", "hello", "--max-new-tokens", n))
    assert_error(rc, err, "max_new_tokens must be >= 1", only_line=False)


def test_second_turn_that_no_longer_fits(capsys, ckpt, tmp_path):
    """The first turn fits; the second (prompt + first answer) does not: a clean error then."""
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"turns": ["hello world", " ".join(["cat"] * 12)]}) + "\n")
    rc, out, err = run(capsys, *gen(ckpt, "--prompts", p, "--json", "--max-new-tokens", "10"))
    assert_error(rc, err, "context window", only_line=False)
    assert len(out.strip().splitlines()) == 1  # the first turn's record was still written


# --- bad sampling and decoding options -------------------------------------------------------
@pytest.mark.parametrize("opt,value,needle", [
    ("--temperature", "-1", "temperature"),
    ("--temperature", "nan", "temperature"),
    ("--temperature", "-inf", "temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-p", "1.5", "top_p"),
    ("--top-p", "nan", "top_p"),
    ("--top-p", "-0.5", "top_p"),
    ("--top-k", "-1", "top_k"),
])
def test_bad_sampling_options(capsys, opt, value, needle):
    # The model would not even load: options are checked first (cheap errors come first).
    rc, out, err = run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi", f"{opt}={value}")
    assert_error(rc, err, needle)


def test_bad_device(capsys, ckpt):
    rc, _, err = run(capsys, *gen(ckpt, "--prompt", "hi", "--device", "tpu"))
    assert_error(rc, err, "--device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys, ckpt):
    rc, _, err = run(capsys, *gen(ckpt, "--prompt", "hi", "--device", "cuda"))
    assert_error(rc, err, "CUDA")


def test_missing_draft_head(capsys, ckpt, tmp_path):
    rc, _, err = run(capsys, *gen(ckpt, "--prompt", "hi", "--method", "eagle2", "--draft", tmp_path / "nohead"))
    assert_error(rc, err, "nohead", only_line=False)


def test_no_default_draft_head(capsys, ckpt):
    rc, _, err = run(capsys, *gen(ckpt, "--prompt", "hi", "--method", "eagle"))
    assert_error(rc, err, "draft", only_line=False)


@pytest.mark.parametrize("content", ["{oops", "[[0], 1]", '{"a": 1}'])
def test_bad_tree_choices(capsys, ckpt, tmp_path, content):
    p = tmp_path / "choices.json"
    p.write_text(content)
    rc, _, err = run(capsys, *gen(ckpt, "--prompt", "hi", "--method", "eagle", "--draft", "random",
                                  "--tree-choices", p))
    assert_error(rc, err, "--tree-choices")


def test_argparse_errors_exit_2(capsys):
    rc, _, err = run(capsys, "generate", "--prompt", "hi", "--dtype", "fp8")
    assert rc == 2 and "invalid choice" in err and "Traceback" not in err
    rc, _, err = run(capsys, "generate", "--prompt", "hi", "--temperature", "warm")
    assert rc == 2 and "invalid float value" in err


def test_prompt_and_prompts_exclusive(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--model", "no-such-model")
    assert_error(rc, err, "exactly one of --prompt")
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hi"}\n')
    rc, _, err = run(capsys, "generate", "--model", "no-such-model", "--prompt", "x", "--prompts", p)
    assert_error(rc, err, "exactly one of --prompt")


# --- bad prompts files -----------------------------------------------------------------------
def test_prompts_file_missing(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--prompts", tmp_path / "none.jsonl")
    assert_error(rc, err, "--prompts", "none.jsonl", "cannot read")


def test_prompts_file_is_a_directory(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--prompts", tmp_path)
    assert_error(rc, err, "--prompts", "cannot read")


def test_prompts_file_not_utf8(capsys, tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    rc, _, err = run(capsys, "generate", "--prompts", p)
    assert_error(rc, err, "latin1.jsonl", "cannot read")


def test_prompts_bad_json_line_names_the_line(capsys, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "ok"}\n\n{"prompt": "broken"\n')
    rc, _, err = run(capsys, "generate", "--prompts", p)
    assert_error(rc, err, f"{p}:3:", "not valid JSON")


@pytest.mark.parametrize("line", ['{"prompt": 3}', '["a", "b"]', '"just text"', '{"turns": []}',
                                  '{"turns": ["a", 1]}', '{"turns": "ab"}', '{"question": "x"}', "42", "null"])
def test_prompts_wrong_shape(capsys, tmp_path, line):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "fine"}\n' + line + "\n")
    rc, _, err = run(capsys, "generate", "--prompts", p)
    assert_error(rc, err, f"{p}:2:", "expected")


def test_prompts_file_empty(capsys, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n   \n")
    rc, _, err = run(capsys, "generate", "--prompts", p)
    assert_error(rc, err, "no prompts")


# --- the same through a real process ----------------------------------------------------------
def cli_process(*argv: str, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EAGLESPEC_DEBUG"}
    env["EAGLESPEC_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "eaglespec", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_process_unknown_model(isolated_cache):
    r = cli_process("generate", "--model", "no-such-model", "--prompt", "hi", cache=isolated_cache)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(ERR) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_process_corrupt_gguf(tmp_path, isolated_cache):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    r = cli_process("generate", "--model", p, "--prompt", "hi", cache=isolated_cache)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(ERR) and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "junk.gguf" in r.stderr


# --- good input --------------------------------------------------------------------------
FIELDS = {"prompt": str, "text": str, "token_ids": list, "new_tokens": int, "wall_s": float,
          "tokens_per_s": float, "method": str, "steps": int, "tau": float, "accept_lengths": list}


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.strip().splitlines()]


def test_generate_json_fields(capsys, ckpt):
    rc, out, err = run(capsys, *gen(ckpt, "--prompt", "hello world", "--json", "--max-new-tokens", "6"))
    assert rc == 0, err
    (rec,) = records(out)
    for name, typ in FIELDS.items():
        assert isinstance(rec[name], typ), (name, rec[name])
    assert rec["method"] == "vanilla" and rec["turn"] == 0 and rec["user"] == "hello world"
    assert rec["prompt"] == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert 1 <= rec["new_tokens"] == len(rec["token_ids"]) <= 6
    assert rec["steps"] == rec["new_tokens"] - 1 == len(rec["accept_lengths"])
    assert all(a == 1 for a in rec["accept_lengths"]) and (rec["tau"] == 1.0 or rec["steps"] == 0)
    assert rec["wall_s"] > 0 and math.isclose(rec["tokens_per_s"], rec["new_tokens"] / rec["wall_s"], rel_tol=1e-6)


def test_generate_json_one_object_per_prompt(capsys, ckpt, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hello"}\n{"id": 7, "prompt": "cat dog"}\n\n{"prompt": "sun moon"}\n')
    rc, out, err = run(capsys, *gen(ckpt, "--prompts", p, "--json", "--max-new-tokens", "4"))
    assert rc == 0, err
    recs = records(out)
    assert [r["user"] for r in recs] == ["hello", "cat dog", "sun moon"]
    assert [r["question_id"] for r in recs] == [None, 7, None]


def test_mt_bench_turns(capsys, ckpt, tmp_path):
    p = tmp_path / "mt.jsonl"
    p.write_text(json.dumps({"question_id": 1, "turns": ["hello world", "why the cat"]}) + "\n")
    rc, out, err = run(capsys, *gen(ckpt, "--prompts", p, "--json", "--max-new-tokens", "6"))
    assert rc == 0, err
    first, second = records(out)
    assert (first["question_id"], first["turn"], second["question_id"], second["turn"]) == (1, 0, 1, 1)
    assert first["text"] and first["text"] in second["prompt"]
    assert second["prompt"].startswith(first["prompt"])  # turn 1 continues turn 0's conversation
    assert second["prompt"].endswith("why the cat<|im_end|>\n<|im_start|>assistant\n")


def test_streaming_prints_the_text(capsys, ckpt):
    args = gen(ckpt, "--prompt", "blue river", "--max-new-tokens", "8")
    rc, out_json, err = run(capsys, *args, "--json")
    assert rc == 0, err
    text = records(out_json)[0]["text"]
    rc, out, err = run(capsys, *args)
    assert rc == 0, err
    assert text and out == text + "\n"
    assert "tokens/s" in err


def test_stop_string(capsys, ckpt):
    args = gen(ckpt, "--prompt", "hello world", "--json", "--max-new-tokens", "8")
    rc, out, _ = run(capsys, *args)
    full = records(out)[0]
    words = full["text"].split()
    assert len(words) >= 3
    stop = words[2]
    rc, out, _ = run(capsys, *args, "--stop", stop)
    cut = records(out)[0]
    assert cut["stop_reason"] == "stop_string"
    assert cut["text"] == full["text"][: full["text"].find(stop)]
    assert cut["new_tokens"] < full["new_tokens"] or full["stop_reason"] != "max_new_tokens"


def test_seeded_sampling_is_reproducible(capsys, ckpt):
    args = gen(ckpt, "--prompt", "hello", "--json", "--max-new-tokens", "10", "--temperature", "1.5", "--seed")
    a = [records(run(capsys, *args, s)[1])[0]["token_ids"] for s in ("1", "1", "2", "3")]
    assert a[0] == a[1]
    assert a[0] != a[2] or a[0] != a[3]


def test_system_prompt(capsys, ckpt):
    rc, out, err = run(capsys, *gen(ckpt, "--prompt", "hello", "--json", "--max-new-tokens", "2",
                                    "--system", "you are a cat"))
    assert rc == 0, err
    assert records(out)[0]["prompt"].startswith("<|im_start|>system\nyou are a cat<|im_end|>\n<|im_start|>user\nhello")


def test_no_chat_uses_raw_text(capsys, ckpt):
    rc, out, err = run(capsys, *gen(ckpt, "--prompt", "the cat sat", "--json", "--no-chat", "--max-new-tokens", "3"))
    assert rc == 0, err
    assert records(out)[0]["prompt"] == "the cat sat"


def test_speculative_equals_vanilla_greedy(capsys, ckpt):
    base = gen(ckpt, "--prompt", "hello world", "--json", "--max-new-tokens", "10")
    van = records(run(capsys, *base)[1])[0]
    for method, tree in (("eagle", ()), ("eagle2", ("--total-tokens", "6"))):  # tree sizes are eagle2's only
        rc, out, err = run(capsys, *base, "--method", method, "--draft", "random", *tree)
        assert rc == 0, err
        rec = records(out)[0]
        assert rec["method"] == method and rec["token_ids"] == van["token_ids"]
