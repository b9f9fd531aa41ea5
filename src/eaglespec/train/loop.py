"""The training loop: batches from feature shards, AdamW, warm-up + cosine decay, checkpoints,
resume, validation n-alpha, and DistributedDataParallel under torchrun.

Determinism: batch order comes from (seed, epoch); the noise generator's state is saved in
every checkpoint, so a resumed run takes exactly the steps an uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import pickle
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import cpu_has_native_bf16
from ..draft import DraftHead, save_head
from ..files import atomic_path, atomic_write_text
from ..model import Transformer
from .features import Shard, load_shard
from .loss import Batch, Sample, chain_accuracy, eagle_loss, implied_tau


@dataclass
class TrainConfig:
    """Hyperparameters; defaults are the EAGLE paper's unless noted."""

    epochs: float = 2.0
    lr: float = 3e-5  # paper; small heads on little data want more, see README
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    clip_value: float = 0.5  # the authors clip gradients by value
    w_cls: float = 0.1
    w_reg: float = 1.0  # SmoothL1 feature regression (EAGLE-1/2); 0 = CE only, as EAGLE-3
    # total variation 0.5 * sum|p - q| between the target's and the head's distributions: one minus
    # what a sampled draft is accepted with (sum min(p, q)), so it trains for T > 0 directly. 0 = off.
    w_tv: float = 0.0
    ttt_steps: int = 1  # training-time test: unroll the head this many steps (EAGLE-3: 7); 1 = plain loss
    ttt_decay: float = 0.8  # step s of the unroll weighs ttt_decay ** s (EAGLE-3: 0.8)
    noise: float = 0.1  # U(-0.1, 0.1) on input features
    batch_tokens: int = 4096  # tokens per step (the paper: 4 sequences of up to 2048)
    warmup_steps: int = 50
    max_steps: int = 0  # 0: epochs decide
    checkpoint_every: int = 50
    eval_every: int = 200
    eval_samples: int = 64
    seed: int = 0
    # bf16 autocast of the head's forward (weights and AdamW stay fp32). auto: on CUDA and on CPUs
    # with native bf16 matmul (AVX512-BF16 / AMX: ~3x fp32 on one core, see README); on / off.
    autocast: str = "auto"


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    history: list[dict] = field(default_factory=list)


class SampleStore:
    """All samples of a feature dump, in memory (bf16 features: ~1.2 KB/token for H = 576).
    input_layers: the dumped hidden layers an EAGLE-3 head reads, concatenated as `inputs`."""

    def __init__(self, shard_files: list[Path], input_layers: tuple[int, ...] = ()) -> None:
        self.shards: list[Shard] = [load_shard(p, tuple(input_layers)) for p in shard_files]
        self.index = [(s, j) for s, sh in enumerate(self.shards) for j in range(len(sh))]
        self.input_layers = tuple(input_layers)
        missing = [k for k in self.input_layers for sh in self.shards[:1] if k not in sh.hidden]
        if missing:
            raise ValueError(f"the feature dump holds no hidden states of layers {missing}: dump them "
                             "(another --out) for this head")

    def __len__(self) -> int:
        return len(self.index)

    def length(self, i: int) -> int:
        s, j = self.index[i]
        o = self.shards[s].offsets
        return o[j + 1] - o[j]

    def get(self, i: int) -> Sample:
        s, j = self.index[i]
        sh = self.shards[s]
        a, b = sh.offsets[j], sh.offsets[j + 1]
        inputs = torch.cat([sh.hidden[k][a:b] for k in self.input_layers], -1) if self.input_layers else None
        return Sample(sh.input_ids[a:b], sh.features[a:b], sh.loss_mask[a:b], inputs)


