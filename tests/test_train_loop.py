"""Tests for the training pipeline (eaglespec.train.features / loop / cli) on tiny models:
feature-dump resume after a SIGKILL, a training step lowering the loss, checkpoint resume giving
the uninterrupted run's losses, and a 2-process torchrun (gloo) DDP run.

Everything runs on the CPU in seconds; the data tests live in test_train_data.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglespec.draft import DraftHead, init_head_, load_head
from eaglespec.train import loop
from eaglespec.train.data import TokenizedSample
from eaglespec.train.features import dump_features, shard_path, write_manifest
from eaglespec.train.loop import SampleStore, TrainConfig, collate, make_batches, train
from eaglespec.train.loss import eagle_loss

from conftest import WORDS
from tiny import tiny_config, tiny_model

TESTS = Path(__file__).resolve().parent
MODEL_SEED = 3
SHARD = 4  # samples per shard
N_SAMPLES = 20  # -> 5 shards


def make_samples(n: int = N_SAMPLES, seed: int = 0, vocab: int = 96) -> list[TokenizedSample]:
    """Random token sequences of 6..20 tokens; loss on everything after a 3-token 'prompt'."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = rng.randint(6, 20)
        out.append(TokenizedSample([rng.randrange(vocab) for _ in range(t)], [0, 0, 0] + [1] * (t - 3)))
    return out


def target_model():
    return tiny_model(tiny_config(), seed=MODEL_SEED)


def shard_tensors(d: Path, i: int) -> dict[str, torch.Tensor]:
    return load_file(str(shard_path(d, i)))


# --- 1. feature dump: a SIGKILL between or inside shards, then a rerun ------------------------
KILLER = r"""
import json, os, signal, sys
from pathlib import Path
tests, out, samples_file, kill, threads = sys.argv[1:6]
sys.path.insert(0, tests)
import torch
torch.set_num_threads(int(threads))
import safetensors.torch as st
from eaglespec.train import features as F
from eaglespec.train.data import TokenizedSample
from tiny import tiny_config, tiny_model

samples = [TokenizedSample(**d) for d in json.loads(Path(samples_file).read_text())]
model = tiny_model(tiny_config(), seed=int(os.environ["MODEL_SEED"]))
where, n = kill.split(":")
n = int(n)
calls = [0]
if where == "forward":  # SIGKILL as the n-th sample's forward starts
    real = F.target_features
    def target_features(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    F.target_features = target_features
else:  # SIGKILL in the middle of writing the n-th shard file (half of it on disk)
    real_save = st.save_file
    def save_file(tensors, filename, metadata=None):
        calls[0] += 1
        real_save(tensors, filename, metadata=metadata)
        if calls[0] == n:
            p = Path(filename)
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    st.save_file = save_file
F.dump_features(model, samples, Path(out), int(os.environ["SHARD"]), progress=False)
sys.exit(3)  # never reached: the kill comes first
"""


@pytest.fixture(scope="module")
def reference_dump(tmp_path_factory):
    """An uninterrupted dump of the same samples with the same model."""
    d = tmp_path_factory.mktemp("ref_features")
    rep = dump_features(target_model(), make_samples(), d, SHARD, progress=False)
    assert rep.shards_total == 5 and rep.shards_written == 5 and rep.shards_skipped == 0
    return d


