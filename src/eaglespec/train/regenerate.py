"""Self-distilled training data: every assistant turn rewritten by the target itself.

A head trained on the target's own answers sees the distribution it will draft at inference.
`regenerate` runs many conversations at once through the engine (one batched decode step for up
to `batch` answers, continuous batching as answers finish), greedy or sampled, and appends each
finished conversation to a jsonl file that `eaglespec train --data` reads back (OpenAI messages
records with the original id). A killed run resumes where it stopped: finished conversations are
kept, a line cut by the kill is dropped, and the settings must match the first run's (a sidecar
`.meta.json`). Sampled answers draw from a seed per (seed, conversation, turn), so their text does
not depend on which conversations share a batch or on where a run was resumed.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..config import SamplingConfig
from ..files import atomic_write_text, pin_settings
from .data import Conversation, DataError


@dataclass
class RegenConfig:
    """How answers are made. temperature 0: greedy."""

    max_new_tokens: int = 512  # per answer
    max_length: int = 1024  # tokens per conversation: later turns are dropped past it
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch: int = 32  # answers decoded together

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_length", "batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise DataError(f"regenerate: {name} must be a positive int, got {getattr(self, name)!r}")
        if not 0 <= self.temperature <= 10:
            raise DataError(f"regenerate: temperature must be in [0, 10], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DataError(f"regenerate: top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RegenReport:
    conversations: int  # written to the file in total (this run and earlier ones)
    resumed: int  # already there when this run started
    dropped: int  # first prompt longer than max_length: nothing to answer
    answers: int  # answers made by this run
    tokens: int  # answer tokens made by this run
    seconds: float
    stop_reasons: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # prompt tokens of this run's answers (each turn's whole history)
    cached_tokens: int = 0  # of those, not prefilled: the conversation's row still held them

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(self.stop_reasons.items()))
        return (f"regenerate: {self.conversations:,} conversations in the file ({self.resumed:,} from an earlier run, "
                f"{self.dropped:,} dropped: first prompt too long); {self.answers:,} answers, {self.tokens:,} tokens "
                f"in {self.seconds:.0f} s ({rate:.0f} tokens/s){'; ' + reasons if reasons else ''}; prompt tokens "
                f"{self.prompt_tokens:,}, {self.cached_tokens / max(self.prompt_tokens, 1):.0%} reused from the turn before")


def turn_seed(seed: int, key: str, turn: int) -> int:
    """A 62-bit seed per (run seed, conversation, turn), stable across processes and batches."""
    h = hashlib.blake2b(f"{seed}\x00{key}\x00{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


def _keys(convs: list[Conversation]) -> list[str]:
    """A unique key per conversation: its id (position when it has none), made unique."""
    seen: dict[str, int] = {}
    out = []
    for i, c in enumerate(convs):
        k = c.id if c.id is not None else str(i)
        n = seen.get(k, 0)
        seen[k] = n + 1
        out.append(k if n == 0 else f"{k}#{n}")
    return out


def _read_done(path: Path) -> dict[str, dict]:
    """Finished records of an earlier run; a line cut by a kill is dropped (the file is rewritten
    without it, so appended records start on a line of their own)."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    raw = path.read_bytes()
    good, bad = [], 0
    # Records end at "\n" only: str.splitlines() would also cut at U+2028 and other separators
    # that json.dumps(ensure_ascii=False) leaves raw inside a string (ShareGPT has them).
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if not line:
            continue
        try:
            rec = json.loads(line)
            done[rec["id"]] = rec
            good.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            bad += 1
    if bad or (raw and not raw.endswith(b"\n")):
        atomic_write_text(path, "".join(x + "\n" for x in good))
    return done


def _check_meta(path: Path, meta: dict) -> None:
    """Refuse to append answers made with other settings to an existing file."""
    side = path.with_name(path.name + ".meta.json")
    if not side.is_file() and path.is_file() and path.stat().st_size > 0:
        raise DataError(f"{path} exists but has no {side.name}: not a file `regenerate` wrote; use another output file")
    pin_settings(side, meta, f"{path} holds answers made with other settings; use another output file or "
                 "delete it and its .meta.json; they differ in", DataError)