def make_batches(store: SampleStore, sample_ids: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches of about batch_tokens padded tokens, in a (seed, epoch) order."""
    rng = random.Random(seed * 1000003 + epoch)
    ids = list(sample_ids)
    rng.shuffle(ids)
    # Sort within windows of 64 so batches hold similar lengths (little padding) yet vary.
    windows = [sorted(ids[i:i + 64], key=store.length) for i in range(0, len(ids), 64)]
    batches, cur, cur_max = [], [], 0
    for w in windows:
        for i in w:
            n = store.length(i)
            if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(i)
            cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(store: SampleStore, ids: list[int], device) -> Batch:
    items = [store.get(i) for i in ids]
    t = max(x.tokens.numel() for x in items)
    h = items[0].features.shape[-1]
    tok = torch.zeros(len(items), t, dtype=torch.long)
    feat = torch.zeros(len(items), t, h, dtype=items[0].features.dtype)
    mask = torch.zeros(len(items), t, dtype=torch.bool)
    inputs = None
    if items[0].inputs is not None:
        inputs = torch.zeros(len(items), t, items[0].inputs.shape[-1], dtype=items[0].inputs.dtype)
    for r, x in enumerate(items):
        n = x.tokens.numel()
        tok[r, :n], feat[r, :n], mask[r, :n] = x.tokens, x.features, x.loss_mask
        if inputs is not None:
            inputs[r, :n] = x.inputs
    return Batch(tok.to(device), feat.to(device), mask.to(device), None if inputs is None else inputs.to(device))


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def atomic_torch_save(obj, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint as tensors and plain containers only (weights_only=True): a planted file
    in an output folder must not run code on --resume, as full unpickling would let it."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:  # OSError keeps its own message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: refused to resume from it: not a checkpoint eaglespec wrote (only tensors and "
                         f"plain data are loaded; {first}); delete it or use another --out") from None
    need = {"head", "optimizer", "noise_rng", "torch_rng", "python_rng", "state"}
    if not isinstance(saved, dict) or not need <= saved.keys():
        raise ValueError(f"{path}: refused to resume from it: not a checkpoint eaglespec wrote (missing "
                         f"{sorted(need - set(saved)) if isinstance(saved, dict) else 'everything'})")
    return saved


def python_rng_state() -> dict:
    """random's state as plain data (a tensor of its 625 words), so checkpoints need no pickle."""
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def set_python_rng_state(s) -> None:
    if isinstance(s, (tuple, list)):  # checkpoints written before the dict form: random.getstate() itself
        random.setstate((s[0], tuple(s[1]), s[2]))
    else:
        random.setstate((s["version"], tuple(s["internal"].tolist()), s["gauss"]))


def truncate_log(path: Path, step: int) -> None:
    """Keep log records up to `step`: on resume the later steps are taken again and logged anew."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass  # a line the kill cut off
    atomic_write_text(path, "".join(keep))


# Draft sharpness values the final evaluation tries (draft.parse_draft_sharpness): acceptance
# is flat near its best, and a few steps past 1 cover what heads trained here have needed.
SHARPNESS_GRID = (1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4)


@torch.no_grad()
def evaluate(head: DraftHead, target: Transformer, store: SampleStore, val_ids: list[int], steps: int = 5,
             scales: tuple[float, ...] = (1.0,)) -> dict:
    """Greedy n-alpha and, at T=1, a sampled chain draft's acceptance by depth (`sampled_alpha`,
    with the head's own q), on the validation samples. With more than one of `scales` (draft
    sharpness values, 1.0 among them) also the best of them by a chain's implied tau
    (`draft_sharpness`) and its acceptance (`sampled_alpha_sharp`)."""
    head.eval()
    total = None
    for i in val_ids:
        x, dev = store.get(i), target.device
        c = chain_accuracy(head, target, x.tokens.to(dev), x.features.to(dev), x.loss_mask.to(dev), steps,
                           None if x.inputs is None else x.inputs.to(dev), scales=scales)
        total = c if total is None else total.add(c)
    head.train()
    if total is None:
        return {}
    alphas = total.alphas()
    out = {"n_alpha": alphas, "implied_tau": implied_tau(alphas), "val_positions": total.totals[0]}
    if 1.0 in scales:
        out["sampled_alpha"] = total.sampled_alphas(scales.index(1.0))
    if len(scales) > 1:
        best = max(range(len(scales)), key=lambda j: implied_tau(total.sampled_alphas(j)))
        out["draft_sharpness"] = scales[best]
        out["sampled_alpha_sharp"] = total.sampled_alphas(best)
    return out


def use_autocast(mode: str, device: torch.device) -> bool:
    """TrainConfig.autocast -> whether the loss runs under bf16 autocast."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--autocast must be auto, on or off, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def train(head: DraftHead, target: Transformer, store: SampleStore, train_ids: list[int], val_ids: list[int],
          out: Path, cfg: TrainConfig, resume: bool = False, rank: int = 0, world: int = 1,
          progress: bool = True, head_extra: dict | None = None) -> TrainState:
    """Train `head` in place; checkpoints in out/checkpoint.pt, the final head in out/head/."""
    if not train_ids:  # refused before anything is written
        raise ValueError("no training samples (--val-fraction took them all, or the data has none)")
    if cfg.ttt_steps < 1:
        raise ValueError(f"--ttt-steps must be >= 1 (1 = the plain EAGLE-1/2 loss), got {cfg.ttt_steps}")
    device = target.device
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    head.train().requires_grad_(True)
    model = head
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(head)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    noise_gen = torch.Generator(device=device).manual_seed(cfg.seed * 7919 + rank)
    state = TrainState()
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.is_file():
        saved = load_checkpoint(ckpt)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        noise_gen.set_state(saved["noise_rng"][rank] if rank < len(saved["noise_rng"]) else saved["noise_rng"][0])
        torch.set_rng_state(saved["torch_rng"])
        set_python_rng_state(saved["python_rng"])
        state = TrainState(**saved["state"])
        if rank == 0:
            print(f"resumed from {ckpt}: step {state.step}, epoch {state.epoch}, batch {state.batch_in_epoch}")
    elif resume and rank == 0:
        print(f"--resume: no checkpoint at {ckpt}; starting from step 0", file=sys.stderr)
    n_batches = len(make_batches(store, train_ids, cfg.batch_tokens, cfg.seed, 0))
    per_epoch = n_batches // world
    if per_epoch == 0:
        raise ValueError(f"fewer training batches ({n_batches}) than processes ({world}): "
                         "use more data or a smaller --batch-tokens")
    total = cfg.max_steps or max(1, int(per_epoch * cfg.epochs))
    autocast = use_autocast(cfg.autocast, device)
    if rank == 0:  # steps logged after the checkpoint (before a kill) are retaken: log them once
        truncate_log(out / "log.jsonl", state.step)
    log = open(out / "log.jsonl", "a") if rank == 0 else None
    bar = tqdm(total=total, initial=state.step, desc="train", disable=not progress or rank != 0, dynamic_ncols=True)
    t0, tokens0 = time.perf_counter(), state.tokens_seen

    def checkpoint() -> None:
        rngs = [noise_gen.get_state()]
        if world > 1:  # every rank's noise state, so each resumes its own stream (a collective:
            gathered = [None] * world  # every rank must join it before rank 0 alone saves)
            torch.distributed.all_gather_object(gathered, noise_gen.get_state())
            rngs = gathered
        if rank != 0:
            return
        atomic_torch_save({"head": head.state_dict(), "optimizer": opt.state_dict(), "noise_rng": rngs,
                           "torch_rng": torch.get_rng_state(), "python_rng": python_rng_state(),
                           "state": asdict(state), "config": asdict(cfg)}, ckpt)

    while state.step < total:
        batches = make_batches(store, train_ids, cfg.batch_tokens, cfg.seed, state.epoch)
        mine = batches[rank::world][:per_epoch]
        while state.batch_in_epoch < len(mine) and state.step < total:
            batch = collate(store, mine[state.batch_in_epoch], device)
            for g in opt.param_groups:
                g["lr"] = lr_at(state.step, total, cfg)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                parts = eagle_loss(model, target, batch, cfg.w_cls, cfg.noise, noise_gen, cfg.ttt_steps,
                                   cfg.ttt_decay, cfg.w_reg, cfg.w_tv)
            opt.zero_grad(set_to_none=True)
            parts.total.backward()
            torch.nn.utils.clip_grad_value_(head.parameters(), cfg.clip_value)
            opt.step()
            state.step += 1
            state.batch_in_epoch += 1
            state.tokens_seen += int(batch.loss_mask.numel()) * world
            rec = {"step": state.step, "epoch": state.epoch, "loss": parts.total.item(), "reg": parts.reg.item(),
                   "cls": parts.cls.item(), "acc": float(parts.acc), "tv": float(parts.tv),
                   "lr": opt.param_groups[0]["lr"],
                   "tokens_per_s": (state.tokens_seen - tokens0) / max(1e-9, time.perf_counter() - t0)}
            if cfg.ttt_steps > 1 and parts.per_step is not None:  # each unrolled step's CE, top-1 and TV
                for col, name in ((1, "step_cls"), (2, "step_acc"), (3, "step_tv")):
                    rec[name] = [round(float(x), 4) for x in parts.per_step[:, col]]
            bar.update(1)
            bar.set_postfix(reg=f"{rec['reg']:.3f}", cls=f"{rec['cls']:.2f}", acc=f"{rec['acc']:.2f}",
                            tok_s=f"{rec['tokens_per_s']:.0f}")
            if cfg.eval_every and state.step % cfg.eval_every == 0 and rank == 0 and val_ids:
                rec.update(evaluate(head, target, store, val_ids[: cfg.eval_samples]))
                bar.write(f"step {state.step}: n-alpha {[round(a, 3) for a in rec['n_alpha']]}, "
                          f"implied tau {rec['implied_tau']:.2f}")
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            state.history.append({k: rec[k] for k in ("step", "loss", "reg", "cls", "acc")})
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                checkpoint()
        if state.batch_in_epoch >= len(mine):
            state.epoch += 1
            state.batch_in_epoch = 0
    bar.close()
    checkpoint()
    if rank == 0:
        final = evaluate(head, target, store, val_ids[: cfg.eval_samples], scales=SHARPNESS_GRID) if val_ids else {}
        head.eval()
        # The measured sharpness goes where load_head reads it: sampled chains then draw with it.
        sharp = {"draft_sharpness": final["draft_sharpness"]} if "draft_sharpness" in final else {}
        save_head(head, out / "head", dtype=torch.bfloat16,
                  extra={**(head_extra or {}), **sharp,
                         "train": {"steps": state.step, "tokens_seen": state.tokens_seen, **final}})
        atomic_write_text(out / "metrics.json", json.dumps({"steps": state.step, "tokens_seen": state.tokens_seen,
                                                            "seconds": time.perf_counter() - t0, **final}, indent=2))
        if log:
            log.close()
    return state