@pytest.mark.parametrize("kill", [
    "forward:9",  # between shards: shards 0-1 finished, shard 2 not begun
    "forward:11",  # inside shard 2, after 2 of its 4 samples
    "write:3",  # while shard 2's file is being written (a truncated temp file is left behind)
])
def test_feature_dump_resumes_after_sigkill(tmp_path, reference_dump, kill):
    samples = make_samples()
    out = tmp_path / "features"
    sfile = tmp_path / "samples.json"
    sfile.write_text(json.dumps([{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples]))
    env = {**os.environ, "MODEL_SEED": str(MODEL_SEED), "SHARD": str(SHARD)}
    r = subprocess.run([sys.executable, "-c", KILLER, str(TESTS), str(out), str(sfile), kill,
                        str(torch.get_num_threads())], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])  # really SIGKILLed
    assert [shard_path(out, i).is_file() for i in range(5)] == [True, True, False, False, False]
    if kill.startswith("write"):
        assert list(out.glob("shard_00002*.tmp")), "the kill should leave a half-written temp file"
    before = {i: (shard_path(out, i).stat().st_mtime_ns, shard_path(out, i).stat().st_ino) for i in (0, 1)}

    rep = dump_features(target_model(), samples, out, SHARD, progress=False)

    assert (rep.shards_total, rep.shards_skipped, rep.shards_written) == (5, 2, 3)
    assert rep.tokens_written == sum(len(s) for s in samples[2 * SHARD:])
    assert "(2 already done)" in rep.summary()
    after = {i: (shard_path(out, i).stat().st_mtime_ns, shard_path(out, i).stat().st_ino) for i in (0, 1)}
    assert after == before, "finished shards must not be rewritten"
    for i in range(5):
        got, want = shard_tensors(out, i), shard_tensors(reference_dump, i)
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (i, k)
    # and the store built from it serves exactly the samples that went in
    store = SampleStore([shard_path(out, i) for i in range(5)])
    assert len(store) == len(samples)
    for j in (0, 9, 19):
        x = store.get(j)
        ids, mask = x.tokens, x.loss_mask
        assert ids.tolist() == samples[j].input_ids and mask.long().tolist() == samples[j].loss_mask
    # a second rerun does nothing at all
    rep2 = dump_features(target_model(), samples, out, SHARD, progress=False)
    assert (rep2.shards_skipped, rep2.shards_written, rep2.tokens_written) == (5, 0, 0)


def test_feature_dump_grows_with_the_dataset(tmp_path, reference_dump):
    """A larger dataset reuses the shards it shares with a smaller dump, redoes the partial last
    one, and ends equal to a fresh dump; a shard holding other samples is redone."""
    out = tmp_path / "features"
    write_manifest(out, {"model": "tiny", "max_length": 20, "samples": 10})
    first = dump_features(target_model(), make_samples()[:10], out, SHARD, progress=False)
    assert (first.shards_total, first.shards_written) == (3, 3)  # 4 + 4 + 2 samples
    before = {i: shard_path(out, i).stat().st_ino for i in (0, 1)}

    write_manifest(out, {"model": "tiny", "max_length": 20, "samples": 20})  # counts may grow
    assert json.loads((out / "manifest.json").read_text())["samples"] == 20
    with pytest.raises(ValueError, match="max_length"):
        write_manifest(out, {"model": "tiny", "max_length": 64, "samples": 20})
    rep = dump_features(target_model(), make_samples(), out, SHARD, progress=False)

    assert (rep.shards_skipped, rep.shards_replaced, rep.shards_written) == (2, 1, 3)
    assert "1 redone for changed samples" in rep.summary()
    assert {i: shard_path(out, i).stat().st_ino for i in (0, 1)} == before, "shared shards must be kept"
    for i in range(5):
        got, want = shard_tensors(out, i), shard_tensors(reference_dump, i)
        assert all(torch.equal(got[k], want[k]) for k in want), i
    other = dump_features(target_model(), make_samples(seed=5), out, SHARD, progress=False)
    assert (other.shards_skipped, other.shards_replaced) == (0, 5)


# --- 2./3. the loop on a tiny target ----------------------------------------------------------
def dumped_store(d: Path, seed: int, layers: tuple[int, ...] = ()):
    """The tiny target and a store over 24 random samples dumped into d (3 shards of 8)."""
    target = target_model()
    dump_features(target, make_samples(24, seed=seed), d, 8, hidden_layers=layers, progress=False)
    return target, SampleStore([shard_path(d, i) for i in range(3)], layers)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    target, store = dumped_store(tmp_path_factory.mktemp("loop_features"), seed=1)
    return target, store, list(range(20)), list(range(20, 24))


