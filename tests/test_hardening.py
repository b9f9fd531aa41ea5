"""Issue 18, one test per item: bad input refused cleanly (exit 2, one stderr line, no traceback),
a chat that survives Ctrl-C and over-long messages, no leaked temp files, no unpickling of
untrusted checkpoints. Everything runs on tiny models."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eaglespec.api import EagleSpec
from eaglespec.config import SamplingConfig, TreeConfig
from eaglespec.files import FILE_MODE, atomic_write_text
from eaglespec.runtime.request import GenerationError
from eaglespec.train import loop
from eaglespec.train.features import dump_features, shard_path
from eaglespec.train.loop import SampleStore, TrainConfig, train

from test_cli import assert_error, gen, records, run
from test_train_loop import Killed, die_in_loss_call, fresh_head, make_samples, target_model

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


@pytest.fixture(autouse=True)
def _cache(isolated_cache, monkeypatch):
    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)


@pytest.fixture
def ckpt(tiny_chat_checkpoint) -> str:
    return str(tiny_chat_checkpoint)


@pytest.fixture(scope="module")
def spec(tiny_chat_checkpoint) -> EagleSpec:
    return EagleSpec.load(str(tiny_chat_checkpoint), dtype="fp32")


def process_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EAGLESPEC_DEBUG"}
    env.update(EAGLESPEC_CACHE=str(cache), PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]))
    return env


# --- 1. invalid text and unbounded reads ------------------------------------------------------
def test_1_invalid_utf8_and_unbounded_files_are_refused(capsys, tmp_path, isolated_cache, spec):
    # The shell's $'Hi \xff\xfe there' as raw argv bytes, through a real process.
    r = subprocess.run([sys.executable, "-m", "eaglespec", "generate", "--model", "no-such-model",
                        "--prompt", b"Hi \xff\xfe there"], capture_output=True, text=True,
                       env=process_env(isolated_cache), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "eaglespec: error: --prompt is not valid UTF-8 text (byte 0xff at character 3)"]
    # A prompts line with an unpaired JSON surrogate: named by its line, before the model loads.
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "fine"}\n{"prompt": "Hi \\ud800"}\n')
    rc, _, err = run(capsys, "generate", "--model", "no-such-model", "--prompts", p)
    assert_error(rc, err, f"{p}:2", "U+D800")
    # The same text through the API.
    with pytest.raises(GenerationError, match=r"U\+D800"):
        spec.generate("Hi \ud800", max_new_tokens=2)
    # Devices that never end are refused at a bound, not read into memory.
    rc, _, err = run(capsys, "generate", "--model", "no-such-model", "--prompts", "/dev/zero")
    assert_error(rc, err, "--prompts /dev/zero", "larger than the limit")
    rc, _, err = run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi", "--method", "eagle",
                     "--tree-choices", "/dev/zero")
    assert_error(rc, err, "--tree-choices /dev/zero", "larger than the limit")


# --- 2. one stop string, not its characters ---------------------------------------------------
def test_2_stop_as_a_string_is_one_stop_string(spec):
    full = spec.generate("hello world", max_new_tokens=8)
    words = full.text.split()
    assert len(words) >= 3, full.text
    # Split into characters, this would cut at the first space.
    assert spec.generate("hello world", max_new_tokens=8, stop="no such words").text == full.text
    cut = spec.generate("hello world", max_new_tokens=8, stop=words[2])
    assert cut.text == full.text[: full.text.find(words[2])] == spec.generate(
        "hello world", max_new_tokens=8, stop=[words[2]]).text
    assert cut.stop_reason == "stop_string"


# --- 3. chat: Ctrl-C mid-answer and an over-long message keep the conversation -----------------
CHAT_DRIVER = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever the parent ignores
from eaglespec import api
from eaglespec.runtime.engine import Engine

real_step = Engine.step
def slow_step(self):  # a slow model, so that Ctrl-C lands in the middle of an answer
    time.sleep(0.3)
    return real_step(self)
Engine.step = slow_step

real_init, real_encode = api.EagleSpec.__init__, api.EagleSpec.encode
def init(self, *a, **k):
    real_init(self, *a, **k)
    self.engine.eos_ids = []  # no early EOS: every answer runs to --max-new-tokens
def encode(self, prompt, chat=True, system=None):
    text, ids = real_encode(self, prompt, chat, system)
    print("PROMPT " + repr(text), file=sys.stderr, flush=True)
    return text, ids
api.EagleSpec.__init__, api.EagleSpec.encode = init, encode

from eaglespec.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Pipe:
    """Collects a stream in a thread, so the test can wait for text to appear."""

    def __init__(self, stream) -> None:
        self.text, self._stream = "", stream
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while chunk := os.read(self._stream.fileno(), 4096):
            self.text += chunk.decode(errors="replace")

    def wait_for(self, needle: str, count: int = 1, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while self.text.count(needle) < count:
            assert time.monotonic() < end, f"timed out waiting for {needle!r} x{count} in {self.text!r}"
            time.sleep(0.02)


def test_3_chat_survives_ctrl_c_and_an_over_long_message(ckpt, isolated_cache):
    proc = subprocess.Popen([sys.executable, "-c", CHAT_DRIVER, "chat", "--model", ckpt, "--dtype", "fp32",
                             "--max-new-tokens", "6"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=process_env(isolated_cache))
    out, err = Pipe(proc.stdout), Pipe(proc.stderr)

    def say(line: str) -> None:
        proc.stdin.write((line + "\n").encode())
        proc.stdin.flush()

    try:
        say("hello")
        out.wait_for("tokens/s]")  # first answer complete
        say("cat dog")
        out.wait_for("bot> ", 2)  # the second answer has started streaming: Ctrl-C now
        proc.send_signal(signal.SIGINT)
        out.wait_for("[interrupted")
        say(" ".join(["cat"] * 40))  # longer than the context window (32)
        err.wait_for("refused")
        say("sun")
        out.wait_for("tokens/s]", 2)
        say("/quit")
        assert proc.wait(timeout=60) == 0, err.text
        out.thread.join(10), err.thread.join(10)  # everything the process wrote has been read
    finally:
        proc.kill()
    assert "Traceback" not in err.text, err.text
    assert "context window" in err.text and "the conversation is kept" in err.text
    assert out.text.count("[interrupted: answer dropped]") == 1
    prompts = [ast.literal_eval(line[len("PROMPT "):]) for line in err.text.splitlines()
               if line.startswith("PROMPT ")]
    assert len(prompts) == 4, err.text  # hello, cat dog (interrupted), the long one (refused), sun
    first_answer = out.text.split("bot> ")[1].split("\n  [")[0]
    assert first_answer.strip()
    # The last turn sees the first exchange, and nothing of the interrupted or refused ones.
    assert prompts[3] == (prompts[0] + first_answer + "<|im_end|>\n"
                          "<|im_start|>user\nsun<|im_end|>\n<|im_start|>assistant\n")


# --- 4. tree sizes are bounded -----------------------------------------------------------------
@pytest.mark.parametrize("flag,value,limit", [("--total-tokens", "100000", "1024"), ("--depth", "65", "64"),
                                              ("--topk", "1000", "128"), ("--total-tokens", "0", "1024")])
def test_4_tree_size_is_bounded(capsys, flag, value, limit):
    rc, _, err = run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi", "--method", "eagle2",
                     flag, value)
    assert_error(rc, err, flag, f"between 1 and {limit}", value)
    with pytest.raises(ValueError, match="between 1 and 1024"):
        TreeConfig(total_tokens=10**7)
    with pytest.raises(ValueError, match="at most 1023 paths"):
        TreeConfig("eagle", choices=[[i] for i in range(1024)])


# --- 5. temp files of a killed conversion are cleaned up ---------------------------------------
KILLED_CONVERSION = r"""
import os, signal, sys
from pathlib import Path
import safetensors.torch as st
import torch
from eaglespec.weights import load_model

