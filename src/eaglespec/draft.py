"""The EAGLE-1/2 draft head, checkpoints of either head kind, and the drafter that grows trees.

Two head kinds share one small protocol, so Proposer, SpecStep, the engine and Drafter run both:
`target_layers` (None: the target's final normed features; EAGLE-3: the layers whose entering
hidden states it fuses), `target_features(out)` (the per-token feature input from a target
forward), `fuse` (target features -> hidden), `step(embeds, hidden, positions, cache, mask)`
(one head forward; deeper tree nodes pass their parent's output as hidden), `forward` (step over
fused target features: committed pairs), `readout` (what the LM head reads), `lm_weight` and
`to_target_ids` (top-k over the head's vocabulary, returned as target ids). The EAGLE-3 head
lives in eagle3.py; `load_head` detects the kind of a checkpoint.

Head: z = fc(concat(embed(x[t+1]), f[t])), then one Llama decoder layer without its input norm
-> predicted feature f^[t+1] -> the target's LM head. Embedding and LM head belong to the target
and are borrowed at call time (frozen, never copied).

Draft cache layout: slot t holds the pair (x[t+1], f[t]) at position t, so after a target
context of n tokens the committed draft slots are 0..n-1 and the root (x[n], the newest token)
is the last committed pair. Tree nodes at depth d sit at position n - 1 + d; their slots are
appended during drafting and truncated afterwards: accepted tokens are re-run next step with the
target's real features, which is what the head was trained on.

Reduced draft vocabulary (optional, as in EAGLE-3): a head may carry `vocab`, the ids of the
target tokens it can propose (the most frequent ones in its training data). Its logits are then
the matching rows of the shared LM head only, which cuts the LM-head cost of drafting and
training several times on a 49k vocabulary. Losslessness is untouched: the target verifies every
draft, and tree drafts are deterministic (q = 1), which holds for any candidate set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .attention import ChainMask
from .config import ConfigError, ModelConfig, TreeConfig
from .kv_cache import KVCache
from .eagle3 import Eagle3Head, eagle3_config, eagle3_from_checkpoint, eagle3_state, init_eagle3_head, is_eagle3
from .model import DecoderLayer, ModelOutput, Rotary, Transformer, causal_mask
from .tree import StaticLayout, Tree, rerank, static_layout, truncate_layout

HEAD_FORMAT = "eaglespec-draft-v1"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


class DraftHead(nn.Module):
    """The trainable part of EAGLE-1/2's draft: fc + one decoder layer (~1 target layer), or
    `num_layers` stacked ones (EAGLE's released code allows it: layers i >= 1 keep their input norm)."""

    def __init__(self, cfg: ModelConfig, bias: bool = True, num_layers: int = 1) -> None:
        super().__init__()
        if num_layers < 1:
            raise ConfigError(f"a draft head needs at least one layer, got {num_layers}")
        # A dense, full-attention Llama block whatever the target (MoE, Gemma 3, Qwen3).
        cfg = cfg.head_config()
        self.config = cfg
        self.bias = bias
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bias)
        self.layer = DecoderLayer(cfg, input_norm=False)
        # Layers 1.. (empty for the usual one-layer head, whose parameter names stay as they were).
        self.more = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers - 1))
        for lay in self.layers:
            lay.attn.exact_decode = False  # proposals need no bitwise reproducibility across shapes
        self.rotary = Rotary(cfg)
        # [Vd] target ids the draft may propose (sorted), or None for the full vocabulary.
        self.register_buffer("vocab", None)

    def set_vocab(self, vocab: torch.Tensor | None) -> None:
        if vocab is not None:
            vocab = torch.unique(vocab.long().flatten())
            if vocab.numel() == 0 or int(vocab[0]) < 0 or int(vocab[-1]) >= self.config.vocab_size:
                raise ConfigError(f"draft vocabulary must hold ids in [0, {self.config.vocab_size})")
            vocab = vocab.to(self.fc.weight.device)
        self.vocab = vocab

    def lm_weight(self, target_lm_head: torch.Tensor) -> torch.Tensor:
        """The LM-head rows this head scores: [Vd, H] (a gathered copy) or the full [V, H] weight."""
        return target_lm_head if self.vocab is None else target_lm_head[self.vocab]

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into lm_weight's rows -> target token ids."""
        return idx if self.vocab is None else self.vocab[idx]

    @property
    def draft_vocab(self) -> int:
        """Rows of lm_weight: the tokens this head can draft (the target's whole vocabulary when None)."""
        return self.config.vocab_size if self.vocab is None else int(self.vocab.numel())

    @property
    def layers(self) -> list[nn.Module]:
        return [self.layer, *self.more]

    @property
    def cache_layers(self) -> int:
        """Layers of KV cache a drafting run needs."""
        return 1 + len(self.more)

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        c, w = self.config, self.fc.weight
        return KVCache(self.cache_layers, c.num_kv_heads, c.head_dim, max_len, batch_size, w.dtype, w.device)

    # --- the head protocol (shared with eagle3.Eagle3Head) -------------------------------------
    kind = "eagle"
    target_layers = None  # reads no intermediate layers: the target's final normed features

    def target_features(self, out: ModelOutput) -> torch.Tensor:
        """The target's forward -> this head's per-token feature input: [B, T, H]."""
        return out.features

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features -> the hidden `step` takes: the same thing (fc reads both inputs at once)."""
        return features

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the predicted feature itself (no final norm)."""
        return hidden

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
             mask: torch.Tensor | ChainMask | None = None) -> torch.Tensor:
        """One head forward over (token, feature or parent output) pairs: `forward`."""
        return self.forward(embeds, hidden, positions, cache, mask)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | ChainMask | None = None) -> torch.Tensor:
        """embeds, features: [B, T, H] (token x[t+1], feature f[t]); positions [B, T] -> f^[t+1] [B, T, H].

        cache None (training): the T pairs attend causally among themselves, or per `mask` [B, T, T]
        (a ChainMask for the training-time test's unrolled steps).
        """
        t = embeds.shape[1]
        if mask is None and t > 1:
            mask = causal_mask(0 if cache is None else cache.length, t, embeds.device)
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:
            mask = mask[:, None]
        x = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        for i, lay in enumerate(self.layers):
            x = lay(x, cos, sin, cache, i, mask)
        if cache is not None:
            cache.advance(t)
        return x