def fresh_head(target, seed: int = 0, num_layers: int = 1) -> DraftHead:
    torch.manual_seed(seed)
    return init_head_(DraftHead(target.config, num_layers=num_layers), seed)


def clean_loss(head, target, batch) -> float:
    with torch.no_grad():
        return float(eagle_loss(head, target, batch, w_cls=0.1, noise=0.0).total)


def test_training_step_lowers_loss(tmp_path, tiny_setup):
    target, store, train_ids, _ = tiny_setup
    batch = collate(store, train_ids, target.device)  # batch_tokens below fits all of them in one batch
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, noise=0.0, batch_tokens=10_000, eval_every=0,
                      checkpoint_every=0, seed=0, autocast="off")  # its logged loss is compared with fp32's
    assert len(make_batches(store, train_ids, cfg.batch_tokens, cfg.seed, 0)) == 1

    head = fresh_head(target)
    before = clean_loss(head, target, batch)
    w0 = {k: v.clone() for k, v in head.state_dict().items()}
    state = train(head, target, store, train_ids, [], tmp_path / "one", TrainConfig(**{**cfg.__dict__, "max_steps": 1}),
                  progress=False)
    assert state.step == 1
    assert math.isclose(state.history[0]["loss"], before, rel_tol=1e-5)  # it logs the pre-step loss
    after = clean_loss(head, target, batch)
    assert after < before - 1e-4, (before, after)
    assert any(not torch.equal(w0[k], v) for k, v in head.state_dict().items())

    # a few more steps on the same batch keep lowering it
    head = fresh_head(target)
    state = train(head, target, store, train_ids, [], tmp_path / "five", TrainConfig(**{**cfg.__dict__, "max_steps": 5, "lr": 3e-3}),
                  progress=False)
    losses = [h["loss"] for h in state.history] + [clean_loss(head, target, batch)]
    assert len(losses) == 6
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.95 * losses[0], losses


def test_bf16_target_with_fp32_head_trains_and_evaluates(tmp_path, tiny_setup):
    """On a CPU with native bf16, `--dtype auto` loads the target in bf16 while the head trains in
    fp32: the loss and the n-alpha evaluation must both run across the two dtypes (regression:
    the evaluation crashed at its first call with a dtype mismatch)."""
    target, store, train_ids, val_ids = tiny_setup
    target16 = tiny_model(tiny_config(), seed=MODEL_SEED).to(torch.bfloat16)
    head = fresh_head(target16)
    assert head.fc.weight.dtype == torch.float32
    ev = loop.evaluate(head, target16, store, val_ids)
    assert len(ev["n_alpha"]) == 5 and all(0.0 <= a <= 1.0 for a in ev["n_alpha"]) and ev["val_positions"] > 0
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, batch_tokens=10_000, eval_every=1, eval_samples=len(val_ids),
                      checkpoint_every=0, seed=0, max_steps=2)
    state = train(head, target16, store, train_ids, val_ids, tmp_path / "bf16", cfg, progress=False)
    assert state.step == 2 and all(math.isfinite(h["loss"]) for h in state.history)
    assert (tmp_path / "bf16" / "head" / "model.safetensors").is_file()
    # The final evaluation picks a draft sharpness, which the saved head carries and loads with.
    saved = json.loads((tmp_path / "bf16" / "head" / "config.json").read_text())["eaglespec"]
    assert saved["draft_sharpness"] in loop.SHARPNESS_GRID
    assert len(saved["train"]["sampled_alpha"]) == 5 and len(saved["train"]["sampled_alpha_sharp"]) == 5
    assert load_head(tmp_path / "bf16" / "head", target16.config).draft_sharpness == saved["draft_sharpness"]


class Killed(Exception):
    pass


