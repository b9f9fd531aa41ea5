"""Training-time test (TTT): the unrolled loss against chains run one at a time, its N=1 case
against the plain EAGLE-1/2 loss, one optimizer step, and --resume after a SIGKILL."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eaglespec.train.loop import SampleStore, TrainConfig, collate, train
from eaglespec.train.loss import Batch, chain_valid, eagle_loss

from test_train_loop import dumped_store, fresh_head

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ttt_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ttt_features")
    target, store = dumped_store(d, seed=2)
    return target, d, store


def odd_batch(store: SampleStore, device) -> Batch:
    """Three samples of different lengths (padding), with a hole of non-loss tokens mid-reply."""
    batch = collate(store, [0, 1, 2], device)
    mask = batch.loss_mask.clone()
    mask[0, 7:9] = False
    return replace(batch, loss_mask=mask)


def trained_head(target, store: SampleStore, tmp: Path, num_layers: int = 1):
    """A head a few steps away from its init, so its outputs are not all near zero."""
    head = fresh_head(target, num_layers=num_layers)
    cfg = TrainConfig(lr=3e-3, warmup_steps=0, max_steps=3, batch_tokens=10_000, eval_every=0, checkpoint_every=0)
    train(head, target, store, list(range(20)), [], tmp, cfg, progress=False)
    return head.eval()


def reference_loss(head, target, batch: Batch, steps: int, decay: float, w_cls: float, w_reg: float,
                   w_tv: float = 0.0, tvs: list | None = None) -> torch.Tensor:
    """The unrolled loss from chains run one at a time, as drafting runs them: real pairs 0..a
    into a KVCache, then the head fed its own output one token at a time. `tvs` collects each
    step's total variation."""
    tok, feat, lm = batch.tokens, batch.features.float(), batch.loss_mask
    b, t = tok.shape
    n = t - 1
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(steps)]  # (f^, f) per step
    for r in range(b):
        for a in range(n):  # the chain that leaves real features at pair a
            cache = head.new_cache(a + steps)
            emb = target.embed(tok[r, 1:a + 2])[None].float()  # [1, a+1, H]
            out = head(emb, feat[r, :a + 1][None], torch.arange(a + 1)[None], cache)[0, -1]
            for s in range(steps):
                p = a + s  # step s of this chain is the query at pair p
                if p >= n:
                    break
                if s > 0:
                    e = target.embed(tok[r, p + 1:p + 2])[None].float()  # [1, 1, H]
                    out = head(e, out[None, None], torch.tensor([[p]]), cache)[0, -1]
                if bool(lm[r, a + 1:p + 2].all()):  # every token the chain was fed is a reply token
                    rows[s].append((out, feat[r, p + 1]))
    w = head.lm_weight(target.lm_head.weight)
    total = torch.zeros(())
    for s, rs in enumerate(rows):
        if not rs:
            continue
        p_hat, f = torch.stack([x for x, _ in rs]), torch.stack([y for _, y in rs])
        reg = F.smooth_l1_loss(p_hat, f)
        p, q = F.linear(f, w).softmax(-1), F.linear(p_hat, w).softmax(-1)
        cls = -(p * F.linear(p_hat, w).log_softmax(-1)).sum(-1).mean()
        tv = 0.5 * (p - q).abs().sum(-1).mean()  # 1 - sum(min(p, q))
        if tvs is not None:
            tvs.append(tv)
        total = total + decay ** s * (w_reg * reg + w_cls * cls + w_tv * tv)
    return total


@pytest.mark.parametrize("steps,decay,w_reg,layers,w_tv", [(3, 0.8, 1.0, 1, 0.0), (4, 0.5, 0.0, 1, 0.0),
                                                         (3, 0.8, 1.0, 2, 0.0), (3, 0.8, 1.0, 1, 0.5)])
def test_unrolled_loss_equals_explicit_chains(tmp_path, ttt_setup, steps, decay, w_reg, layers, w_tv):
    target, _, store = ttt_setup
    head = trained_head(target, store, tmp_path, layers)
    batch = odd_batch(store, target.device)
    with torch.no_grad():
        got = eagle_loss(head, target, batch, w_cls=0.1, noise=0.0, ttt_steps=steps, decay=decay, w_reg=w_reg,
                         w_tv=w_tv)
        tvs: list = []
        want = reference_loss(head, target, batch, steps, decay, 0.1, w_reg, w_tv, tvs)
        if w_tv:  # the term is really there: the loss without it differs
            assert not torch.allclose(want, reference_loss(head, target, batch, steps, decay, 0.1, w_reg))
    assert got.per_step.shape == (steps, 4)
    torch.testing.assert_close(got.total, want, rtol=1e-5, atol=1e-6)
    # the logged TV is each step's, whether or not it is trained on
    torch.testing.assert_close(got.per_step[:, 3], torch.stack(tvs), rtol=1e-5, atol=1e-6)
    assert float(got.tv) == float(got.per_step[0, 3]) and 0.0 < float(got.tv) < 1.0


def test_chain_valid_masks_padding_holes_and_the_start():
    scored = torch.tensor([[False, True, True, False, True, True, True, False]])  # last: padding
    assert chain_valid(scored, 0).tolist() == scored.tolist()
    assert chain_valid(scored, 1).tolist() == [[False, False, True, False, False, True, True, False]]
    assert chain_valid(scored, 2).tolist() == [[False, False, False, False, False, False, True, False]]


