"""Self-distilled data (`eaglespec regenerate`, train --regenerate): answers are the target's own,
independent of batching, deterministic with a seed, resumable after a kill, bad input refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eaglespec.api import EagleSpec
from eaglespec.train.data import Conversation, DataError, load_conversations
from eaglespec.train.regenerate import RegenConfig, load_regenerated, regenerate

WORDS = "hello world the cat dog sat on mat red blue green one two three sun moon star tree river".split()


def conversations(n: int, turns: int = 2) -> list[Conversation]:
    out = []
    for i in range(n):
        msgs = []
        for t in range(turns):
            msgs.append({"role": "user", "content": " ".join(WORDS[(i * 3 + t * 5 + j) % len(WORDS)] for j in range(3 + i % 4))})
            msgs.append({"role": "assistant", "content": "the original answer " + WORDS[i % len(WORDS)]})
        out.append(Conversation(messages=msgs, id=f"c{i}"))
    return out


@pytest.fixture(scope="module")
def spec(tiny_chat_checkpoint_256):
    return EagleSpec.load(str(tiny_chat_checkpoint_256), dtype="fp32")


def records(path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_answers_are_the_targets_own_turn_by_turn(spec, tmp_path):
    convs = conversations(4)
    out = tmp_path / "r.jsonl"
    rep = regenerate(spec, convs, out, RegenConfig(max_new_tokens=12, max_length=200, batch=3), progress=False)
    assert rep.conversations == 4 and rep.answers == 8 and rep.tokens > 0
    recs = records(out)
    for c in convs:
        msgs = recs[c.id]["messages"]
        assert [m["role"] for m in msgs] == [m["role"] for m in c.messages]
        assert msgs[0] == c.messages[0] and msgs[2] == c.messages[2]  # user turns kept
        # each answer is what plain greedy decoding gives for the regenerated history before it
        for k in (1, 3):
            want = spec.generate(msgs[:k], max_new_tokens=12).text
            assert msgs[k]["content"] == want
            assert "original" not in want
    # The file is a dataset `train --data` reads back.
    back = load_conversations(out)
    assert {c.id for c in back.conversations} == {c.id for c in convs}
    assert [c.id for c in load_regenerated(out, convs)] == [c.id for c in convs]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_output_does_not_depend_on_batching(spec, tmp_path, temperature):
    convs = conversations(7)
    files = []
    for batch in (1, 5):
        out = tmp_path / f"b{batch}.jsonl"
        regenerate(spec, convs, out, RegenConfig(max_new_tokens=10, max_length=200, temperature=temperature,
                                                 seed=3, batch=batch), progress=False)
        files.append(records(out))
    assert files[0] == files[1]


def test_seed_decides_sampled_answers(spec, tmp_path):
    convs = conversations(6)
    got = []
    for seed in (1, 1, 2):
        out = tmp_path / f"s{len(got)}.jsonl"
        regenerate(spec, convs, out, RegenConfig(max_new_tokens=10, max_length=200, temperature=1.0, seed=seed),
                   progress=False)
        got.append({k: r["messages"] for k, r in records(out).items()})
    assert got[0] == got[1]
    assert got[0] != got[2]
    # A sampled answer is a real draw: with this seed it is not the greedy answer everywhere.
    greedy = [spec.generate(c.messages[:1], max_new_tokens=10).text for c in convs]
    assert [got[0][c.id][1]["content"] for c in convs] != greedy


def test_resume_after_a_cut_line_equals_one_run(spec, tmp_path):
    convs = conversations(6)
    cfg = RegenConfig(max_new_tokens=10, max_length=200, batch=2)
    whole = tmp_path / "whole.jsonl"
    regenerate(spec, convs, whole, cfg, progress=False)
    part = tmp_path / "part.jsonl"
    regenerate(spec, convs[:3], part, cfg, progress=False)
    with open(part, "a") as f:  # what a kill in the middle of a write leaves
        f.write('{"id": "c4", "messages": [{"role": "us')
    rep = regenerate(spec, convs, part, cfg, progress=False)
    assert rep.resumed == 3 and rep.conversations == 6
    lines = part.read_text().splitlines()
    assert len(lines) == 6 and records(part) == records(whole)


def test_a_record_holding_a_unicode_line_separator_resumes(spec, tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028 raw in a record (ShareGPT has some): a rerun
    must still read that record as done, not drop it as a cut line and answer it again."""
    convs = conversations(3)
    convs[1].messages[0]["content"] += " one line\u2028and the next"
    cfg = RegenConfig(max_new_tokens=6, max_length=200, batch=2)
    out = tmp_path / "out.jsonl"
    regenerate(spec, convs, out, cfg, progress=False)
    before = out.read_bytes()
    assert "\u2028".encode() in before
    rep = regenerate(spec, convs, out, cfg, progress=False)
    assert rep.resumed == 3 and rep.answers == 0
    assert out.read_bytes() == before