def die_in_loss_call(monkeypatch, n: int):
    """Make the n-th call of the training loss raise Killed (a kill mid-step); returns the real loss."""
    real_loss, calls = loop.eagle_loss, [0]

    def dying_loss(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            raise Killed
        return real_loss(*a, **k)

    monkeypatch.setattr(loop, "eagle_loss", dying_loss)
    return real_loss


def test_resume_matches_uninterrupted_run(tmp_path, tiny_setup, monkeypatch):
    """Kill (an exception out of the loss) in the middle of step 5; the last checkpoint is step 3;
    --resume must replay steps 4..8 exactly as the uninterrupted run took them: same batches
    (data position, across an epoch boundary), same noise (RNG state), same optimizer moments and
    learning-rate schedule."""
    target, store, train_ids, val_ids = tiny_setup
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, max_steps=8, checkpoint_every=3, eval_every=0,
                      batch_tokens=96, noise=0.1, seed=1)
    per_epoch = len(make_batches(store, train_ids, cfg.batch_tokens, cfg.seed, 0))
    assert 2 <= per_epoch < 5, per_epoch  # the resumed part crosses an epoch boundary

    straight = train(fresh_head(target), target, store, train_ids, val_ids, tmp_path / "a", cfg, progress=False)
    head_a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["head"]
    assert straight.step == 8 and straight.epoch >= 1

    real_loss = die_in_loss_call(monkeypatch, 5)
    with pytest.raises(Killed):
        train(fresh_head(target), target, store, train_ids, val_ids, tmp_path / "b", cfg, progress=False)
    monkeypatch.setattr(loop, "eagle_loss", real_loss)
    saved = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert saved["state"]["step"] == 3

    torch.manual_seed(12345)  # the process that resumes starts from other global RNG states
    random.seed(12345)
    resumed = train(fresh_head(target), target, store, train_ids, val_ids, tmp_path / "b", cfg, resume=True,
                    progress=False)
    assert resumed.step == 8
    assert [h["step"] for h in resumed.history] == list(range(1, 9))
    for want, got in zip(straight.history[3:], resumed.history[3:]):
        assert want["step"] == got["step"]
        for k in ("loss", "reg", "cls"):
            assert math.isclose(want[k], got[k], rel_tol=1e-6, abs_tol=1e-8), (want, got)
    head_b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["head"]
    for k in head_a:
        torch.testing.assert_close(head_b[k], head_a[k], rtol=1e-6, atol=1e-7)
    # the logged records of the resumed steps match too
    log_b = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_b] == list(range(1, 9))  # step 4 was logged, lost, truncated, retaken


# --- 3b. the same through the command line (`--resume`) ---------------------------------------
def write_chat_data(path: Path, n: int = 40, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
            f.write(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}) + "\n")
    return path


def train_argv(ckpt: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(ckpt), "--dtype", "fp32", "--data", str(data), "--out", str(out), "--max-length", "32",
            "--shard-size", "8", "--batch-tokens", "128", "--lr", "3e-3", "--eval-every", "0", "--no-progress",
            *extra]


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_cli_resume_next_step_loss(tmp_path, tiny_chat_checkpoint, isolated_cache, capsys, monkeypatch):
    """`eaglespec train --max-steps N+1` vs `--max-steps N` then `--resume --max-steps N+1`. The
    warm-up is longer than the run, so the learning rate does not depend on --max-steps."""
    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data = write_chat_data(tmp_path / "chat.jsonl")
    n = 6
    common = ("--warmup-steps", "100", "--checkpoint-every", "2")
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "a", *common, "--max-steps", str(n + 1))) == 0
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "b", *common, "--max-steps", str(n))) == 0
    capsys.readouterr()
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "b", *common, "--max-steps", str(n + 1),
                           "--resume")) == 0
    out, err = capsys.readouterr()
    assert f"resumed from {tmp_path / 'b' / 'checkpoint.pt'}: step {n}" in out + err
    assert "5 shards (5 already done)" in err  # the features were not recomputed

    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    assert [r["step"] for r in a] == list(range(1, n + 2))
    assert [r["step"] for r in b] == list(range(1, n + 2))
    for ra, rb in zip(a, b):
        assert math.isclose(ra["loss"], rb["loss"], rel_tol=1e-6, abs_tol=1e-8), (ra, rb)
    ha = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["head"]
    hb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["head"]
    for k in ha:
        torch.testing.assert_close(hb[k], ha[k], rtol=1e-6, atol=1e-7)
    assert (tmp_path / "b" / "head" / "model.safetensors").is_file()