def init_head_(head: DraftHead, seed: int = 0) -> DraftHead:
    """Reproducible init from a seed: normal(0, 0.02) weights (HF's), unit norms, zero biases."""
    _seeded_init_(head, torch.Generator().manual_seed(seed))
    return head


def _seeded_init_(module: nn.Module, g: torch.Generator, zero: tuple[str, ...] = ()) -> nn.Module:
    """init_head_'s rule for every parameter of `module`, drawing from `g`; those named in `zero`
    are zeroed instead."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or name in zero:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return module


def grow_head_(head: DraftHead, num_layers: int, seed: int = 0) -> DraftHead:
    """Append decoder layers to a trained head until it has `num_layers`, without changing what it
    computes: each new layer gets seeded random weights but zero output projections (attention's
    wo, the MLP's w_down), so its residual branches add nothing until training moves them. This
    grows capacity on top of a head that already drafts well instead of starting over."""
    have = head.cache_layers
    if num_layers < have:
        raise ConfigError(f"cannot shrink a {have}-layer head to {num_layers} layers")
    p = head.fc.weight
    g = torch.Generator().manual_seed(seed)
    for _ in range(num_layers - have):
        lay = DecoderLayer(head.config).to(dtype=p.dtype, device=p.device)
        lay.attn.exact_decode = False
        _seeded_init_(lay, g, zero=("attn.wo.weight", "mlp.w_down.weight"))
        lay.requires_grad_(p.requires_grad)
        head.more.append(lay)
    return head


# Either kind of head: what Proposer, SpecStep, Drafter and the engine take.
Head = DraftHead | Eagle3Head


def init_random_head(cfg: ModelConfig, seed: int = 0, bias: bool = True, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", kind: str = "eagle", draft_vocab: int | None = None,
                     target_layers: tuple[int, ...] | None = None, num_layers: int = 1) -> Head:
    """A seeded random head (acceptance near zero; output must still be identical).

    kind "eagle" (EAGLE-1/2; `bias`) or "eagle3" (`draft_vocab` random target ids, all when None;
    `target_layers` default (2, L//2, L-3)); `num_layers` stacks EAGLE-1/2 decoder layers."""
    if kind == "eagle3":
        head = init_eagle3_head(cfg, seed, draft_vocab, target_layers)
    elif kind == "eagle":
        head = init_head_(DraftHead(cfg, bias, num_layers), seed)
    else:
        raise ValueError(f"head kind must be 'eagle' or 'eagle3', got {kind!r}")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


# --- checkpoints: EAGLE's released layout is also ours ------------------------------------
def _eagle_state(head: DraftHead) -> dict[str, torch.Tensor]:
    c = head.config
    qkv = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    sd = {"fc.weight": head.fc.weight}
    if head.bias:
        sd["fc.bias"] = head.fc.bias
    for i, lay in enumerate(head.layers):
        p = f"layers.{i}."
        q, k, v = lay.attn.wqkv.weight.split(qkv)
        gate, up = lay.mlp.w_gate_up.weight.split(c.intermediate_size)
        sd.update({
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": lay.attn.wo.weight,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": lay.mlp.w_down.weight,
            p + "post_attention_layernorm.weight": lay.mlp_norm.weight,
        })
        if i > 0:  # layer 0 reads fc's output directly (no input norm), as in EAGLE
            sd[p + "input_layernorm.weight"] = lay.attn_norm.weight
        if c.qkv_bias:
            qb, kb, vb = lay.attn.wqkv.bias.split(qkv)
            sd.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                       p + "self_attn.v_proj.bias": vb})
    return {k: v.detach().contiguous() for k, v in sd.items()}


def save_head(head: Head, path: str | Path, dtype: torch.dtype | None = None, extra: dict | None = None) -> None:
    """Write config.json + model.safetensors in EAGLE-1/2's or EAGLE-3's released layout (plus our metadata)."""
    from .weights import atomic_save_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(head, Eagle3Head):
        sd = eagle3_state(head)
        if dtype is not None:
            sd = {k: v.to(dtype) for k, v in sd.items()}
        sd.update({"d2t": head.d2t.cpu().to(torch.int64), "t2d": head.t2d.cpu().bool()})
        atomic_save_safetensors(sd, path / "model.safetensors", {"format": "pt"})
        (path / DRAFT_VOCAB_FILE).unlink(missing_ok=True)  # an EAGLE-1/2 head saved here before
        _write_config(path, eagle3_config(head, extra))
        return
    sd = _eagle_state(head)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    cfg = head.config.to_hf()
    cfg.update({"num_hidden_layers": head.cache_layers, "bias": head.bias, "qkv_bias": head.config.qkv_bias,
                "eaglespec": {"format": HEAD_FORMAT, **(extra or {})}})
    atomic_save_safetensors(sd, path / "model.safetensors", {"format": "pt"})
    # Kept out of model.safetensors so that file stays exactly EAGLE-1/2's layout; other
    # implementations then run the head over the full vocabulary, which works too.
    vocab_file = path / DRAFT_VOCAB_FILE
    if head.vocab is not None:
        atomic_save_safetensors({"token_ids": head.vocab.cpu().to(torch.int64).contiguous()}, vocab_file, {"format": "pt"})
        cfg["eaglespec_draft_vocab_size"] = int(head.vocab.numel())
    elif vocab_file.exists():
        vocab_file.unlink()
    _write_config(path, cfg)


def _write_config(path: Path, cfg: dict) -> None:
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2))
    tmp.replace(path / "config.json")


