"""Target features for training, dumped once to sharded safetensors.

A shard holds the samples [i * shard_size, (i + 1) * shard_size) concatenated:
  input_ids [T] int32, loss_mask [T] uint8, features [T, H] bf16 (the hidden state entering the
  LM head), offsets [n + 1] int64, and optionally hidden_{layer} [T, H] for EAGLE-3.
Shards are written atomically, so a rerun (or another rank) skips the finished ones and a kill
between or inside shards loses at most the shard in progress. A finished shard is kept only if it
holds exactly the samples it should (tokens, masks, lengths): a dump for a grown dataset (a larger
--max-conversations) keeps every shard it shares with the smaller one and redoes the rest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..files import pin_settings, remove_stale_temps
from ..model import Transformer
from ..weights import atomic_save_safetensors
from .data import TokenizedSample

MANIFEST = "manifest.json"
COUNTS = ("samples", "tokens")  # manifest keys a grown dataset may change (the shards are checked)


@dataclass
class DumpReport:
    shards_total: int
    shards_written: int
    shards_skipped: int
    shards_replaced: int  # finished shards that held other samples (a dataset that changed), redone
    tokens_written: int
    seconds: float
    bytes_on_disk: int
    total_tokens: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_on_disk / max(1, self.total_tokens)

    def summary(self) -> str:
        rate = self.tokens_written / self.seconds if self.seconds > 0 else 0.0
        redone = f", {self.shards_replaced} redone for changed samples" if self.shards_replaced else ""
        return (f"features: {self.shards_total} shards ({self.shards_skipped} already done{redone}), "
                f"{self.tokens_written:,} tokens dumped in {self.seconds:.0f} s ({rate:.0f} tokens/s); "
                f"disk {self.bytes_on_disk / 2**20:.1f} MiB = {self.bytes_per_token:.0f} bytes/token")


@dataclass
class Shard:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool
    features: torch.Tensor  # [T, H]
    offsets: list[int]  # [n + 1]
    hidden: dict[int, torch.Tensor]

    def __len__(self) -> int:
        return len(self.offsets) - 1


def shard_path(out: Path, i: int) -> Path:
    return out / f"shard_{i:05d}.safetensors"


def write_manifest(out: Path, info: dict) -> None:
    """Record what the features were made from; refuse to mix dumps made differently."""
    out.mkdir(parents=True, exist_ok=True)
    pin_settings(out / MANIFEST, info, f"{out} holds features made with other settings; use another --out "
                 "directory or delete it; they differ in", counts=COUNTS)


def shard_holds(path: Path, chunk: list[TokenizedSample]) -> bool:
    """Whether the finished shard at `path` holds exactly these samples (reads only its token
    tensors, not the features)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return False
    want_offsets = [0]
    for s in chunk:
        want_offsets.append(want_offsets[-1] + len(s))
    try:
        with safe_open(str(path), "pt") as f:
            if f.get_tensor("offsets").tolist() != want_offsets:
                return False
            ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
    except (SafetensorError, OSError):  # unreadable: redo it
        return False
    return (ids.tolist() == [t for s in chunk for t in s.input_ids]
            and mask.tolist() == [m for s in chunk for m in s.loss_mask])


@torch.inference_mode()
def target_features(target: Transformer, ids: list[int], hidden_layers: tuple[int, ...] = ()):
    """One causal forward over a whole sample -> (features [T, H], {layer: [T, H]})."""
    t = len(ids)
    cache = target.new_cache(t)
    tok = torch.tensor(ids, device=target.device)[None]
    out = target(tok, torch.arange(t, device=target.device)[None], cache, logits_for="none",
                 hidden_layers=hidden_layers)
    return out.features[0], {k: v[0] for k, v in out.hidden.items()}


def dump_features(target: Transformer, samples: list[TokenizedSample], out: Path, shard_size: int = 64,
                  rank: int = 0, world: int = 1, hidden_layers: tuple[int, ...] = (),
                  progress: bool = True) -> DumpReport:
    hidden_layers = tuple(dict.fromkeys(hidden_layers))  # a shallow target's EAGLE-3 layers may repeat
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # half-written shards of a killed run (other ranks' live ones are locked)
    n_shards = (len(samples) + shard_size - 1) // shard_size
    mine = [i for i in range(n_shards) if i % world == rank]
    def chunk(i: int) -> list[TokenizedSample]:
        return samples[i * shard_size:(i + 1) * shard_size]

    todo = [i for i in mine if not shard_holds(shard_path(out, i), chunk(i))]
    replaced = sum(shard_path(out, i).is_file() for i in todo)
    todo_tokens = sum(len(s) for i in todo for s in chunk(i))
    t0 = time.perf_counter()
    written = 0
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc=f"features (rank {rank})",
               disable=not progress or not todo, dynamic_ncols=True)
    for i in todo:
        feats, ids, masks, offsets = [], [], [], [0]
        hid: dict[int, list[torch.Tensor]] = {h: [] for h in hidden_layers}
        for s in chunk(i):
            f, h = target_features(target, s.input_ids, hidden_layers)
            feats.append(f.to(torch.bfloat16).cpu())
            for k in hidden_layers:
                hid[k].append(h[k].to(torch.bfloat16).cpu())
            ids.append(torch.tensor(s.input_ids, dtype=torch.int32))
            masks.append(torch.tensor(s.loss_mask, dtype=torch.uint8))
            offsets.append(offsets[-1] + len(s))
            bar.update(len(s))
        tensors = {"input_ids": torch.cat(ids), "loss_mask": torch.cat(masks), "features": torch.cat(feats),
                   "offsets": torch.tensor(offsets, dtype=torch.int64)}
        for k in hidden_layers:
            tensors[f"hidden_{k}"] = torch.cat(hid[k])
        atomic_save_safetensors(tensors, shard_path(out, i), {"format": "pt"})
        written += offsets[-1]
    bar.close()
    all_files = [shard_path(out, i) for i in range(n_shards)]
    size = sum(p.stat().st_size for p in all_files if p.is_file())
    total = sum(len(s) for s in samples)
    return DumpReport(n_shards, len(todo), len(mine) - len(todo), replaced, written, time.perf_counter() - t0,
                      size, total)


def load_shard(path: Path, hidden_layers: tuple[int, ...] | None = None) -> Shard:
    """Read a shard; of its hidden states only `hidden_layers` (None: all), so a head that reads
    fewer layers than the store holds does not pay memory for the rest."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        names = [k for k in f.keys() if not k.startswith("hidden_")
                 or hidden_layers is None or int(k.split("_")[1]) in hidden_layers]
        d = {k: f.get_tensor(k) for k in names}
    hidden = {int(k.split("_")[1]): v for k, v in d.items() if k.startswith("hidden_")}
    return Shard(d["input_ids"].long(), d["loss_mask"].bool(), d["features"], d["offsets"].tolist(), hidden)


def layers_to_dump(feat_dir: Path, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The hidden layers a dump into `feat_dir` writes: the head's, or those the store already
    holds when they include the head's (a store made for an EAGLE-3 head also serves an EAGLE-1/2
    head, or one fusing fewer layers, instead of being refused as made with other settings)."""
    manifest = feat_dir / MANIFEST
    if manifest.is_file():
        held = tuple(json.loads(manifest.read_text()).get("hidden_layers", []))
        if set(layers) <= set(held):
            return held
    return layers