# --- 4. torchrun, 2 processes, gloo ------------------------------------------------------------
@pytest.mark.parametrize("ttt", ["1", "2"])  # 2: the unrolled steps call the head around DDP's wrapper
def test_torchrun_ddp_two_ranks(tmp_path, tiny_chat_checkpoint, isolated_cache, ttt):
    data = write_chat_data(tmp_path / "chat.jsonl")
    out = tmp_path / "ddp"
    steps = 12
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(TESTS / "ddp_worker.py"),
           *train_argv(tiny_chat_checkpoint, data, out, "--warmup-steps", "2", "--checkpoint-every", "5",
                       "--max-steps", str(steps), "--ttt-steps", ttt)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EAGLESPEC_CACHE": str(isolated_cache)}
    env.pop("EAGLESPEC_DEBUG", None)
    # A hang (a collective one rank never joins) must not stall the suite: each worker ends itself
    # with SIGALRM after DDP_WORKER_ALARM seconds (the run itself takes ~15 s), and as a last
    # resort the whole process tree is killed here (torchrun puts each worker in its own session).
    env["DDP_WORKER_ALARM"] = "150"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, err = proc.communicate()
        pytest.fail(f"torchrun hung (killed after 90 s): {err[-3000:]}")
    assert proc.returncode == 0, err[-4000:]

    ranks = [torch.load(out / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
    assert [x["step"] for x in ranks] == [steps, steps]
    # each rank trained on its own share of the data
    seen = [{i for b in x["batches"] for i in b} for x in ranks]
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == steps
    assert seen[0] and seen[1] and seen[0] != seen[1]
    # the parameters are identical on both ranks, trained, and what rank 0 checkpointed
    p0, p1 = ranks[0]["params"], ranks[1]["params"]
    assert sorted(p0) == sorted(p1)
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["state"]["step"] == steps and len(saved["noise_rng"]) == 2
    for k in p0:
        assert torch.equal(saved["head"][k].cpu(), p0[k]), k
    torch.manual_seed(0)
    init = init_head_(DraftHead(target_config_of(tiny_chat_checkpoint)), 0).state_dict()
    assert any(not torch.equal(init[k], p0[k]) for k in init if k in p0)
    # the loss falls (rank 0's log)
    log = read_log(out)
    assert [rec["step"] for rec in log] == list(range(1, steps + 1))
    losses = [rec["loss"] for rec in log]
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    assert (out / "head" / "model.safetensors").is_file()


def descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc; empty elsewhere)."""
    found, stack = [], [pid]
    while stack:
        for f in Path(f"/proc/{stack.pop()}/task").glob("*/children"):
            try:
                kids = [int(x) for x in f.read_text().split()]
            except OSError:
                continue
            found += kids
            stack += kids
    return found


def target_config_of(ckpt: Path):
    from eaglespec.api import EagleSpec

    return EagleSpec.load(str(ckpt), dtype="fp32").target.config


def test_cli_init_head_starts_from_a_saved_head(tmp_path, tiny_chat_checkpoint, isolated_cache, capsys, monkeypatch):
    """`--init-head DIR` trains the saved head further: with lr 0 the run's weights are the saved
    head's exactly, and its first loss is the trained head's (below a fresh head's); a head of the
    other kind is refused with a clear error."""
    from eaglespec.draft import load_head
    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data = write_chat_data(tmp_path / "chat.jsonl")
    feats = ("--features", str(tmp_path / "features"))
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "a", *feats, "--max-steps", "12",
                           "--warmup-steps", "2", "--draft-vocab", "40")) == 0
    saved = tmp_path / "a" / "head"
    capsys.readouterr()
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "b", *feats, "--max-steps", "1", "--lr", "0",
                           "--init-head", str(saved))) == 0
    assert f"starting from {saved} (eagle head, its draft vocabulary of 40 tokens" in capsys.readouterr().err
    ref = load_head(saved, target_config_of(tiny_chat_checkpoint)).state_dict()
    got = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["head"]
    assert sorted(ref) == sorted(got)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    first_a, first_b = read_log(tmp_path / "a")[0]["loss"], read_log(tmp_path / "b")[0]["loss"]
    assert first_b < 0.9 * first_a, (first_a, first_b)

    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "c", *feats, "--max-steps", "1",
                           "--init-head", str(saved), "--head", "eagle3")) == 2
    assert "is an EAGLE-1/2 head; pass --head eagle to train it" in capsys.readouterr().err


def test_grow_head_keeps_what_the_head_computes(tiny_chat_checkpoint):
    """grow_head_ appends layers that start as identity: the grown head's output equals the
    original's exactly, its new layers are trainable and their zeroed projections get gradient."""
    from eaglespec.config import ConfigError
    from eaglespec.draft import grow_head_

    cfg = target_config_of(tiny_chat_checkpoint)
    head = init_head_(DraftHead(cfg), 3)
    g = torch.Generator().manual_seed(0)
    emb, feat = (torch.randn(2, 5, cfg.hidden_size, generator=g) for _ in range(2))
    pos = torch.arange(5).expand(2, 5)
    want = head(emb, feat, pos, None)
    grow_head_(head, 3, seed=1)
    assert head.cache_layers == 3
    got = head(emb, feat, pos, None)
    assert torch.equal(got, want)
    got.square().sum().backward()
    assert head.more[0].attn.wo.weight.grad.abs().sum() > 0 and head.more[1].mlp.w_down.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="cannot shrink a 3-layer head to 2"):
        grow_head_(head, 2)


def assert_drafts_losslessly(ckpt: Path, head_dir: Path) -> None:
    """eagle2 with the head at head_dir decodes exactly what vanilla does (fp32, greedy)."""
    from eaglespec.api import EagleSpec

    spec = EagleSpec.load(str(ckpt), dtype="fp32")
    spec.set_draft(str(head_dir))
    want = spec.generate("the cat sat", max_new_tokens=12).token_ids
    assert spec.generate("the cat sat", method="eagle2", max_new_tokens=12).token_ids == want


def test_cli_init_head_grows_layers(tmp_path, tiny_chat_checkpoint, isolated_cache, capsys, monkeypatch):
    """`--init-head DIR --head-layers 2` on a one-layer head: the run starts from the same loss as
    the head itself (the new layer is identity), saves two layers, and drafts losslessly; asking
    for fewer layers than the head has is refused."""
    from eaglespec.draft import load_head
    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data = write_chat_data(tmp_path / "chat.jsonl")
    feats = ("--features", str(tmp_path / "feats"))
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "a", *feats, "--max-steps", "6")) == 0
    saved = tmp_path / "a" / "head"
    for name, extra in (("same", ()), ("grown", ("--head-layers", "2"))):
        assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / name, *feats, "--max-steps", "3",
                               "--init-head", str(saved), *extra)) == 0
    assert "grown to 2 layers" in capsys.readouterr().err
    assert read_log(tmp_path / "grown")[0]["loss"] == pytest.approx(read_log(tmp_path / "same")[0]["loss"], rel=1e-5)
    assert load_head(tmp_path / "grown" / "head", target_config_of(tiny_chat_checkpoint)).cache_layers == 2
    assert_drafts_losslessly(tiny_chat_checkpoint, tmp_path / "grown" / "head")
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "b", *feats, "--max-steps", "1",
                           "--init-head", str(tmp_path / "grown" / "head"), "--head-layers", "1")) == 2
    assert "has 2 layers; --head-layers 1 would drop some" in capsys.readouterr().err


