"""EAGLE-3 draft heads: the released checkpoint layout (written by hand here, with a reduced draft
vocabulary and its d2t/t2d maps), the head's math against a from-scratch reference over those
tensors, the batched Proposer against the reference Drafter, losslessness through the engine
(greedy token-identical to vanilla; sampling by chi-square), drafts really used (tau > 1 with the
oracle drafts of spec_helpers), the fused target features the engine commits, refused heads, and
the API / CLI path (`--draft PATH`, `random3`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from eaglespec.config import ConfigError, ModelConfig, SamplingConfig, TreeConfig
from eaglespec.draft import Drafter, init_random_head, load_head, save_head
from eaglespec.eagle3 import Eagle3Head, default_target_layers
from eaglespec.kv_cache import RowKVCache
from eaglespec.runtime.engine import Engine, Request
from eaglespec.spec.sampling import RowSampling
from eaglespec.spec.propose import Proposer

from spec_helpers import (OracleProposer, RecordingEngine, SyncCounter, TrackingProposer, chi_square_pvalue,
                          engine_tokens, exact_sequence_probs, run_generate, single_thread)
from test_draft_head import write_released as write_head
from tiny import tiny_config, tiny_model

LAYERS = (1, 2, 3)  # low, mid, high of a 4-layer target
ALLOWED = [0, 3, 5, 8, 13, 21, 34, 40, 41, 55, 60, 77, 88, 89, 95]  # the draft vocabulary (target ids)
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [70], [12, 2, 33, 4], [1, 94, 50, 50, 8, 23, 77, 31, 6, 40, 11]]
TREES = {"eagle": TreeConfig("eagle", choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]),
         "eagle2": TreeConfig("eagle2", total_tokens=12, depth=4, top_k=5)}
P_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
EAGLE3_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {"midlayer." + k for k in P_KEYS}


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(vocab=96, layers=4, max_pos=256), seed=5)


def released_tensors(cfg: ModelConfig, allowed: list[int], seed: int = 0, scale: float = 0.4,
                     prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """An EAGLE-3 head in the released names: every weight random (norm weights near 1), lm_head
    over len(allowed) draft tokens, d2t = allowed[i] - i, t2d = mask of allowed."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vd = cfg.hidden_size, cfg.intermediate_size, len(allowed)
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"fc.weight": (h, 3 * h), "self_attn.q_proj.weight": (nq, 2 * h), "self_attn.k_proj.weight": (nkv, 2 * h),
              "self_attn.v_proj.weight": (nkv, 2 * h), "self_attn.o_proj.weight": (h, nq),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
              "lm_head.weight": (vd, h)}
    sd = {}
    for k, shape in shapes.items():
        name = k if k in ("fc.weight", "lm_head.weight") else prefix + k
        sd[name] = torch.randn(shape, generator=g) * scale / shape[1] ** 0.5 * 2
    for k in ("hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
        sd[prefix + k] = 1.0 + 0.1 * torch.randn(h, generator=g)
    sd["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    ids = torch.tensor(sorted(allowed))
    sd["d2t"] = ids - torch.arange(vd)
    sd["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    sd["t2d"][ids] = True
    return sd


def released_config(cfg: ModelConfig, draft_vocab: int, layers=LAYERS) -> dict:
    """config.json as EAGLE-3 heads ship it: a one-layer Llama config, draft_vocab_size, and the
    target layer ids in vLLM's eagle_config field (no eaglespec block)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "num_hidden_layers": 1,
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": None, "tie_word_embeddings": False,
            "vocab_size": cfg.vocab_size, "draft_vocab_size": draft_vocab, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers), "use_aux_hidden_state": True}}


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target):
    cfg = target.config
    return write_head(tmp_path_factory.mktemp("eagle3"), released_config(cfg, len(ALLOWED)),
                      released_tensors(cfg, ALLOWED))


@pytest.fixture(scope="module")
def head(head_dir, target) -> Eagle3Head:
    return load_head(head_dir, target.config)


# --- the head's math, from the released tensors --------------------------------------------------
def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [nh, T, hd] rotated at positions pos [T] (Hugging Face's rotate-half layout)."""
    hd = x.shape[-1]
    freqs = pos.double()[:, None] / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = torch.cat((freqs, freqs), -1).cos().float(), torch.cat((freqs, freqs), -1).sin().float()
    return x * cos + torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), -1) * sin


def reference_eagle3(sd: dict, cfg: ModelConfig, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's midlayer over T causal pairs at positions 0..T-1, written from its public
    description: embeds, hidden [T, H] -> output [T, H] (pre-norm)."""
    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    p, t, hd = "midlayer.", embeds.shape[0], cfg.head_dim
    x = torch.cat((rms(embeds, sd[p + "input_layernorm.weight"]), rms(hidden, sd[p + "hidden_norm.weight"])), -1)
    q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(t, cfg.num_heads, hd).transpose(0, 1)
    k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(t, cfg.num_kv_heads, hd).transpose(0, 1)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(t, cfg.num_kv_heads, hd).transpose(0, 1)
    pos = torch.arange(t)
    q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1) @ sd[p + "self_attn.o_proj.weight"].T
    h = hidden + attn
    m = rms(h, sd[p + "post_attention_layernorm.weight"])
    mlp = (F.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T))
    return h + mlp @ sd[p + "mlp.down_proj.weight"].T


def test_head_math_matches_reference(head_dir, head, target):
    """Committed pairs: fc over the three target layers, midlayer, norm, own LM head, d2t."""
    sd = released_tensors(target.config, ALLOWED)
    cfg = target.config
    tokens = torch.tensor([PROMPTS[3]])
    with torch.inference_mode():
        out = target(tokens, torch.arange(tokens.shape[1])[None], target.new_cache(tokens.shape[1]),
                     hidden_layers=LAYERS)
        feats = head.target_features(out)  # [1, T, 3H]
        assert feats.shape == (1, tokens.shape[1], 3 * cfg.hidden_size)
        torch.testing.assert_close(feats[0, :, : cfg.hidden_size], out.hidden[1][0])
        torch.testing.assert_close(feats[0, :, -cfg.hidden_size:], out.hidden[3][0])
        embeds = target.embed(tokens)
        ours = head(embeds, feats, torch.arange(tokens.shape[1])[None], head.new_cache(16))[0]
        fused = feats[0] @ sd["fc.weight"].T
        ref = reference_eagle3(sd, cfg, embeds[0], fused)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
        # Depth >= 1 feeds the head's own output back, not through fc.
        nxt = head.step(embeds[:, :3], ours[None, :3], torch.arange(3)[None], head.new_cache(8))[0]
        torch.testing.assert_close(nxt, reference_eagle3(sd, cfg, embeds[0, :3], ours[:3]), rtol=1e-4, atol=1e-5)
        rms = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * sd["norm.weight"]
        draft_ids = (rms @ sd["lm_head.weight"].T).argmax(-1)
        ours_ids = head.to_target_ids(F.linear(head.readout(ours), head.lm_weight(target.lm_head.weight)).argmax(-1))
    assert ours_ids.tolist() == (draft_ids + sd["d2t"][draft_ids]).tolist()
    assert set(ours_ids.tolist()) <= set(ALLOWED)


# --- checkpoints -------------------------------------------------------------------------------------
def proposals(head, target, method: str) -> list[list[int]]:
    """Tree tokens the batched Proposer drafts for PROMPTS after their prefill (fresh caches)."""
    layers = head.target_layers
    prop = Proposer(head, target, TREES[method])
    c = head.config
    cache = RowKVCache(1, c.num_kv_heads, c.head_dim, 64, len(PROMPTS))
    t = max(map(len, PROMPTS))
    tok = torch.zeros(len(PROMPTS), t, dtype=torch.long)
    feat = torch.zeros(len(PROMPTS), t, 3 * c.hidden_size)
    roots = []
    with torch.inference_mode():
        for r, p in enumerate(PROMPTS):
            out = target(torch.tensor([p]), torch.arange(len(p))[None], target.new_cache(len(p)), hidden_layers=layers)
            roots.append(int(out.logits[0, -1].argmax()))
            tok[r, : len(p)] = torch.tensor(p[1:] + [roots[-1]])
            feat[r, : len(p)] = head.target_features(out)[0]
        count = torch.tensor([len(p) for p in PROMPTS])
        root_hidden = prop.commit(cache, torch.zeros_like(count), tok, feat, count, t)
        tree = prop.propose(cache, torch.tensor(roots), root_hidden, torch.full_like(count, 64), t + prop.scratch)
    return tree.tokens.tolist()


def test_round_trip_released_layout(tmp_path, head, target):
    save_head(head, tmp_path / "h")
    with safe_open(str(tmp_path / "h" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == EAGLE3_KEYS
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    conf = json.loads((tmp_path / "h" / "config.json").read_text())
    assert conf["num_hidden_layers"] == 1 and conf["draft_vocab_size"] == len(ALLOWED)
    assert conf["eaglespec"]["target_layers"] == list(LAYERS) and "target_hidden_size" not in conf
    back = load_head(tmp_path / "h", target.config)
    assert isinstance(back, Eagle3Head) and back.target_layers == LAYERS
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for method in TREES:
        assert proposals(back, target, method) == proposals(head, target, method)


def test_vllm_spelling_and_pytorch_bin_load(tmp_path, head, target):
    """`layers.0.` instead of `midlayer.` (vLLM / SGLang) and a pytorch_model.bin load the same head."""
    cfg = target.config
    conf = released_config(cfg, len(ALLOWED))
    for name, tensors, fmt in (("vllm", released_tensors(cfg, ALLOWED, prefix="layers.0."), "safetensors"),
                               ("bin", released_tensors(cfg, ALLOWED), "bin")):
        other = load_head(write_head(tmp_path / name, conf, tensors, fmt), cfg)
        a, b = head.state_dict(), other.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_target_layers_default_and_dtype(tmp_path, target):
    """No layer ids in config.json: EAGLE-3's (2, L//2, L-3); a bf16 load keeps d2t/t2d integral."""
    cfg = target.config
    conf = released_config(cfg, len(ALLOWED))
    del conf["eagle_config"]
    h = load_head(write_head(tmp_path / "h", conf, released_tensors(cfg, ALLOWED)), cfg, dtype=torch.bfloat16)
    assert h.target_layers == default_target_layers(4) == (2, 2, 1)
    assert default_target_layers(32) == (2, 16, 29)
    assert h.fc.weight.dtype == torch.bfloat16 and h.d2t.dtype == torch.long and h.t2d.dtype == torch.bool


# --- refusals ----------------------------------------------------------------------------------------
def _break(cfg, how: str) -> tuple[dict, dict]:
    conf, sd = released_config(cfg, len(ALLOWED)), released_tensors(cfg, ALLOWED)
    if how == "hidden":
        wide = dataclasses.replace(cfg, hidden_size=48, head_dim=0)
        conf, sd = released_config(wide, len(ALLOWED)), released_tensors(wide, ALLOWED)
    elif how == "vocab":  # a head for an 80-token target
        small = dataclasses.replace(cfg, vocab_size=80)
        conf, sd = released_config(small, len(ALLOWED)), released_tensors(small, [i for i in ALLOWED if i < 80]
                                                                           + [78, 79])
    elif how == "t2d_length":
        sd["t2d"] = sd["t2d"][:90].clone()
    elif how == "d2t_range":
        sd["d2t"][-1] += 5  # 95 + 5 = 100 >= 96
    elif how == "d2t_length":
        sd["d2t"] = sd["d2t"][:-1].clone()
    elif how == "d2t_duplicate":
        sd["d2t"][1] -= 3  # draft id 1 -> target 0, as draft id 0
    elif how == "t2d_mismatch":
        sd["t2d"][1] = True
    elif how == "missing":
        del sd["midlayer.hidden_norm.weight"]
    elif how == "shape":
        sd["fc.weight"] = sd["fc.weight"][:, : 2 * cfg.hidden_size].contiguous()  # 2H -> H: an EAGLE-1/2 fc
    elif how == "layers":
        conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]
    elif how == "target_hidden":
        conf["target_hidden_size"] = 64
    return conf, sd


REFUSED = [("hidden", "hidden_size 48 != target's 32"), ("vocab", "vocab_size 80 != target's 96"),
           ("t2d_length", "t2d length"), ("d2t_range", "outside \\[0, 96\\)"), ("d2t_length", "d2t has 14 entries"),
           ("d2t_duplicate", "same target id"), ("t2d_mismatch", "t2d does not mark"),
           ("missing", "missing tensor 'midlayer.hidden_norm.weight'"), ("shape", "shapes"),
           ("layers", "target layers \\[1, 2, 4\\]"), ("target_hidden", "target_hidden_size 64 != target's 32")]


@pytest.mark.parametrize("how, needle", REFUSED, ids=[r[0] for r in REFUSED])
def test_refuses_heads_that_do_not_fit(tmp_path, target, how, needle):
    conf, sd = _break(target.config, how)
    path = write_head(tmp_path / how, conf, sd)
    with pytest.raises(ConfigError, match=needle) as err:
        load_head(path, target.config)
    assert "EAGLE-3 draft head" in str(err.value)


def test_the_unbroken_head_loads(tmp_path, target):
    """The refusal cases above each break one thing of this head, which loads."""
    conf, sd = _break(target.config, "none")
    assert isinstance(load_head(write_head(tmp_path / "ok", conf, sd), target.config), Eagle3Head)


# --- drafting and losslessness --------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_proposer_matches_drafter(head, target, method):
    """The batched Proposer drafts, row by row, the trees of the reference Drafter (generate.py's)."""
    got = proposals(head, target, method)
    with torch.inference_mode():
        for r, p in enumerate(PROMPTS):
            out = target(torch.tensor([p]), torch.arange(len(p))[None], target.new_cache(len(p)),
                         hidden_layers=LAYERS)
            root = int(out.logits[0, -1].argmax())
            dr = Drafter(head, target)
            dr.reset(64)
            state = dr.extend(torch.tensor(p[1:] + [root]), head.target_features(out)[0])
            ref = dr.draft(root, state, TREES[method], 1000)
            assert got[r][: ref.size] == ref.tokens.tolist(), r
            assert set(got[r][1:]) <= set(ALLOWED)


class CheckedProposer(TrackingProposer):
    """TrackingProposer that checks, at every propose, each live row's root_hidden against a fresh
    recomputation: the target over the row's context (hidden states of the head's layers), then the
    head over all pairs (x[t+1], fused layers[t]). A step that committed the wrong features (the
    final normed ones, other layers, unfused) fails here even though its output stays lossless."""

    checked = 0

    def propose(self, cache, root_token, root_hidden, room, view_len, sampling=None, step=None):
        row0 = self._first_row(cache)
        for b in range(root_token.shape[0]):
            ctx = self.contexts.get(row0 + b)
            if ctx is None or len(ctx) < 2:
                continue
            n = len(ctx) - 1
            out = self.target(torch.tensor([ctx[:-1]]), torch.arange(n)[None], self.target.new_cache(n),
                              hidden_layers=self.head.target_layers)
            ref = self.head(self.target.embed(torch.tensor([ctx[1:]])), self.head.target_features(out),
                            torch.arange(n)[None], self.head.new_cache(n))[0, -1]
            torch.testing.assert_close(root_hidden[b], ref, rtol=1e-4, atol=1e-4)
            CheckedProposer.checked += 1
        return super().propose(cache, root_token, root_hidden, room, view_len, sampling, step)


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_greedy_lossless_through_the_engine(head, target, method):
    """fp32 greedy, four rows of different lengths in one batch: token-identical to vanilla (and to
    the reference loop with the same head); drafts confined to the draft vocabulary; the committed
    features are the fused target layers."""
    budgets = [40, 33, 25, 40]
    with single_thread():
        refs = [run_generate(target, p, max_new_tokens=m).tokens for p, m in zip(PROMPTS, budgets)]
        CheckedProposer.checked = 0
        engine = RecordingEngine(target, head, proposer=CheckedProposer, max_batch=4)
        reqs = engine.run([Request(p, method, TREES[method], max_new_tokens=m) for p, m in zip(PROMPTS, budgets)])
        assert [engine_tokens(r) for r in reqs] == refs
        assert CheckedProposer.checked > 40
        (lane,) = engine.lanes.values()
        assert lane.proposer.drafted and lane.proposer.drafted <= set(ALLOWED)
        for p, m, ref in zip(PROMPTS[:2], budgets, refs):
            assert run_generate(target, p, Drafter(head, target), tree=TREES[method], max_new_tokens=m).tokens == ref


@pytest.mark.parametrize("method, min_tau", [("eagle", 2.5), ("eagle2", 2.0)])
def test_oracle_drafts_are_used(head, target, method, min_tau):
    """With the oracle drafts of spec_helpers (the EAGLE-3 head's trees, the target's own tokens),
    long runs of drafts are accepted through the EAGLE-3 head's commit path, output unchanged."""
    def make(h, t, tree_cfg):
        return OracleProposer(h, t, tree_cfg, seed=0, p_oracle=1.0, noise=0.0)

    with single_thread():
        refs = [run_generate(target, p, max_new_tokens=30).tokens for p in PROMPTS[:2]]
        engine = RecordingEngine(target, head, proposer=make)
        reqs = engine.run([Request(p, method, TREES[method], max_new_tokens=30) for p in PROMPTS[:2]])
    for req, ref in zip(reqs, refs):
        assert engine_tokens(req) == ref
        assert req.stats.tau > min_tau, req.stats.accept_lengths


@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_step_has_no_host_sync_and_fixed_shapes_change_nothing(head, target, monkeypatch, method):
    """The EAGLE-3 step (layers returned, fused, d2t mapping) reads nothing back to the host, and
    capacity-wide views with bucketed rows (the CUDA-graph layout) give the same tokens."""
    from eaglespec import attention

    with single_thread():
        def jobs():
            return [Request(p, method, TREES[method], SamplingConfig(0.8 * (i % 2), seed=i), 15 + i)
                    for i, p in enumerate(PROMPTS[:3])]

        exact = Engine(target, head).run(jobs())
        fixed = Engine(target, head, fixed_shapes=True).run(jobs())
    assert [r.pending_tokens for r in fixed] == [r.pending_tokens for r in exact]
    monkeypatch.setattr(attention, "DECODE_KERNEL", "sdpa")  # as tests/test_engine.py's host-sync test
    engine = Engine(target, head, max_batch=3)
    reqs = [engine.submit(r) for r in jobs()]
    engine.step()  # admit and prefill (host work) outside the count
    lane = next(iter(engine.lanes.values()))
    state, sampling = lane.state.rows(3), RowSampling.from_configs([r.sampling for r in reqs])
    counter = SyncCounter(monkeypatch)
    with torch.inference_mode():
        for _ in range(3):
            lane.step_fn(state, sampling, max(lane.lengths) + 20)
    assert counter.calls == []


# --- speculative sampling ---------------------------------------------------------------------------------
PROMPT, NEW, PASS_P = [1, 2, 3, 4], 3, 1e-3


SAMPLING = [  # (method, sampling, oracle drafts, least accepted drafts per request)
    ("eagle2", SamplingConfig(temperature=1.0), False, 0.03),
    ("eagle", SamplingConfig(temperature=0.8, top_k=5), False, 0.2),
    ("eagle2", SamplingConfig(temperature=1.0), True, 0.3),
]


@pytest.mark.parametrize("method, sampling, oracle, min_accepted", SAMPLING,
                         ids=["eagle2-t1", "eagle-t0.8-topk5", "eagle2-t1-oracle"])
def test_sampling_lossless(tmp_path, method, sampling, oracle, min_accepted):
    """1,500 seeded requests through the engine with an EAGLE-3 head (a 5-token draft vocabulary
    over an 8-token target): the distribution of the first three tokens is the target's
    (chi-square). The head's own drafts, and oracle drafts (memoised, p_oracle 1) over its trees
    and commits, which get many more drafts accepted."""
    cfg = tiny_config(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, inter=32)
    small = tiny_model(cfg, seed=1, scale=2.0)
    head = load_head(write_head(tmp_path, released_config(cfg, 5, layers=(0, 0, 0)),
                                released_tensors(cfg, [0, 2, 3, 5, 7], seed=4, scale=3.0)), cfg)
    tree = (TreeConfig("eagle2", total_tokens=8, depth=3, top_k=3) if method == "eagle2"
            else TreeConfig("eagle", choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))

    def make(h, t, tree_cfg):
        return OracleProposer(h, t, tree_cfg, seed=0, p_oracle=1.0, noise=0.0, memo=True)

    n = 1500
    engine = RecordingEngine(small, head, proposer=make if oracle else None, max_batch=8)
    reqs = [Request(PROMPT, method, tree, dataclasses.replace(sampling, seed=s), NEW) for s in range(n)]
    with single_thread():
        for a in range(0, n, 64):
            engine.run(reqs[a:a + 64])
    counts = Counter(tuple(engine_tokens(r)) for r in reqs)
    pval, stat, df = chi_square_pvalue(counts, exact_sequence_probs(small, PROMPT, sampling, NEW))
    assert df >= 15, df
    assert pval > PASS_P, (stat, df)
    accepted = sum(a - 1 for r in reqs for a in r.stats.accept_lengths)
    assert accepted > min_accepted * n, accepted  # drafts were accepted: the speculative path ran


# --- the API and the command line ---------------------------------------------------------------------
def test_set_draft_and_cli(tmp_path, tiny_chat_checkpoint, isolated_cache, capsys):
    """EagleSpec.set_draft(PATH) and `eaglespec generate --draft PATH` run an EAGLE-3 head; `random3` too."""
    from eaglespec.api import EagleSpec
    from eaglespec.cli import main

    ckpt = str(tiny_chat_checkpoint)
    cfg = ModelConfig.from_hf(json.loads((tiny_chat_checkpoint / "config.json").read_text()))
    head = init_random_head(cfg, seed=2, kind="eagle3", draft_vocab=20)
    assert head.target_layers == default_target_layers(2) == (1, 1, 0)
    save_head(head, tmp_path / "h3")
    spec = EagleSpec.load(ckpt, dtype="fp32")
    want = spec.generate("hello world", max_new_tokens=10).token_ids
    for draft in (str(tmp_path / "h3"), "random3"):
        spec.set_draft(draft)
        assert isinstance(spec.head, Eagle3Head)
        for method in ("eagle", "eagle2"):
            assert spec.generate("hello world", method=method, max_new_tokens=10).token_ids == want
    capsys.readouterr()
    rc = main(["generate", "--model", ckpt, "--dtype", "fp32", "--prompt", "hello world", "--max-new-tokens", "10",
               "--method", "eagle2", "--draft", str(tmp_path / "h3"), "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == want


def test_bench_runs_an_eagle3_head(tmp_path, tiny_chat_checkpoint_256, isolated_cache, capsys):
    """`eaglespec bench --draft PATH` with an EAGLE-3 head: eagle and eagle2 rows, no lossless mismatch."""
    from eaglespec.cli import main

    ckpt = tiny_chat_checkpoint_256
    cfg = ModelConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    save_head(init_random_head(cfg, seed=4, kind="eagle3", draft_vocab=12), tmp_path / "h3")
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "the cat sat on the mat"}) + "\n"
                    + json.dumps({"question": "how big is the sun"}) + "\n")
    rc = main(["bench", "--model", str(ckpt), "--dtype", "fp32", "--data", str(data), "--methods",
               "vanilla,eagle,eagle2", "--draft", str(tmp_path / "h3"), "--max-new-tokens", "8",
               "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["mismatches"] == []
    assert {r["method"] for r in res["rows"]} == {"vanilla", "eagle", "eagle2"}
    assert all(r["same_as_vanilla"] for r in res["rows"] if r["method"] != "vanilla")


def test_own_drafts_are_accepted_greedy(tmp_path):
    """Greedy on an 8-token target: the EAGLE-3 head's own drafts (no oracle) are accepted often
    enough that tau > 1, and the output is vanilla's."""
    cfg = tiny_config(vocab=8, hidden=16, layers=1, heads=2, kv_heads=1, inter=32)
    small = tiny_model(cfg, seed=1, scale=2.0)
    head = load_head(write_head(tmp_path, released_config(cfg, 5, layers=(0, 0, 0)),
                                released_tensors(cfg, [0, 2, 3, 5, 7], seed=4, scale=3.0)), cfg)
    prompts = [[1, 2, 3, 4], [7], [5, 5, 0, 2, 6]]
    with single_thread():
        refs = [run_generate(small, p, max_new_tokens=40).tokens for p in prompts]
        reqs = RecordingEngine(small, head).run([Request(p, "eagle2", TREES["eagle2"], max_new_tokens=40)
                                                 for p in prompts])
    assert [engine_tokens(r) for r in reqs] == refs
    accepted = [a - 1 for r in reqs for a in r.stats.accept_lengths]
    assert sum(accepted) / len(accepted) > 0.1, accepted


def test_serve_runs_an_eagle3_head(tmp_path, tiny_chat_checkpoint_256, isolated_cache):
    """The server over an EagleSpec whose draft is an EAGLE-3 head directory: eagle2 chat
    completions equal the vanilla ones."""
    from serve_helpers import load_spec, running_server

    ckpt = tiny_chat_checkpoint_256
    cfg = ModelConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    save_head(init_random_head(cfg, seed=6, kind="eagle3", draft_vocab=16), tmp_path / "h3")
    spec = load_spec(ckpt, draft=str(tmp_path / "h3"))
    assert isinstance(spec.head, Eagle3Head)
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    with running_server(spec) as srv:
        client = srv.client()
        texts = {m: client.chat.completions.create(model=srv.model, messages=messages, max_tokens=12, temperature=0,
                                                   extra_body={"eaglespec": {"method": m}}).choices[0].message.content
                 for m in ("vanilla", "eagle2")}
    assert texts["eagle2"] == texts["vanilla"] and texts["vanilla"]