def plain_loss(head, target, batch: Batch, w_cls: float, noise: float, generator) -> torch.Tensor:
    """The EAGLE-1/2 loss as it was written before TTT (one step), for the N=1 comparison."""
    tok, feat = batch.tokens, batch.features.float()
    b, t = tok.shape
    inp = feat[:, :-1]
    u = torch.rand(inp.shape, generator=generator)
    inp = inp + (u * 2 - 1) * noise
    with torch.no_grad():
        emb = target.embed(tok[:, 1:]).float()
    pred = head(emb, inp, torch.arange(t - 1).expand(b, -1), None)
    sel = batch.loss_mask[:, 1:]
    p_hat, f_true = pred[sel], feat[:, 1:][sel]
    reg = F.smooth_l1_loss(p_hat, f_true)
    w = head.lm_weight(target.lm_head.weight)
    pad = (0, 0, 0, (-p_hat.shape[0]) % 512)
    t_prob = F.linear(F.pad(f_true, pad), w)[: p_hat.shape[0]].softmax(-1)
    d_logp = F.linear(F.pad(p_hat, pad), w)[: p_hat.shape[0]].log_softmax(-1)
    return reg + w_cls * -(t_prob * d_logp).sum(-1).mean()


def test_one_step_is_the_plain_loss_exactly(ttt_setup):
    target, _, store = ttt_setup
    head = fresh_head(target)
    batch = odd_batch(store, target.device)
    got = eagle_loss(head, target, batch, 0.1, 0.1, torch.Generator().manual_seed(5), ttt_steps=1)
    want = plain_loss(head, target, batch, 0.1, 0.1, torch.Generator().manual_seed(5))
    # the readout loss is summed by row chunks (readout_loss), so to rounding, not bit for bit
    torch.testing.assert_close(got.total, want, rtol=1e-6, atol=0)
    # and step 0 of an unrolled loss is that same loss
    three = eagle_loss(head, target, batch, 0.1, 0.1, torch.Generator().manual_seed(5), ttt_steps=3)
    assert torch.equal(three.per_step[0, :2], got.per_step[0, :2])
    assert three.total > got.total


@pytest.mark.parametrize("w_tv", [0.0, 0.5])
def test_optimizer_step_lowers_the_unrolled_loss(tmp_path, ttt_setup, w_tv):
    target, _, store = ttt_setup
    ids = list(range(20))
    batch = collate(store, ids, target.device)
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, noise=0.0, batch_tokens=10_000, eval_every=0, checkpoint_every=0,
                      max_steps=1, ttt_steps=3, autocast="off", w_tv=w_tv)  # its logged loss is compared with fp32's
    head = fresh_head(target)

    def loss() -> float:
        with torch.no_grad():
            return float(eagle_loss(head, target, batch, noise=0.0, ttt_steps=3, w_tv=w_tv).total)

    before = loss()
    state = train(head, target, store, ids, [], tmp_path / "one", cfg, progress=False)
    assert math.isclose(state.history[0]["loss"], before, rel_tol=1e-5)
    assert loss() < before - 1e-4


def test_ttt_steps_below_one_is_refused(tmp_path, ttt_setup):
    target, _, store = ttt_setup
    with pytest.raises(ValueError, match="--ttt-steps must be >= 1"):
        train(fresh_head(target), target, store, list(range(20)), [], tmp_path, TrainConfig(ttt_steps=0), progress=False)


# --- --resume after a SIGKILL mid-step, with --ttt-steps 3 -----------------------------------
KILLER = r"""
import json, os, signal, sys
from pathlib import Path
tests, feat_dir, out, cfg_json, threads = sys.argv[1:6]
sys.path.insert(0, tests)
import torch
torch.set_num_threads(int(threads))
from eaglespec.train import loop
from test_train_loop import fresh_head, target_model

cfg = json.loads(cfg_json)
cfg["betas"] = tuple(cfg["betas"])
store = loop.SampleStore(sorted(Path(feat_dir).glob("shard_*.safetensors")))
real, calls = loop.eagle_loss, [0]
def dying_loss(*a, **k):  # SIGKILL as the 5th step's loss starts (the last checkpoint: step 3)
    calls[0] += 1
    if calls[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
loop.eagle_loss = dying_loss
target = target_model()
loop.train(fresh_head(target), target, store, list(range(20)), list(range(20, 24)), Path(out), loop.TrainConfig(**cfg),
           progress=False)
sys.exit(3)  # never reached
"""


def test_resume_after_sigkill_with_ttt(tmp_path, ttt_setup):
    target, feat_dir, store = ttt_setup
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, max_steps=7, checkpoint_every=3, eval_every=0, batch_tokens=96,
                      noise=0.1, seed=1, ttt_steps=3)
    straight = train(fresh_head(target), target, store, list(range(20)), list(range(20, 24)), tmp_path / "a", cfg,
                     progress=False)
    r = subprocess.run([sys.executable, "-c", KILLER, str(TESTS), str(feat_dir), str(tmp_path / "b"),
                        json.dumps(asdict(cfg)), str(torch.get_num_threads())],
                       env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])  # really SIGKILLed
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["state"]["step"] == 3
    logged = [json.loads(x)["step"] for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4]  # step 4 was taken, then lost with the kill

    resumed = train(fresh_head(target), target, store, list(range(20)), list(range(20, 24)), tmp_path / "b", cfg,
                    resume=True, progress=False)
    assert resumed.step == 7
    for want, got in zip(straight.history[3:], resumed.history[3:]):
        assert want["step"] == got["step"]
        assert math.isclose(want["loss"], got["loss"], rel_tol=1e-6, abs_tol=1e-8), (want, got)
    ha = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["head"]
    hb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["head"]
    for k in ha:
        torch.testing.assert_close(hb[k], ha[k], rtol=1e-6, atol=1e-7)
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(1, 8)) and all(len(x["step_cls"]) == 3 for x in log)
    assert all(len(x["step_tv"]) == 3 and round(x["tv"], 4) == x["step_tv"][0] for x in log)
