"""The EAGLE-3 draft head: three fused target layers in, its own norm and reduced-vocabulary LM head out.

    fused  = fc(concat(h_low, h_mid, h_high))          # target hidden states entering layers
                                                        # `target_layers` (default 2, L//2, L-3)
    x      = concat(input_layernorm(embed(x[t+1])), hidden_norm(hidden))     # [.., 2H]
    hidden = hidden + attn(x)                           # residual: the hidden, not x
    hidden = hidden + mlp(post_attention_layernorm(hidden))
    logits = lm_head(norm(hidden))                      # [.., draft_vocab]; target id = i + d2t[i]

At depth 0 (committed pairs) `hidden` is the fused target feature; deeper in a draft tree it is the
head's own output at the parent node (pre-norm): fc reads target features only. The draft cache
layout and positions are the EAGLE-1/2 head's (draft.py): slot t holds (x[t+1], feature[t]) at
position t. The token embedding is the target's (borrowed at call time, never copied).

The head protocol it shares with `draft.DraftHead`, so one Proposer / SpecStep / Drafter runs both:
`target_layers`, `target_features(out)`, `fuse`, `step`, `forward` (= step over fused features),
`readout`, `lm_weight`, `to_target_ids`, `new_cache`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .attention import ChainMask
from .config import ConfigError, ModelConfig
from .kv_cache import KVCache
from .model import MLP, Attention, ModelOutput, RMSNorm, Rotary, causal_mask


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's (low, mid, high) = layers (2, L//2, L-3), clamped into [0, L-1] for shallow targets."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def check_target_layers(layers, num_layers: int) -> tuple[int, ...]:
    """The layer ids as a tuple, or ConfigError when one is not a layer of the target."""
    try:
        layers = tuple(int(i) for i in layers)
    except (TypeError, ValueError):
        raise ConfigError(f"EAGLE-3 target layers must be a list of layer ids, got {layers!r}") from None
    if not layers or any(not 0 <= i < num_layers for i in layers):
        raise ConfigError(f"EAGLE-3 target layers {list(layers)} must be ids in [0, {num_layers}) "
                          f"(hidden states entering those layers of a {num_layers}-layer target)")
    return layers


class Eagle3Layer(nn.Module):
    """EAGLE-3's "midlayer": attention over concat(norm(embedding), norm(hidden)), residual = hidden."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_norm = RMSNorm(h, eps)  # input_layernorm (over the token embedding)
        self.hidden_norm = RMSNorm(h, eps)
        self.attn = Attention(cfg)
        self.attn.wqkv = nn.Linear(2 * h, self.attn.wqkv.out_features, bias=False)  # reads [.., 2H]
        self.attn.exact_decode = False  # proposals need no bitwise reproducibility across shapes
        self.mlp_norm = RMSNorm(h, eps)  # post_attention_layernorm
        self.mlp = MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | ChainMask | None) -> torch.Tensor:
        x = torch.cat((self.embed_norm(embeds), self.hidden_norm(hidden)), dim=-1)  # [B, T, 2H]
        hidden = hidden + self.attn(x, cos, sin, cache, 0, mask)
        return hidden + self.mlp(self.mlp_norm(hidden))


