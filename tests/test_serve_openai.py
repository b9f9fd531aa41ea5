"""The official openai client against `eaglespec serve` (in-process, loopback): chat and text
completions, streamed and whole, give exactly `eaglespec generate`'s answer (fp32; greedy and
seeded sampling), and the extra speculation fields come along without bothering the client."""

from __future__ import annotations

import json

import pytest
import requests

from eaglespec.cli import main
from serve_helpers import load_spec, running_server, sse_events

MAX = 24


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint_256):
    with running_server(load_spec(tiny_chat_checkpoint_256)) as srv:
        yield srv


def generate_cli(ckpt, prompt: str, capsys, *extra: str) -> dict:
    """`eaglespec generate --json` in this process: the reference answer."""
    argv = ["generate", "--model", str(ckpt), "--dtype", "fp32", "--prompt", prompt, "--json",
            "--max-new-tokens", str(MAX), *extra]
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["vanilla", "eagle2"])
def test_openai_client_equals_generate(server, tiny_chat_checkpoint_256, capsys, method):
    """Chat and completion, streamed and not: the text is `eaglespec generate`'s, token counts too."""
    client = server.client()
    prompt = "why is the sun big"
    extra = {"eaglespec": {"method": method}}
    cli_args = ("--method", method, "--draft", "random") if method != "vanilla" else ()
    ref_chat = generate_cli(tiny_chat_checkpoint_256, prompt, capsys, *cli_args)
    ref_raw = generate_cli(tiny_chat_checkpoint_256, prompt, capsys, "--no-chat", *cli_args)
    messages = [{"role": "user", "content": prompt}]

    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX, temperature=0,
                                           extra_body=extra)
    assert whole.choices[0].message.content == ref_chat["text"]
    assert whole.usage.completion_tokens == ref_chat["new_tokens"]
    assert whole.choices[0].finish_reason == ("length" if ref_chat["stop_reason"] == "max_new_tokens" else "stop")
    assert whole.model_extra["eaglespec"]["method"] == method

    pieces = []
    for chunk in client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX,
                                                temperature=0, stream=True, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == ref_chat["text"]

    text = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX, temperature=0,
                                     extra_body=extra)
    assert text.choices[0].text == ref_raw["text"]
    assert text.usage.completion_tokens == ref_raw["new_tokens"]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=prompt, max_tokens=MAX, temperature=0, stream=True, extra_body=extra)
        if c.choices)
    assert streamed == ref_raw["text"]


def test_seeded_sampling_and_stop_equal_generate(server, tiny_chat_checkpoint_256, capsys):
    client = server.client()
    prompt = "the cat sat on the mat"
    ref = generate_cli(tiny_chat_checkpoint_256, prompt, capsys, "--temperature", "0.9", "--top-k", "20",
                       "--top-p", "0.95", "--seed", "1234", "--method", "eagle2", "--draft", "random")
    got = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=MAX, temperature=0.9, top_p=0.95, seed=1234,
                                         extra_body={"top_k": 20, "eaglespec": {"method": "eagle2"}})
    assert got.choices[0].message.content == ref["text"]
    # A stop string taken from the answer itself: cut before it, finish_reason stop.
    words = ref["text"].split()
    stop = " " + words[3]
    ref_stop = generate_cli(tiny_chat_checkpoint_256, prompt, capsys, "--temperature", "0.9", "--top-k", "20",
                            "--top-p", "0.95", "--seed", "1234", "--stop", stop)
    got = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=MAX, temperature=0.9, top_p=0.95, seed=1234, stop=[stop],
                                         extra_body={"top_k": 20, "eaglespec": {"method": "vanilla"}})
    assert got.choices[0].message.content == ref_stop["text"]
    assert got.choices[0].finish_reason == "stop" and stop not in ref_stop["text"]


def test_stream_extras_usage_models_health(server):
    """The final chunk carries the speculation report, per-token provenance when asked for, and a
    usage chunk when stream_options asks; models and health answer."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "eaglespec": {"method": "eagle2", "total_tokens": 6, "depth": 2, "top_k": 3, "tokens": True}}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage, final = events[-2], events[-3]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    report = final["eaglespec"]
    assert final["choices"][0]["finish_reason"] == "length"
    assert report["method"] == "eagle2" and report["tree"] == {"total_tokens": 6, "depth": 2, "top_k": 3}
    assert report["steps"] >= 1 and report["tau"] == pytest.approx(11 / report["steps"], abs=1e-3)
    assert report["draft_tokens"] == report["steps"] * 5
    tokens = [t for e in events[1:-3] for t in e["eaglespec"]["tokens"]]
    assert len(tokens) == 12 and not tokens[0]["draft"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert "".join(t["text"] for t in tokens) == text

    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    health = requests.get(server.url + "/health", timeout=5).json()
    assert health == {"status": "ok", "running": 0, "waiting": 0}
    page = requests.get(server.url + "/", timeout=5)
    assert page.status_code == 200 and "eaglespec" in page.text


def test_next_chat_turn_reuses_the_history(server):
    """A chat's second turn (its history, then a new message) is admitted into the row that holds
    the first turn and prefills only what is new; usage says how much was reused."""
    client = server.client()
    messages = [{"role": "user", "content": "tell me about the moon"}]
    first = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and the sun?"}]
    second = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
