"""Training EAGLE-3 heads: the unrolled (TTT) loss against chains run one at a time, one optimizer
step, n-alpha against drafting, and `eaglespec train --head eagle3` end to end (resume, a head
that loads and runs lossless)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eaglespec.draft import DraftHead
from eaglespec.eagle3 import Eagle3Head, init_eagle3_head
from eaglespec.kv_cache import KVCache
from eaglespec.train.features import shard_path
from eaglespec.train.loop import SampleStore, TrainConfig, collate, evaluate, train
from eaglespec.train.loss import Batch, chain_accuracy, eagle_loss, target_vocab_weight

from test_train_loop import dumped_store, read_log, train_argv, write_chat_data
from tiny import tiny_config

LAYERS = (0, 1, 1)  # the 2-layer tiny target: default_target_layers clamps (2, 1, -1) the same way


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("e3_features")
    return (*dumped_store(d, seed=5, layers=LAYERS), d)


def fresh_e3(target, seed: int = 0, vocab: int = 40) -> Eagle3Head:
    return init_eagle3_head(tiny_config(), seed, draft_vocab=vocab, target_layers=LAYERS).to(target.device).train()


def trained_e3(target, store, tmp, steps: int = 4) -> Eagle3Head:
    head = fresh_e3(target)
    cfg = TrainConfig(lr=3e-3, warmup_steps=0, max_steps=steps, batch_tokens=10_000, eval_every=0,
                      checkpoint_every=0, ttt_steps=2)
    train(head, target, store, list(range(20)), [], tmp, cfg, progress=False)
    return head.eval()


def test_store_serves_fused_layer_inputs(setup):
    target, store, d = setup
    x = store.get(3)
    t = x.tokens.numel()
    out = target(x.tokens[None], torch.arange(t)[None], target.new_cache(t), logits_for="none", hidden_layers=LAYERS)
    want = torch.cat([out.hidden[k][0] for k in LAYERS], -1).to(torch.bfloat16)
    assert x.inputs is not None and x.inputs.shape == (t, 3 * 32)
    assert torch.equal(x.inputs, want)
    batch = collate(store, [0, 1, 2], target.device)
    assert batch.inputs.shape[:2] == batch.tokens.shape and batch.inputs.shape[-1] == 96
    with pytest.raises(ValueError, match="no hidden states of layers"):
        SampleStore([shard_path(d, 0)], (0, 1, 5))


def reference_e3_loss(head: Eagle3Head, target, batch: Batch, steps: int, decay: float) -> torch.Tensor:
    """Chains one at a time, as drafting runs them: fused real pairs 0..a into a cache, then the
    head's own output fed back with head.step; CE over its vocabulary against the target's
    distribution restricted to it; no regression term."""
    tok, feat, inp, lm = batch.tokens, batch.features.float(), batch.inputs.float(), batch.loss_mask
    b, t = tok.shape
    n = t - 1
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(steps)]
    for r in range(b):
        for a in range(n):
            cache = head.new_cache(a + steps)
            emb = target.embed(tok[r, 1:a + 2])[None].float()
            out = head(emb, inp[r, :a + 1][None], torch.arange(a + 1)[None], cache)[0, -1]
            for s in range(steps):
                p = a + s
                if p >= n:
                    break
                if s > 0:
                    e = target.embed(tok[r, p + 1:p + 2])[None].float()
                    out = head.step(e, out[None, None], torch.tensor([[p]]), cache)[0, -1]
                if bool(lm[r, a + 1:p + 2].all()):
                    rows[s].append((out, feat[r, p + 1]))
    w_t = target.lm_head.weight[head.d2t.new_tensor(range(head.draft_vocab)) + head.d2t]  # target rows, draft order
    total = torch.zeros(())
    for s, rs in enumerate(rows):
        if rs:
            h, f = torch.stack([x for x, _ in rs]), torch.stack([y for _, y in rs])
            d_logp = F.linear(head.norm(h), head.lm_head.weight).log_softmax(-1)
            total = total + decay ** s * 0.1 * -(F.linear(f, w_t).softmax(-1) * d_logp).sum(-1).mean()
    return total


@pytest.mark.parametrize("steps", [1, 3])
def test_unrolled_eagle3_loss_equals_explicit_chains(tmp_path, setup, steps):
    target, store, _ = setup
    head = trained_e3(target, store, tmp_path)
    batch = collate(store, [0, 1, 2], target.device)
    batch.loss_mask[0, 5:7] = False  # a hole mid-reply
    with torch.no_grad():
        got = eagle_loss(head, target, batch, w_cls=0.1, noise=0.0, ttt_steps=steps, decay=0.8, w_reg=1.0)
        want = reference_e3_loss(head, target, batch, steps, 0.8)
    assert float(got.reg) == 0.0  # no feature regression for EAGLE-3, whatever --w-reg says
    torch.testing.assert_close(got.total, want, rtol=1e-5, atol=1e-6)


def test_target_rows_follow_the_draft_vocabulary(setup):
    target, _, _ = setup
    head = fresh_e3(target, vocab=17)
    ids = head.to_target_ids(torch.arange(17))
    assert torch.equal(target_vocab_weight(head, target), target.lm_head.weight[ids])
    assert sorted(ids.tolist()) == ids.tolist() and len(set(ids.tolist())) == 17


def test_one_step_lowers_the_unrolled_loss(setup):
    target, store, _ = setup
    head = fresh_e3(target, seed=3)
    batch = collate(store, [3, 4, 5, 6], target.device)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    before = eagle_loss(head, target, batch, noise=0.0, ttt_steps=4).total
    before.backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        after = eagle_loss(head, target, batch, noise=0.0, ttt_steps=4).total
    assert after < before


def test_n_alpha_matches_greedy_chain_drafting(tmp_path, setup):
    """chain_accuracy's step-n hits = what a chain drafted with a KVCache proposes, one query at a
    time; its sampled acceptance sum(min(p, q_s)) the same chain's, for two draft sharpness values."""
    target, store, _ = setup
    head = trained_e3(target, store, tmp_path)
    x = store.get(7)
    scales = (1.0, 1.3)
    counts = chain_accuracy(head, target, x.tokens, x.features, x.loss_mask, 3, x.inputs, scales=scales)
    hits, totals = counts.hits, counts.totals
    t = x.tokens.numel() - 1
    t_logits = F.linear(x.features.float()[1:], target.lm_head.weight)
    want = t_logits.argmax(-1)
    draft_ids = head.to_target_ids(torch.arange(head.draft_vocab))
    ref_hits = [0, 0, 0]
    ref_sampled = [[0.0, 0.0] for _ in range(3)]
    with torch.no_grad():
        for a in range(t):
            cache = KVCache(1, head.config.num_kv_heads, head.config.head_dim, a + 4, 1, torch.float32, "cpu")
            emb = target.embed(x.tokens[1:a + 2])[None].float()
            out = head(emb, x.inputs.float()[:a + 1][None], torch.arange(a + 1)[None], cache)[0, -1]
            for s in range(3):
                p = a + s
                if p >= t:
                    break
                if s > 0:
                    e = target.embed(x.tokens[p + 1:p + 2])[None].float()
                    out = head.step(e, out[None, None], torch.tensor([[p]]), cache)[0, -1]
                logits = F.linear(head.norm(out), head.lm_head.weight)
                pred = head.to_target_ids(logits.argmax(-1))
                if bool(x.loss_mask[p + 1]) and int(pred) == int(want[p]):
                    ref_hits[s] += 1
                if bool(x.loss_mask[p + 1]):
                    p_d = t_logits[p].softmax(-1)[draft_ids]
                    for j, sc in enumerate(scales):
                        ref_sampled[s][j] += float(torch.minimum(p_d, (logits * sc).softmax(-1)).sum())
    assert hits == ref_hits and totals[0] > 0
    assert torch.allclose(torch.tensor(counts.sampled), torch.tensor(ref_sampled), rtol=1e-4)
    assert counts.sampled[0][0] != counts.sampled[0][1]  # the sharpness changes q
    assert evaluate(head, target, store, [7], steps=3)["n_alpha"][0] == hits[0] / totals[0]