class Eagle3Head(nn.Module):
    """fc (3H -> H) + one midlayer + final norm + its own LM head over `draft_vocab` tokens."""

    kind = "eagle3"

    def __init__(self, cfg: ModelConfig, target_layers: tuple[int, ...], draft_vocab: int,
                 target_hidden: int | None = None) -> None:
        """cfg: the target's config (or the head's own, same width); target_layers: the target layers
        whose entering hidden states are fused; target_hidden: their width (default cfg.hidden_size)."""
        super().__init__()
        # EAGLE-3 heads are dense Llama blocks without biases whatever the target.
        cfg = replace(cfg.head_config(), architecture="llama", qkv_bias=False)
        if not 1 <= draft_vocab <= cfg.vocab_size:
            raise ConfigError(f"draft_vocab_size {draft_vocab} must be in [1, {cfg.vocab_size}] "
                              "(the target vocabulary)")
        self.config = cfg
        self.target_layers = tuple(target_layers)
        self.target_hidden = target_hidden or cfg.hidden_size
        h = cfg.hidden_size
        self.fc = nn.Linear(len(self.target_layers) * self.target_hidden, h, bias=False)
        self.layer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.rotary = Rotary(cfg)
        # d2t[i]: draft id i -> target id i + d2t[i]; t2d[v]: target token v is in the draft vocabulary.
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < draft_vocab)

    cache_layers = 1  # one midlayer

    @property
    def draft_vocab(self) -> int:
        return self.lm_head.out_features

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Install the draft -> target map (t2d derived from d2t when None); refuse one that does not fit."""
        d2t = d2t.detach().flatten().long().cpu()
        vd, v = self.draft_vocab, self.config.vocab_size
        if d2t.numel() != vd:
            raise ConfigError(f"d2t has {d2t.numel()} entries for a draft vocabulary of {vd}")
        ids = torch.arange(vd) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ConfigError(f"d2t maps draft ids to target ids outside [0, {v}) (the target vocabulary)")
        if torch.unique(ids).numel() != vd:
            raise ConfigError("d2t maps two draft ids to the same target id")
        derived = torch.zeros(v, dtype=torch.bool)
        derived[ids] = True
        if t2d is not None:
            t2d = t2d.detach().flatten().cpu()
            if t2d.numel() != v:
                raise ConfigError(f"t2d has {t2d.numel()} entries, the target vocabulary {v}")
            if not torch.equal(t2d.bool(), derived):
                raise ConfigError("t2d does not mark exactly the target ids that d2t maps to")
        dev = self.fc.weight.device
        self.d2t, self.t2d = d2t.to(dev), derived.to(dev)

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary as target ids (sorted, unique; one per lm_head row)."""
        ids = torch.unique(target_ids.long().flatten().cpu())
        self.set_vocab_map(ids - torch.arange(ids.numel()))

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        c, w = self.config, self.fc.weight
        return KVCache(1, c.num_kv_heads, c.head_dim, max_len, batch_size, w.dtype, w.device)

    # --- the head protocol ---------------------------------------------------------------------
    def target_features(self, out: ModelOutput) -> torch.Tensor:
        """The target's forward -> this head's per-token feature input: [B, T, 3 * target_hidden]."""
        return torch.cat([out.hidden[i] for i in self.target_layers], dim=-1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[.., 3 * target_hidden] target features -> [.., H] hidden (depth 0 only)."""
        return self.fc(features.to(self.fc.weight.dtype))

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
             mask: torch.Tensor | ChainMask | None = None) -> torch.Tensor:
        """embeds [B, T, H] (x[t+1]), hidden [B, T, H] (fused feature or the parent's output),
        positions [B, T] -> the head's output [B, T, H] (pre-norm; fed back deeper in a tree)."""
        t = embeds.shape[1]
        if mask is None and t > 1:
            mask = causal_mask(0 if cache is None else cache.length, t, embeds.device)
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:
            mask = mask[:, None]
        cos, sin = self.rotary(positions, hidden.dtype)
        out = self.layer(embeds.to(hidden.dtype), hidden, cos, sin, cache, mask)
        if cache is not None:
            cache.advance(t)
        return out

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | ChainMask | None = None) -> torch.Tensor:
        """Committed pairs: features [B, T, 3 * target_hidden] are fused, then one step."""
        return self.step(embeds, self.fuse(features), positions, cache, mask)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the final norm of the output."""
        return self.norm(hidden)

    def lm_weight(self, target_lm_head: torch.Tensor) -> torch.Tensor:
        """Its own LM head [Vd, H] (the target's is not used)."""
        return self.lm_head.weight

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft ids (rows of lm_weight) -> target token ids."""
        return idx + self.d2t[idx]


def init_eagle3_head(cfg: ModelConfig, seed: int = 0, draft_vocab: int | None = None,
                     target_layers: tuple[int, ...] | None = None) -> Eagle3Head:
    """A seeded random EAGLE-3 head: normal(0, 0.02) weights, unit norms, and a draft vocabulary of
    `draft_vocab` target ids drawn at random (all of them when None)."""
    layers = check_target_layers(target_layers or default_target_layers(cfg.num_layers), cfg.num_layers)
    vd = draft_vocab or cfg.vocab_size
    head = Eagle3Head(cfg, layers, vd)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    head.set_vocab(torch.randperm(cfg.vocab_size, generator=g)[:vd])
    return head


# --- checkpoints: EAGLE-3's released layout ------------------------------------------------
EAGLE3_FORMAT = "eaglespec-eagle3-v1"
LAYER_PREFIXES = ("midlayer.", "layers.0.")  # EAGLE-3's own spelling, then vLLM's / SGLang's


def is_eagle3(raw: dict, keys: set[str]) -> bool:
    """Whether a head directory (config.json dict, tensor names) holds an EAGLE-3 head."""
    ours = raw.get("eaglespec")
    return ("draft_vocab_size" in raw or (isinstance(ours, dict) and ours.get("format") == EAGLE3_FORMAT)
            or "d2t" in keys or "layers.0.hidden_norm.weight" in keys or any(k.startswith("midlayer.") for k in keys))


def eagle3_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """Our modules -> EAGLE-3's released tensor names (split q/k/v and gate/up)."""
    c, lay = head.config, head.layer
    q, k, v = lay.attn.wqkv.weight.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                          c.num_kv_heads * c.head_dim])
    gate, up = lay.mlp.w_gate_up.weight.split(c.intermediate_size)
    p = "midlayer."
    sd = {
        "fc.weight": head.fc.weight,
        p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": lay.attn.wo.weight,
        p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
        p + "mlp.down_proj.weight": lay.mlp.w_down.weight,
        p + "hidden_norm.weight": lay.hidden_norm.weight,
        p + "input_layernorm.weight": lay.embed_norm.weight,
        p + "post_attention_layernorm.weight": lay.mlp_norm.weight,
        "norm.weight": head.norm.weight,
        "lm_head.weight": head.lm_head.weight,
    }
    return {k: v.detach().contiguous() for k, v in sd.items()}


