"""What one request carries on the host: its stop rules, its statistics and its limits.

Shared by the engine (runtime/engine.py) and the reference decode loop (generate.py), so tau,
stop reasons and context checks are defined once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def tau(new_tokens: int, steps: int) -> float:
    """Acceptance length: new tokens per draft-verify step, bonus included (vanilla: 1.00). The
    first token comes from the prefill and is not part of any step. 0.0 before any step."""
    return (new_tokens - 1) / steps if steps else 0.0


class GenerationError(ValueError):
    """A request that cannot run (too long for the context, bad limits)."""


@dataclass
class GenerationStats:
    steps: int = 0  # target forwards after the prefill (= draft-verify cycles)
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per step, bonus included
    accepted_per_depth: list[int] = field(default_factory=list)  # [d]: steps that accepted a depth-(d+1) draft
    tree_sizes: list[int] = field(default_factory=list)
    new_tokens: int = 0
    stop_reason: str = ""  # eos | stop_string | max_new_tokens | context_full
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from the row's previous request
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tau(self) -> float:
        """See `tau` (accept_lengths hold each step's emitted tokens, so they sum to new_tokens - 1)."""
        return tau(1 + sum(self.accept_lengths), len(self.accept_lengths))

    def record_step(self, emitted: int, accepted: int, tree_size: int, draft_s: float, verify_s: float) -> None:
        """One draft-verify step: `emitted` tokens streamed (cut at a stop), `accepted` drafts
        the target accepted (not cut: acceptance is measured on the step as verified)."""
        self.steps += 1
        self.accept_lengths.append(emitted)
        self.tree_sizes.append(tree_size)
        for d in range(accepted):
            if d >= len(self.accepted_per_depth):
                self.accepted_per_depth.append(0)
            self.accepted_per_depth[d] += 1
        self.draft_s += draft_s
        self.verify_s += verify_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


class StopChecker:
    """EOS ids, stop strings and the token budget, checked one token at a time."""

    def __init__(self, eos_ids: list[int], stop_strings: list[str], max_new_tokens: int | None, decode=None) -> None:
        if stop_strings and decode is None:
            raise GenerationError("stop strings need a tokenizer to decode with")
        self.eos = set(eos_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.max_new = max_new_tokens
        self.decode = decode
        self.tokens: list[int] = []

    def push(self, token: int) -> str:
        """Record a token; return the stop reason it causes, or ''."""
        self.tokens.append(token)
        if token in self.eos:
            return "eos"
        if self.stop_strings:
            # Decoding a tail window is enough: a stop string ends in the newest token.
            tail = self.decode(self.tokens[-32:])
            if any(s in tail for s in self.stop_strings):
                return "stop_string"
        if self.max_new is not None and len(self.tokens) >= self.max_new:
            return "max_new_tokens"
        return ""


def cut_at_stop_string(text: str, stop_strings: list[str]) -> str:
    """The text before the earliest stop string (stop strings are not part of the answer)."""
    cut = min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def check_request(window: int, n: int, max_new_tokens: int | None) -> None:
    """Refuse a request that cannot fit the context window, with what to change."""
    if n == 0:
        raise GenerationError("empty prompt")
    if n >= window:
        raise GenerationError(f"prompt of {n} tokens does not fit the context window of {window} tokens")
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if n + max_new_tokens > window:
            raise GenerationError(
                f"prompt of {n} tokens + max_new_tokens {max_new_tokens} exceeds the context window of "
                f"{window} tokens; lower --max-new-tokens to at most {window - n}")


def check_text(text: str, what: str = "prompt", empty_ok: bool = False) -> None:
    """Refuse text no tokenizer can take: lone surrogates, which is how Python carries invalid
    UTF-8 bytes (command-line arguments, surrogateescape) and JSON's unpaired \\ud800 escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        bad = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        raise GenerationError(f"{what} is not valid UTF-8 text ({bad} at character {e.start})") from None
    if not empty_ok and not text.strip():
        # Refused in chat and raw mode alike (a chat template would otherwise hide the emptiness).
        raise GenerationError(f"{what} is empty")