def test_cli_init_head_widens_the_draft_vocabulary(tmp_path, tiny_chat_checkpoint, isolated_cache, capsys,
                                                   monkeypatch):
    """`--init-head DIR --draft-vocab N` above the head's size: the weights stay the head's (lr 0),
    the vocabulary keeps every old id and adds others, and the widened head drafts losslessly;
    narrowing it is refused."""
    from eaglespec.draft import load_head
    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data = write_chat_data(tmp_path / "chat.jsonl")
    feats = ("--features", str(tmp_path / "feats"))
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "a", *feats, "--max-steps", "6",
                           "--draft-vocab", "30")) == 0
    cfg = target_config_of(tiny_chat_checkpoint)
    old = load_head(tmp_path / "a" / "head", cfg)
    capsys.readouterr()
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "w", *feats, "--max-steps", "1", "--lr", "0",
                           "--init-head", str(tmp_path / "a" / "head"), "--draft-vocab", "45")) == 0
    assert "draft vocabulary widened from 30 to" in capsys.readouterr().err
    wide = load_head(tmp_path / "w" / "head", cfg)
    assert set(old.vocab.tolist()) < set(wide.vocab.tolist()) and wide.vocab.numel() <= 46
    ref, got = old.state_dict(), wide.state_dict()
    for k in ref:
        assert k == "vocab" or torch.equal(got[k], ref[k]), k
    assert_drafts_losslessly(tiny_chat_checkpoint, tmp_path / "w" / "head")
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "n", *feats, "--max-steps", "1",
                           "--init-head", str(tmp_path / "w" / "head"), "--draft-vocab", "20")) == 2
    assert "cannot change it (it would drop tokens the head was trained on)" in capsys.readouterr().err