def eagle3_config(head: Eagle3Head, extra: dict | None = None) -> dict:
    """config.json: the head's Llama config, one layer, EAGLE-3's fields, vLLM's layer ids, ours."""
    cfg = head.config.to_hf()
    layers = list(head.target_layers)
    cfg.update({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                "draft_vocab_size": head.draft_vocab,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
                "eaglespec": {"format": EAGLE3_FORMAT, "kind": "eagle3", "target_layers": layers, **(extra or {})}})
    if head.target_hidden != head.config.hidden_size:
        cfg["target_hidden_size"] = head.target_hidden
    return cfg


def _target_layers(raw: dict, target: ModelConfig) -> tuple[int, ...]:
    ours = raw.get("eaglespec")
    ours = ours.get("target_layers") if isinstance(ours, dict) else None
    theirs = raw.get("eagle_config")
    theirs = theirs.get("eagle_aux_hidden_state_layer_ids") if isinstance(theirs, dict) else None
    layers = ours if ours is not None else theirs
    return check_target_layers(layers if layers is not None else default_target_layers(target.num_layers),
                               target.num_layers)


def eagle3_from_checkpoint(name: str, raw: dict, sd: dict[str, torch.Tensor], target: ModelConfig) -> Eagle3Head:
    """Build an Eagle3Head from a config.json dict and its tensors; ConfigError when it does not fit
    `target` (sizes, vocabulary, map, missing or misshapen tensors). `name` names it in errors."""
    hraw = dict(raw, architectures=["LlamaForCausalLM"], model_type="llama")
    hraw.setdefault("vocab_size", target.vocab_size)
    try:
        hcfg = ModelConfig.from_hf(hraw)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"EAGLE-3 draft head {name}: config.json lacks or garbles {e}") from None
    t2d = sd.get("t2d")
    target_hidden = int(raw.get("target_hidden_size") or hcfg.hidden_size)
    problems = [f"{what} {a} != target's {b}" for what, a, b in (
        ("hidden_size", hcfg.hidden_size, target.hidden_size),
        ("target_hidden_size", target_hidden, target.hidden_size),
        ("vocab_size", hcfg.vocab_size, target.vocab_size),
        ("t2d length (target vocabulary)", None if t2d is None else t2d.numel(), target.vocab_size),
    ) if a is not None and a != b]
    if problems:
        raise ConfigError(f"EAGLE-3 draft head {name} does not fit this target: " + "; ".join(problems))
    try:
        layers = _target_layers(raw, target)
        lm = sd["lm_head.weight"]
        draft_vocab = int(raw.get("draft_vocab_size") or lm.shape[0])
        head = Eagle3Head(hcfg, layers, draft_vocab, target_hidden)
        p = next((p for p in LAYER_PREFIXES if p + "self_attn.q_proj.weight" in sd), LAYER_PREFIXES[0])
        lay = head.layer
        with torch.no_grad():
            head.fc.weight.copy_(sd["fc.weight"])
            lay.attn.wqkv.weight.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            lay.attn.wo.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            lay.mlp.w_gate_up.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            lay.mlp.w_down.weight.copy_(sd[p + "mlp.down_proj.weight"])
            lay.hidden_norm.weight.copy_(sd[p + "hidden_norm.weight"])
            lay.embed_norm.weight.copy_(sd[p + "input_layernorm.weight"])
            lay.mlp_norm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
            head.norm.weight.copy_(sd["norm.weight"])
            head.lm_head.weight.copy_(lm)
        head.set_vocab_map(sd["d2t"], t2d)
    except KeyError as e:
        raise ConfigError(f"EAGLE-3 draft head {name}: missing tensor {e}") from None
    except RuntimeError as e:
        raise ConfigError(f"EAGLE-3 draft head {name}: tensor shapes do not fit its config.json ({e})") from None
    except ConfigError as e:
        raise ConfigError(f"EAGLE-3 draft head {name}: {e}") from None
    return head