def test_cli_trains_an_eagle3_head_that_runs_lossless(tmp_path, tiny_chat_checkpoint, isolated_cache, monkeypatch,
                                                       capsys):
    from eaglespec.api import EagleSpec
    from eaglespec.draft import load_head
    from eaglespec.train.cli import main

    monkeypatch.delenv("EAGLESPEC_DEBUG", raising=False)
    data = write_chat_data(tmp_path / "chat.jsonl")
    common = ("--head", "eagle3", "--draft-vocab", "30", "--ttt-steps", "3", "--warmup-steps", "100",
              "--checkpoint-every", "2")
    n = 5
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "a", *common, "--max-steps", str(n + 1))) == 0
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "b", *common, "--max-steps", str(n))) == 0
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "b", *common, "--max-steps", str(n + 1),
                           "--resume")) == 0
    for ra, rb in zip(read_log(tmp_path / "a"), read_log(tmp_path / "b")):
        assert math.isclose(ra["loss"], rb["loss"], rel_tol=1e-6, abs_tol=1e-8), (ra, rb)
    spec = EagleSpec.load(str(tiny_chat_checkpoint), dtype="fp32")
    head = load_head(tmp_path / "a" / "head", spec.target.config)
    assert isinstance(head, Eagle3Head) and head.draft_vocab == 30
    spec.set_draft(str(tmp_path / "a" / "head"))
    for prompt in ("the cat sat", "red blue green one"):
        want = spec.generate(prompt, max_new_tokens=12).token_ids
        for method in ("eagle", "eagle2"):
            assert spec.generate(prompt, method=method, max_new_tokens=12).token_ids == want
    # a rerun into a finished run's folder is refused (nothing overwritten) unless it resumes
    before = (tmp_path / "a" / "checkpoint.pt").read_bytes()
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "a", *common, "--max-steps", "1")) == 2
    assert (tmp_path / "a" / "checkpoint.pt").read_bytes() == before
    # the store made for this head also serves an EAGLE-1/2 head: reused, not redumped or refused
    e1 = tmp_path / "e1"
    assert main(train_argv(tiny_chat_checkpoint, data, e1, "--max-steps", "1",
                           "--features", str(tmp_path / "a" / "features"))) == 0
    assert "(5 already done)" in capsys.readouterr().err
    assert isinstance(load_head(e1 / "head", spec.target.config), DraftHead)
    # ... while a store without the fused layers is refused for an EAGLE-3 head
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "e2", "--max-steps", "1")) == 0
    capsys.readouterr()
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "d", *common, "--max-steps", "1",
                           "--features", str(tmp_path / "e2" / "features"))) == 2
    assert "hidden_layers" in capsys.readouterr().err
    # --init-head continues an EAGLE-3 head: with lr 0 its weights and vocabulary map stay the saved ones
    assert main(train_argv(tiny_chat_checkpoint, data, tmp_path / "c", "--head", "eagle3", "--max-steps", "1",
                           "--lr", "0", "--features", str(tmp_path / "a" / "features"),
                           "--init-head", str(tmp_path / "a" / "head"))) == 0
    got = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=True)["head"]
    ref = load_head(tmp_path / "a" / "head", spec.target.config).state_dict()
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