def test_cli_trains_a_two_layer_head(tmp_path, tiny_chat_checkpoint, isolated_cache, capsys, monkeypatch):
    """`--head-layers 2` with the training-time test: the loss falls, the saved head is two layers
    in EAGLE's layout and decodes identically to vanilla; the flag is refused for EAGLE-3."""
    from eaglespec.api import EagleSpec
    from eaglespec.draft import load_head
    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data = write_chat_data(tmp_path / "chat.jsonl")
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "a", "--head-layers", "2", "--ttt-steps", "2",
                           "--max-steps", "12", "--warmup-steps", "2")) == 0
    losses = [r["loss"] for r in read_log(tmp_path / "a")]
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses
    spec = EagleSpec.load(str(tiny_chat_checkpoint), dtype="fp32")
    assert load_head(tmp_path / "a" / "head", spec.target.config).cache_layers == 2
    spec.set_draft(str(tmp_path / "a" / "head"))
    for prompt in ("the cat sat", "red blue green one"):
        want = spec.generate(prompt, max_new_tokens=12).token_ids
        assert spec.generate(prompt, method="eagle2", max_new_tokens=12).token_ids == want
    capsys.readouterr()
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "b", "--head", "eagle3", "--head-layers", "2",
                           "--max-steps", "1")) == 2
    assert "--head-layers applies to EAGLE-1/2 heads" in capsys.readouterr().err


@pytest.mark.parametrize("native_bf16", [True, False])
def test_lm_head_products_avoid_emulated_bf16(monkeypatch, native_bf16):
    """A bf16 target's LM-head rows are multiplied in bf16 only where the CPU has bf16 products;
    elsewhere (a bf16 target running the integer kernels on an AVX2 CPU) in fp32, the same values
    to fp32 rounding (torch's emulated bf16 made a training step 11x slower there)."""
    from eaglespec import api
    from eaglespec.train.loss import _rows_linear

    monkeypatch.setattr(api, "cpu_has_native_bf16", lambda: native_bf16)
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(32, 64).to(torch.bfloat16)
    y = _rows_linear(x, w)
    assert y.shape == (5, 32) and y.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    torch.testing.assert_close(y.float(), x.to(torch.bfloat16).float() @ w.float().T if native_bf16 else x @ w.float().T,
                               rtol=2e-2 if native_bf16 else 1e-5, atol=2e-2 if native_bf16 else 1e-5)