def test_sigkill_mid_run_then_rerun(tiny_chat_checkpoint_256, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in conversations(60, 3)))
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "eaglespec", "regenerate", "--model", str(tiny_chat_checkpoint_256), "--dtype",
            "fp32", "--data", str(data), "--out", str(out), "--max-new-tokens", "24", "--max-length", "240",
            "--batch", "2", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.is_file() and len(out.read_bytes().splitlines()) >= 3:
            break
        time.sleep(0.02)
    killed = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(out.read_text().splitlines()) if out.is_file() else 0
    assert subprocess.run(argv, env=env, capture_output=True).returncode == 0
    ref = tmp_path / "ref.jsonl"
    assert subprocess.run(argv[:argv.index("--out") + 1] + [str(ref)] + argv[argv.index("--out") + 2:], env=env,
                          capture_output=True).returncode == 0
    assert records(out) == records(ref) and len(out.read_text().splitlines()) == 60
    if killed:  # the kill landed mid-run: the rerun kept what was written
        assert 3 <= before < 60


def test_bad_input_is_refused(spec, tmp_path, tiny_chat_checkpoint_256):
    for bad in ({"batch": 0}, {"max_new_tokens": -1}, {"temperature": -0.5}, {"top_p": 0.0}):
        with pytest.raises(DataError):
            RegenConfig(**bad)
    out = tmp_path / "r.jsonl"
    regenerate(spec, conversations(2), out, RegenConfig(max_new_tokens=5, max_length=200), progress=False)
    with pytest.raises(DataError, match="other settings.*max_new_tokens"):
        regenerate(spec, conversations(2), out, RegenConfig(max_new_tokens=6, max_length=200), progress=False)
    alien = tmp_path / "alien.jsonl"
    alien.write_text('{"id": "x", "messages": []}\n')
    with pytest.raises(DataError, match="not a file `regenerate` wrote"):
        regenerate(spec, conversations(2), alien, RegenConfig(max_new_tokens=5, max_length=200), progress=False)
    # A conversation whose first prompt does not fit max_length is dropped, not answered.
    long = Conversation(messages=[{"role": "user", "content": " ".join(WORDS * 3)},
                                  {"role": "assistant", "content": "x"}], id="long")
    rep = regenerate(spec, [long], tmp_path / "long.jsonl", RegenConfig(max_new_tokens=5, max_length=20),
                     progress=False)
    assert rep.dropped == 1 and rep.conversations == 0
    # The command line says what is wrong and exits 2.
    from eaglespec.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": conversations(1)[0].messages}) + "\n")
    argv = ["regenerate", "--model", str(tiny_chat_checkpoint_256), "--data", str(data), "--out", str(tmp_path / "o")]
    assert main(argv + ["--skip", "5"]) == 2
    assert main(argv + ["--batch", "0"]) == 2