class _Chat:
    """One conversation being rewritten: its original turns and the answers so far."""

    def __init__(self, key: str, conv: Conversation) -> None:
        self.key, self.source = key, conv.messages
        self.messages: list[dict[str, str]] = []
        self.next = 0  # index into source of the next turn to copy or answer
        self.stops: list[str] = []

    def advance(self) -> bool:
        """Copy turns up to the next assistant turn; False when none is left."""
        while self.next < len(self.source) and self.source[self.next]["role"] != "assistant":
            self.messages.append(dict(self.source[self.next]))
            self.next += 1
        return self.next < len(self.source)

    def record(self, sampling: dict) -> dict:
        return {"id": self.key, "messages": self.messages,
                "regenerated": {"answers": len(self.stops), "stop_reasons": self.stops, **sampling}}


def regenerate(es, convs: list[Conversation], out: Path, cfg: RegenConfig | None = None,
               progress: bool = True) -> RegenReport:
    """Rewrite every assistant turn of `convs` with the target of `es` (an EagleSpec) into `out`."""
    from ..runtime.engine import Engine, Request

    cfg = cfg or RegenConfig()
    tok = es.tokenizer
    if not tok.has_chat_template:
        raise DataError("regenerate needs a model with a chat template")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": es.source.name, "dtype": str(es.target.dtype), "quant": getattr(es.target, "quant", "none"),
            **{k: v for k, v in asdict(cfg).items() if k != "batch"}}
    _check_meta(out, meta)
    done = _read_done(out)
    keys = _keys(convs)
    todo = deque(_Chat(k, c) for k, c in zip(keys, convs) if k not in done)
    report = RegenReport(len(done), len(done), 0, 0, 0, 0.0)
    sampling_info = {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}
    engine = Engine(es.target, None, eos_ids=tok.eos_token_ids, decode=tok.decode, max_batch=cfg.batch)
    running: dict[int, tuple[_Chat, Request]] = {}
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress or not todo, dynamic_ncols=True)

    def submit(chat: _Chat) -> bool:
        """Queue the chat's next answer; False when the chat is finished (written or dropped)."""
        if chat.advance():
            ids = tok.encode_chat(chat.messages)
            room = cfg.max_length - len(ids)
            if room > 0:
                sampling = SamplingConfig() if cfg.temperature == 0 else SamplingConfig(
                    cfg.temperature, 0, cfg.top_p, turn_seed(cfg.seed, chat.key, len(chat.stops)))
                req = engine.submit(Request(ids, "vanilla", None, sampling, min(cfg.max_new_tokens, room)))
                running[req.id] = (chat, req)
                return True
        # Finished: the turns after the last answer carry no loss; a chat with no answer is dropped.
        while chat.messages and chat.messages[-1]["role"] != "assistant":
            chat.messages.pop()
        if chat.stops:
            f.write(json.dumps(chat.record(sampling_info), ensure_ascii=False) + "\n")
            f.flush()
            report.conversations += 1
        else:
            report.dropped += 1
        bar.update(1)
        return False

    with open(out, "a", encoding="utf-8") as f:
        while todo or running:
            while todo and len(running) < cfg.batch:
                submit(todo.popleft())
            if not running:
                continue
            engine.step()
            for rid in [r for r, (_, q) in running.items() if q.done]:
                chat, req = running.pop(rid)
                if req.error is not None:
                    raise req.error
                ids = [t for t in req.pending_tokens if t not in tok.eos_token_ids]
                chat.messages.append({"role": "assistant", "content": tok.decode(ids)})
                chat.stops.append(req.stats.stop_reason)
                chat.next += 1
                report.answers += 1
                report.tokens += req.stats.new_tokens
                report.prompt_tokens += len(req.prompt_ids)
                report.cached_tokens += req.stats.cached_tokens
                report.stop_reasons[req.stats.stop_reason] = report.stop_reasons.get(req.stats.stop_reason, 0) + 1
                submit(chat)
            report.seconds = time.perf_counter() - t0
            bar.set_postfix(tok_s=f"{report.tokens / max(report.seconds, 1e-9):.0f}")
    bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def load_regenerated(path: Path, convs: list[Conversation]) -> list[Conversation]:
    """The rewritten conversations for `convs`, in their order (those dropped are left out)."""
    done = _read_done(Path(path))
    return [Conversation(messages=done[k]["messages"], id=c.id) for k, c in zip(_keys(convs), convs) if k in done]