def load_head(path: str | Path, target: ModelConfig, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> Head:
    """Load a head from our format or a released EAGLE-1/2 or EAGLE-3 checkpoint (the kind is
    detected); refuse one that does not fit the target. The head's measured tau by tree, where
    its config.json has one ("eaglespec": {"tree_tau": ...}), becomes `head.tree_tau`: the engine
    picks its default trees for the machine from it (runtime/tree_tuning.py). Its measured
    `draft_sharpness` (see `parse_draft_sharpness`), where given, becomes `head.draft_sharpness`."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"draft head {path}: no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ConfigError(f"draft head {path}: unreadable config.json ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"draft head {path}: config.json is not a JSON object")
    head = _load_head(path, raw, target, dtype, device)
    ours = raw.get("eaglespec")
    raw_tau = ours.get("tree_tau") if isinstance(ours, dict) else None
    if raw_tau is not None:
        from .runtime.tree_tuning import parse_tree_tau

        head.tree_tau = parse_tree_tau(raw_tau, f"draft head {path}")
    raw_sharp = ours.get("draft_sharpness") if isinstance(ours, dict) else None
    if raw_sharp is not None:
        head.draft_sharpness = parse_draft_sharpness(raw_sharp, f"draft head {path}")
    return head


def parse_draft_sharpness(raw: object, where: str) -> float:
    """A head's `draft_sharpness` s: sampled drafts (chains and sampled trees) are drawn from
    softmax(s * logits / T) instead of softmax(logits / T). Any q keeps the output's distribution
    exact (verification uses the q each draft was drawn from); s only moves the acceptance
    sum(min(p, q)), and a head trained on soft targets is often less confident than the target,
    where s > 1 raises it (measured with scripts/head_acceptance.py). A clear error unless a
    number in (0, 10]."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw <= 10:
        raise ConfigError(f"{where}: draft_sharpness must be a number in (0, 10], got {raw!r}")
    return float(raw)


def _load_head(path: Path, raw: dict, target: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> Head:
    """load_head's tensors, given the head's config.json (`raw`)."""
    sd = None  # read once: names from model.safetensors' header, or the whole pytorch_model.bin
    keys = _keys(path)
    if not (path / "model.safetensors").is_file() and (path / "pytorch_model.bin").is_file():
        sd = _read_tensors(path)
        keys = set(sd)
    if is_eagle3(raw, keys):
        head = eagle3_from_checkpoint(str(path), raw, sd if sd is not None else _read_tensors(path), target)
        return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    hraw = dict(raw)
    hraw.setdefault("architectures", [{"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        target.architecture, "LlamaForCausalLM")])
    hcfg = ModelConfig.from_hf(hraw)
    hcfg.qkv_bias = bool(raw.get("qkv_bias", hcfg.qkv_bias))
    problems = [f"{name} {a} != target's {b}" for name, a, b in (
        ("hidden_size", hcfg.hidden_size, target.hidden_size),
        ("vocab_size", hcfg.vocab_size, target.vocab_size),
    ) if a != b]
    if problems:
        raise ConfigError(f"draft head {path} does not fit this target: " + "; ".join(problems))
    if sd is None:
        sd = _read_tensors(path)
    bias = "fc.bias" in sd
    # The layers the tensors hold (config.json's num_hidden_layers may be the target's when a
    # released head's config was copied from it).
    n_layers = 1 + max((int(k.split(".")[1]) for k in sd if k.startswith("layers.") and k.split(".")[1].isdigit()),
                       default=0)
    head = DraftHead(hcfg, bias=bias, num_layers=n_layers)
    c = head.config
    try:
        with torch.no_grad():
            head.fc.weight.copy_(sd["fc.weight"])
            if bias:
                head.fc.bias.copy_(sd["fc.bias"])
            for i, lay in enumerate(head.layers):
                p = f"layers.{i}."
                lay.attn.wqkv.weight.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
                if c.qkv_bias:
                    lay.attn.wqkv.bias.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
                lay.attn.wo.weight.copy_(sd[p + "self_attn.o_proj.weight"])
                lay.mlp.w_gate_up.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
                lay.mlp.w_down.weight.copy_(sd[p + "mlp.down_proj.weight"])
                lay.mlp_norm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
                if i > 0:
                    lay.attn_norm.weight.copy_(sd[p + "input_layernorm.weight"])
    except KeyError as e:
        raise ConfigError(f"draft head {path}: missing tensor {e}") from None
    except RuntimeError as e:
        raise ConfigError(f"draft head {path}: tensor shapes do not fit its config.json ({e})") from None
    if "embed_tokens.weight" in sd and tuple(sd["embed_tokens.weight"].shape) != (target.vocab_size, target.hidden_size):
        raise ConfigError(f"draft head {path}: its embedding {tuple(sd['embed_tokens.weight'].shape)} does not fit the target")
    if (path / DRAFT_VOCAB_FILE).is_file():
        from safetensors.torch import load_file

        try:
            head.set_vocab(load_file(str(path / DRAFT_VOCAB_FILE))["token_ids"])
        except ConfigError as e:
            raise ConfigError(f"draft head {path}: {e}") from None
        except Exception as e:  # corrupt file or missing key
            raise ConfigError(f"draft head {path}: unreadable {DRAFT_VOCAB_FILE} ({type(e).__name__}: {e})") from None
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _keys(path: Path) -> set[str]:
    st = path / "model.safetensors"
    if st.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(st), framework="pt") as f:
                return set(f.keys())
        except Exception as e:  # corrupt or truncated: safetensors raises its own error types
            raise ConfigError(f"draft head {path}: unreadable model.safetensors ({type(e).__name__}: {e})") from None
    return set()


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.is_file():
            return torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt files raise library-specific errors
        raise ConfigError(f"draft head {path}: unreadable weights ({type(e).__name__}: {e})") from None
    raise ConfigError(f"draft head {path}: no model.safetensors or pytorch_model.bin")


# --- drafting -----------------------------------------------------------------------------
@dataclass
class DraftState:
    root_hidden: torch.Tensor  # [H] the head's output at the root pair: predicts depth-1 tokens


class Drafter:
    """Runs a draft head (either kind) against a target's embedding and LM head and grows draft trees."""

    def __init__(self, head: Head, target: Transformer) -> None:
        self.head, self.target = head, target
        self.cache: KVCache | None = None
        self.committed = 0  # draft slots holding real-feature pairs
        self._layout_cache: dict[tuple, StaticLayout] = {}
        self._lm_weight: torch.Tensor | None = None  # gathered once: rows of a reduced vocabulary

    def reset(self, max_len: int) -> None:
        self.cache = self.head.new_cache(max_len)
        self.committed = 0

    def extend(self, tokens: torch.Tensor, features: torch.Tensor) -> DraftState:
        """Commit pairs (tokens[i], features[i]) at the next positions: tokens [T], features [T, F]
        (F: the head's target_features width, H for EAGLE-1/2, 3H for EAGLE-3)."""
        assert self.cache is not None, "call reset() first"
        self.cache.truncate(self.committed)
        t = tokens.numel()
        pos = torch.arange(self.committed, self.committed + t, device=tokens.device)[None]
        hidden = self.head(self.target.embed(tokens[None]), features[None], pos, self.cache)
        self.committed += t
        return DraftState(root_hidden=hidden[0, -1])

    def _lm(self, dtype: torch.dtype) -> torch.Tensor:
        """The LM-head rows the head scores, [Vd, H] (for a reduced vocabulary: gathered once)."""
        if self._lm_weight is None or self._lm_weight.dtype != dtype:
            self._lm_weight = self.head.lm_weight(self.target.lm_head.weight).contiguous()
        return self._lm_weight

    def _top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[K, H] -> the k best draft tokens per row: (log-probabilities [K, k] fp32, target ids [K, k]).

        Log-softmax in fp32: ranking by summed log-probabilities needs the precision.
        """
        lp = F.log_softmax(F.linear(self.head.readout(hidden), self._lm(hidden.dtype)).float(), dim=-1)
        v, i = lp.topk(min(k, lp.shape[-1]), dim=-1)
        return v, self.head.to_target_ids(i)

    def _run_nodes(self, tokens: list[int], parent_hidden: torch.Tensor, depth: int,
                   ancestor_slots: list[list[int]]) -> torch.Tensor:
        """One draft forward over frontier nodes (same depth). Returns their outputs [K, H].

        ancestor_slots[i]: draft-cache slots of node i's drafted ancestors (root excluded; it is
        committed and visible to all).
        """
        cache = self.cache
        k = len(tokens)
        start = cache.length
        mask = torch.zeros(k, start + k, dtype=torch.bool, device=parent_hidden.device)
        mask[:, : self.committed] = True
        for i, slots in enumerate(ancestor_slots):
            if slots:
                mask[i, slots] = True
            mask[i, start + i] = True
        pos = torch.full((1, k), self.committed - 1 + depth, device=parent_hidden.device)
        tok = torch.tensor(tokens, device=parent_hidden.device)[None]
        out = self.head.step(self.target.embed(tok), parent_hidden[None], pos, cache, mask)
        return out[0]

    def draft(self, root_token: int, state: DraftState, tree_cfg: TreeConfig, max_nodes: int) -> Tree:
        """Grow a tree of at most `max_nodes` nodes (root included) below `root_token`."""
        if tree_cfg.method == "eagle2":
            max_nodes = min(max_nodes, tree_cfg.total_tokens)
        if max_nodes <= 1:
            return Tree.from_parents([root_token], [-1])
        if tree_cfg.method == "eagle":
            tree = self._draft_static(root_token, state, tree_cfg, max_nodes)
        else:
            tree = self._draft_dynamic(root_token, state, tree_cfg, max_nodes)
        self.cache.truncate(self.committed)
        return tree

    def _draft_static(self, root_token: int, state: DraftState, tree_cfg: TreeConfig, max_nodes: int) -> Tree:
        # A reduced vocabulary may hold fewer tokens than a node's rank asks for: drop such paths.
        vocab = self._lm(state.root_hidden.dtype).shape[0]
        choices = [c for c in tree_cfg.choices if max(c) < vocab]
        key = (vocab, tuple(map(tuple, choices)))
        layout = self._layout_cache.get(key)
        if layout is None:
            layout = self._layout_cache[key] = static_layout(choices)
        if max_nodes < len(layout.parents):
            layout = truncate_layout(layout, max_nodes)
        n = len(layout.parents)
        has_child = [False] * n
        for p in layout.parents[1:]:
            has_child[p] = True
        need = [0] * n  # how many top candidates each node must supply
        for i in range(1, n):
            need[layout.parents[i]] = max(need[layout.parents[i]], layout.ranks[i] + 1)
        tokens = [root_token] + [0] * (n - 1)
        hidden: dict[int, torch.Tensor] = {0: state.root_hidden}
        slot: dict[int, int] = {}
        top: dict[int, list[int]] = {0: self._top(state.root_hidden[None], need[0])[1][0].tolist()}
        for d in range(1, layout.max_depth + 1):
            level = [i for i in range(n) if layout.depth[i] == d]
            for i in level:
                tokens[i] = top[layout.parents[i]][layout.ranks[i]]
            run = [i for i in level if has_child[i]]
            if not run:
                continue
            anc = [self._ancestor_slots(i, layout.parents, slot) for i in run]
            start = self.cache.length
            out = self._run_nodes([tokens[i] for i in run], torch.stack([hidden[layout.parents[i]] for i in run]), d, anc)
            width = max(need[i] for i in run)
            idx = self._top(out, width)[1].tolist()
            for j, i in enumerate(run):
                slot[i], hidden[i], top[i] = start + j, out[j], idx[j]
        return Tree.from_parents(tokens, layout.parents)

    @staticmethod
    def _ancestor_slots(i: int, parents: list[int], slot: dict[int, int], root: int = 0) -> list[int]:
        """Draft-cache slots of node i's drafted ancestors, stopping at `root` (committed)."""
        out = []
        p = parents[i]
        while p != root and p != -1:
            out.append(slot[p])
            p = parents[p]
        return out

    def _draft_dynamic(self, root_token: int, state: DraftState, tree_cfg: TreeConfig, max_nodes: int) -> Tree:
        k = tree_cfg.top_k
        # Candidate pool (every drafted node, root excluded): token, parent (-1 = root), value, depth.
        v, t = self._top(state.root_hidden[None], k)
        v, t = v[0], t[0]
        k = v.numel()  # a reduced vocabulary may hold fewer than top_k tokens
        cand_tok, cand_par, cand_val, cand_dep = t.tolist(), [-1] * k, v.tolist(), [1] * k
        frontier = list(range(k))
        frontier_hidden = state.root_hidden[None].expand(k, -1)
        slot: dict[int, int] = {}
        for d in range(1, tree_cfg.depth):
            anc = [self._ancestor_slots(i, cand_par, slot, root=-1) for i in frontier]
            start = self.cache.length
            out = self._run_nodes([cand_tok[i] for i in frontier], frontier_hidden, d, anc)
            for j, i in enumerate(frontier):
                slot[i] = start + j
            cv, ct = self._top(out, k)  # [k, k]
            parent_val = torch.tensor([cand_val[i] for i in frontier])[:, None]
            total = (parent_val + cv.cpu()).flatten()
            base = len(cand_tok)
            for j, i in enumerate(frontier):
                for r in range(k):
                    cand_tok.append(int(ct[j, r]))
                    cand_par.append(i)
                    cand_val.append(float(total[j * k + r]))
                    cand_dep.append(d + 1)
            best = torch.argsort(total, descending=True, stable=True)[:k].tolist()  # ties: the earlier child
            frontier = [base + b for b in best]
            frontier_hidden = torch.stack([out[b // k] for b in best])
        keep = rerank(torch.tensor(cand_val), torch.tensor(cand_par), torch.tensor(cand_dep), max_nodes - 1).tolist()
        new_index = {c: j + 1 for j, c in enumerate(keep)}
        tokens = [root_token] + [cand_tok[c] for c in keep]
        parents = [-1] + [0 if cand_par[c] == -1 else new_index[cand_par[c]] for c in keep]
        values = torch.tensor([0.0] + [cand_val[c] for c in keep])
        return Tree.from_parents(tokens, parents, values=values)