def test_train_regenerate_trains_on_the_rewritten_answers(tmp_path, tiny_chat_checkpoint, isolated_cache, monkeypatch):
    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages[:2]}) + "\n" for c in conversations(12)))
    out = tmp_path / "run"
    argv = ["--model", str(tiny_chat_checkpoint), "--dtype", "fp32", "--data", str(data), "--out", str(out),
            "--max-length", "32", "--shard-size", "4", "--batch-tokens", "128", "--max-steps", "2", "--eval-every",
            "0", "--no-progress", "--regenerate", "--regenerate-max-tokens", "6", "--regenerate-batch", "4"]
    assert main(argv) == 0
    recs = records(out / "regenerated.jsonl")
    assert len(recs) == 12 and all("original" not in r["messages"][1]["content"] for r in recs.values())
    assert json.loads((out / "features" / "manifest.json").read_text())["regenerate"] is True


def test_draft_vocab_counts_an_extra_dataset(tmp_path, tiny_chat_checkpoint, isolated_cache, monkeypatch):
    """--draft-vocab-data: a narrower training set (regenerated answers) takes its draft vocabulary
    from more text; a missing file is refused."""
    from safetensors.torch import load_file

    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data, extra = tmp_path / "d.jsonl", tmp_path / "extra.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hello"},
                                                     {"role": "assistant", "content": "the cat sat on mat"}]}) + "\n"
                            for _ in range(8)))
    extra.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"},
                                              {"role": "assistant", "content": " ".join(["river"] * 20)}]}) + "\n")
    base = ["--model", str(tiny_chat_checkpoint), "--dtype", "fp32", "--data", str(data), "--max-length", "32",
            "--shard-size", "4", "--batch-tokens", "128", "--max-steps", "1", "--eval-every", "0", "--no-progress",
            "--draft-vocab", "4", "--val-fraction", "0"]
    vocab = {}
    for name, more in (("plain", []), ("extra", ["--draft-vocab-data", str(extra)])):
        assert main(base + ["--out", str(tmp_path / name)] + more) == 0
        vocab[name] = load_file(str(tmp_path / name / "head" / "draft_vocab.safetensors"))["token_ids"].tolist()
    spec = EagleSpec.load(str(tiny_chat_checkpoint), dtype="fp32")
    river = spec.tokenizer.encode("river")[0]
    assert river in vocab["extra"] and river not in vocab["plain"]
    assert main(base + ["--out", str(tmp_path / "bad"), "--draft-vocab-data", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.parametrize("native_bf16, device, want", [(True, "cpu", "none"), (False, "cpu", "auto"),
                                                       (False, "cuda", "none")])
def test_batched_commands_default_to_the_fastest_weights_here(monkeypatch, tmp_path, native_bf16, device, want):
    """regenerate and train leave --quant to the machine: float weights where bf16 products are
    native (or on CUDA), else the GGUF's integer blocks on the package's kernels; a named mode is
    kept."""
    from eaglespec import api
    from eaglespec.cli import build_parser
    from eaglespec.train import cli

    monkeypatch.setattr(api, "cpu_has_native_bf16", lambda: native_bf16)
    assert api.batched_quant_default(device) == want
    if device != "cpu":
        return
    asked = []

    def load(*a, quant=None, **k):
        asked.append(quant)
        raise SystemExit(0)  # stop before any work: only the mode asked for matters here

    monkeypatch.setattr(api.EagleSpec, "load", staticmethod(load))
    monkeypatch.setattr(cli, "usable_conversations", lambda args, rank: [])
    for command in (["regenerate", "--out", str(tmp_path / "o.jsonl")], ["train", "--out", str(tmp_path / "t")]):
        for extra, expect in (([], want), (["--quant", "int8"], "int8")):
            args = build_parser().parse_args(command + extra)
            with pytest.raises(SystemExit):
                args.func(args)
            assert asked.pop() == expect