real_save = st.save_file
def save_file(tensors, filename, metadata=None):  # SIGKILL halfway through writing the converted file
    real_save(tensors, filename, metadata=metadata)
    p = Path(filename)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = save_file
load_model(sys.argv[1], torch.float32)
sys.exit(3)  # never reached
"""


def test_5_killed_conversion_leaves_no_temp_file(tmp_path, isolated_cache):
    from eaglespec.weights import load_model
    from test_weights import hf_reference, qtypes, write_gguf

    gguf = tmp_path / "m.gguf"
    write_gguf(gguf, hf_reference(seed=4), qtypes().F16)
    r = subprocess.run([sys.executable, "-c", KILLED_CONVERSION, str(gguf)], capture_output=True, text=True,
                       env=process_env(isolated_cache), timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    converted = isolated_cache / "converted"
    (left,) = converted.glob("*.tmp")  # what the kill left behind
    # The kill was a while ago (temp files younger than a minute might be a live writer's).
    old = time.time() - 120
    os.utime(left, (old, old))
    # Another process's conversion in progress: its temp file is locked, and must survive.
    live = converted / "other.safetensors.abc123.tmp"
    live.write_bytes(b"partial")
    os.utime(live, (old, old))
    with open(live, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        load_model(str(gguf), torch.float32)  # the next run
        assert sorted(p.name for p in converted.iterdir()) == sorted([live.name] + [
            p.name for p in converted.glob("*.safetensors")])
    assert not left.exists() and len(list(converted.glob("*.safetensors"))) == 1
    # A failure while writing removes its own temp file at once.
    from eaglespec.files import atomic_path

    with pytest.raises(OSError):
        with atomic_path(converted / "x.safetensors") as tmp:
            Path(tmp).write_bytes(b"half")
            raise OSError("disk full")
    assert not list(converted.glob("x.safetensors*"))


# --- 6. options that do not apply are refused ---------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["--method", "vanilla", "--tree-choices", "missing.json"], "--tree-choices"),
    (["--method", "eagle2", "--tree-choices", "missing.json"], "--tree-choices"),
    (["--method", "vanilla", "--total-tokens", "8"], "--total-tokens"),
    (["--method", "eagle", "--depth", "3", "--topk", "2"], "--depth, --topk"),
    (["--no-chat", "--system", "be brief"], "--system"),
])
def test_6_options_that_do_not_apply_are_refused(capsys, argv, needle):
    rc, _, err = run(capsys, "generate", "--model", "no-such-model", "--prompt", "hi", *argv)
    assert_error(rc, err, needle, "appl")
    if "--no-chat" not in argv:  # chat refuses --no-chat itself first
        rc, _, err = run(capsys, "chat", "--model", "no-such-model", *argv)
        assert_error(rc, err, needle)
    rc, _, err = run(capsys, "chat", "--model", "no-such-model", "--no-chat")
    assert_error(rc, err, "--no-chat does not apply to chat")


# --- 7. values: infinite temperature, huge seed, empty prompts ----------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--seed", "99999999999999999999"], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "  \t "], "--prompt is empty"),
    (["--prompt", "", "--no-chat"], "--prompt is empty"),
    (["--prompt", "   ", "--no-chat"], "--prompt is empty"),
])
def test_7_bad_values_and_empty_prompts_are_refused(capsys, argv, needle):
    if "--prompt" not in argv:
        argv = argv + ["--prompt", "hi"]
    rc, _, err = run(capsys, "generate", "--model", "no-such-model", *argv)
    assert_error(rc, err, needle)
    with pytest.raises(ValueError, match="finite"):
        SamplingConfig(temperature=float("inf"))
    with pytest.raises(ValueError, match="seed must be between 0 and"):
        SamplingConfig(temperature=1.0, seed=2**64)


# --- 8. a batch run skips the prompt that cannot run, names it, and goes on ---------------------
def test_8_batch_skips_a_prompt_that_cannot_run(capsys, ckpt, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hello world"}) + "\n"
                 + json.dumps({"prompt": " ".join(["cat"] * 40)}) + "\n\n"
                 + json.dumps({"id": 3, "prompt": "sun moon"}) + "\n")
    rc, out, err = run(capsys, *gen(ckpt, "--prompts", p, "--json", "--max-new-tokens", "4"))
    line = assert_error(rc, err, "skipped 1 of 3 prompts", f"--prompts {p}:2:", "context window", only_line=False)
    assert [r["user"] for r in records(out)] == ["hello world", "sun moon"]  # the later prompt still ran
    assert f"# skipped --prompts {p}:2: prompt of" in err and line.startswith("eaglespec: error:")


# --- 9. training inputs --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening_features")
    target = target_model()
    dump_features(target, make_samples(24, seed=1), d, 8, progress=False)
    return target, SampleStore([shard_path(d, i) for i in range(3)]), list(range(20)), list(range(20, 24))


CFG = TrainConfig(lr=3e-3, warmup_steps=2, max_steps=5, checkpoint_every=2, eval_every=0, batch_tokens=96, seed=1)


def test_9_training_inputs(capsys, tmp_path, tiny_store, monkeypatch):
    from eaglespec.cli import main

    # Data with no assistant turn: said at once, before the model loads or anything is written.
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                            for i in range(3)))
    out = tmp_path / "out"
    rc = main(["train", "--model", "no-such-model", "--data", str(data), "--out", str(out)])
    err = capsys.readouterr().err
    assert_error(rc, err, "no usable conversation", "assistant reply", "no assistant turn: 3")
    assert not out.exists()
    # --resume with no checkpoint says so; killed in step 4 after the step-2 checkpoint, the resumed
    # run logs steps 3.. once (the records after the checkpoint are dropped, then retaken).
    target, store, train_ids, val_ids = tiny_store
    real_loss = die_in_loss_call(monkeypatch, 4)
    with pytest.raises(Killed):
        train(fresh_head(target), target, store, train_ids, val_ids, tmp_path / "b", CFG, resume=True,
              progress=False)
    assert f"--resume: no checkpoint at {tmp_path / 'b' / 'checkpoint.pt'}; starting from step 0" \
        in capsys.readouterr().err
    monkeypatch.setattr(loop, "eagle_loss", real_loss)
    log = lambda: [json.loads(x)["step"] for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]  # noqa: E731
    assert log() == [1, 2, 3]
    train(fresh_head(target), target, store, train_ids, val_ids, tmp_path / "b", CFG, resume=True, progress=False)
    assert log() == [1, 2, 3, 4, 5]


# --- 10. API argument types are checked at the boundary -----------------------------------------
@pytest.mark.parametrize("kwargs,exc,needle", [
    ({"sampling": {"temperature": 0.5}}, TypeError, "sampling must be a SamplingConfig"),
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an int"),
    ({"tree": {"depth": 3}, "method": "eagle2"}, TypeError, "tree must be a TreeConfig"),
    ({"stop": 3}, TypeError, "stop must be a string or a list of strings"),
    ({"stop": ["ok", None]}, TypeError, "stop must be"),
    ({"system": 7}, TypeError, "system must be a str"),
    ({"prompt": [{"role": "user"}]}, TypeError, r"prompt\[0\]\['content'\] must be a string, got nothing"),
    ({"prompt": [{"content": "hi"}]}, ValueError, r"prompt\[0\]\['role'\]"),
    ({"prompt": ["hi"]}, TypeError, r"prompt\[0\] must be a dict"),
    ({"prompt": 42}, TypeError, "prompt must be a string or a list of messages"),
    ({"prompt": []}, ValueError, "empty"),
])
def test_10_api_argument_types_are_named(spec, kwargs, exc, needle):
    kwargs = {"prompt": "hello", "max_new_tokens": 2, **kwargs}
    with pytest.raises(exc, match=needle):
        spec.generate(kwargs.pop("prompt"), **kwargs)
    with pytest.raises(TypeError, match="seed must be an int or None, got str 'abc'"):
        SamplingConfig(temperature=1.0, seed="abc")


# --- 11. no unpickling of untrusted checkpoints; file modes; --methods ""; atomic reports --------
class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling this creates a directory: code run from a data file
        return (os.mkdir, (str(self.marker),))


def test_11_checkpoint_security_modes_and_reports(capsys, tmp_path, tiny_store, ckpt, monkeypatch):
    target, store, train_ids, val_ids = tiny_store
    written = []  # names written through atomic_write_text

    def spy(path, text):
        written.append(Path(path).name)
        atomic_write_text(path, text)

    monkeypatch.setattr(loop, "atomic_write_text", spy)
    # A real checkpoint is plain data: it loads with weights_only=True, RNG states included.
    cfg = TrainConfig(**{**CFG.__dict__, "max_steps": 2})
    train(fresh_head(target), target, store, train_ids, val_ids, tmp_path / "a", cfg, progress=False)
    assert "metrics.json" in written
    saved = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    assert saved["state"]["step"] == 2 and isinstance(saved["python_rng"]["internal"], torch.Tensor)
    # A planted pickle that would run code is refused, and its code never runs.
    marker = tmp_path / "pwned"
    out = tmp_path / "planted"
    out.mkdir()
    torch.save({"head": Planted(marker)}, out / "checkpoint.pt")
    with pytest.raises(ValueError, match="refused to resume"):
        train(fresh_head(target), target, store, train_ids, val_ids, out, cfg, resume=True, progress=False)
    assert not marker.exists()
    # Files written through a temp file get the mode a plain open() gives, like their neighbours.
    for name in ("checkpoint.pt", "metrics.json", "log.jsonl", "head/model.safetensors"):
        assert (tmp_path / "a" / name).stat().st_mode & 0o777 == FILE_MODE, name
    # `bench --methods ""` is refused.
    rc, _, err = run(capsys, "bench", "--model", "no-such-model", "--methods", "", "--out", tmp_path / "bench")
    assert_error(rc, err, "--methods is empty")
    # Reports and metrics are written atomically: a write that fails halfway keeps the old file.
    target_file = tmp_path / "results.json"
    target_file.write_text("old")
    real_write = Path.write_text

    def half_then_fail(self, text, *a, **k):
        real_write(self, text[: len(text) // 2], *a, **k)
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError):
        atomic_write_text(target_file, json.dumps({"new": list(range(100))}))
    monkeypatch.setattr(Path, "write_text", real_write)
    assert target_file.read_text() == "old" and list(tmp_path.glob("results.json*")) == [target_file]
    # ...and the bench report goes through it (as the train metrics did above).
    from eaglespec.bench import BenchConfig, report

    written.clear()
    monkeypatch.setattr(report, "atomic_write_text", spy)
    monkeypatch.setattr(report, "plot", lambda *a: [])
    monkeypatch.setattr(report, "markdown", lambda *a: "")

    class Result:
        setup, config, methods, notes, mismatches, rounding_differences, rows = {}, BenchConfig(), [], [], [], [], []

        def summary(self):
            return {}

    report.write_report(Result(), tmp_path / "rep")
    assert written == ["results.json", "report.md"]
