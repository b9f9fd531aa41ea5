"""Bad input gets its status code and an OpenAI-style error body, and the server keeps serving;
the API key; the command line; SIGTERM stops the server cleanly (a real process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from eaglespec.cli import main
from serve_helpers import load_spec, running_server

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint_256):
    with running_server(load_spec(tiny_chat_checkpoint_256)) as srv:
        yield srv


def chat(model, **kw) -> dict:
    # Greedy: at the API's default temperature (1.0) a random tiny model sometimes samples its end
    # token early, and a test counting completion tokens would fail by chance.
    return {"model": model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4,
            "temperature": 0, **kw}


LONG = " ".join(["one two three four five"] * 60)  # 300 words: 300 tokens, over the 256-token window
# (name, endpoint, body (a dict, or raw bytes), status, param, code)
BAD = [
    ("malformed json", "chat", b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("not an object", "chat", b"[1, 2]", 400, None, "invalid_json"),
    ("not utf-8", "chat", b'{"model": "\xff"}', 400, None, "invalid_json"),
    ("missing messages", "chat", {"messages": ...}, 400, "messages", "invalid_value"),
    ("missing model", "chat", {"model": ...}, 400, "model", "invalid_value"),
    ("messages wrong type", "chat", {"messages": "hello"}, 400, "messages", "invalid_value"),
    ("empty messages", "chat", {"messages": []}, 400, "messages", "invalid_value"),
    ("bad role", "chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", "invalid_value"),
    ("content wrong type", "chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content",
     "invalid_value"),
    ("lone surrogate", "chat", {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages", None),
    ("max_tokens string", "chat", {"max_tokens": "10"}, 400, "max_tokens", "invalid_value"),
    ("max_tokens zero", "chat", {"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("max_tokens bool", "chat", {"max_tokens": True}, 400, "max_tokens", "invalid_value"),
    ("max_tokens over the window", "chat", {"max_tokens": 1000}, 400, "max_tokens", "context_length_exceeded"),
    ("temperature negative", "chat", {"temperature": -1}, 400, "temperature", "invalid_value"),
    ("temperature string", "chat", {"temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("top_p over 1", "chat", {"top_p": 2}, 400, "top_p", "invalid_value"),
    ("seed negative", "chat", {"seed": -3}, 400, "seed", "invalid_value"),
    ("n 2", "chat", {"n": 2}, 400, "n", "invalid_value"),
    ("stream not bool", "chat", {"stream": "yes"}, 400, "stream", "invalid_value"),
    ("stop wrong type", "chat", {"stop": 7}, 400, "stop", "invalid_value"),
    ("logprobs", "chat", {"logprobs": True}, 400, "logprobs", "invalid_value"),
    ("unknown method", "chat", {"eaglespec": {"method": "medusa"}}, 400, "eaglespec.method", "invalid_value"),
    ("unknown eaglespec field", "chat", {"eaglespec": {"mehtod": "eagle2"}}, 400, "eaglespec.mehtod",
     "invalid_value"),
    ("tree sizes with vanilla", "chat", {"eaglespec": {"method": "vanilla", "depth": 3}}, 400, "eaglespec", None),
    ("tree too big", "chat", {"eaglespec": {"method": "eagle2", "total_tokens": 5000}}, 400,
     "eaglespec.total_tokens", "invalid_value"),
    ("prompt over the window", "chat", {"messages": [{"role": "user", "content": LONG}], "max_tokens": None}, 400,
     "messages", "context_length_exceeded"),
    ("unknown model", "chat", {"model": "gpt-9"}, 404, "model", "model_not_found"),
    ("completion prompt over the window", "completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("completion token ids out of range", "completions", {"prompt": [1, 2, 99999]}, 400, "prompt", None),
    ("completion two prompts", "completions", {"prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ("completion echo", "completions", {"prompt": "hi", "echo": True}, 400, "echo", "invalid_value"),
]


@pytest.mark.parametrize("name,endpoint,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(server, name, endpoint, body, status, param, code):
    url = server.url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    if isinstance(body, dict):
        base = chat(server.model) if endpoint == "chat" else {"model": server.model, "prompt": "hi", "max_tokens": 4}
        body = json.dumps({k: v for k, v in {**base, **body}.items() if v is not ...}).encode()  # ...: left out
    r = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 and code is None else "invalid_request_error")
    assert err["param"] == param and err["code"] == code, err


def test_server_keeps_serving_after_bad_input(server):
    """After all of the above (and unknown fields of any type, which are ignored), it still answers."""
    r = requests.post(server.url + "/v1/chat/completions", timeout=10,
                      json=chat(server.model, frobnicate={"x": [1]}, user=None, presence_penalty=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert requests.get(server.url + "/v1/nothing", timeout=5).status_code == 404
    r = requests.get(server.url + "/v1/chat/completions", timeout=5)
    assert r.status_code == 405 and r.json()["error"]["message"]
    assert requests.get(server.url + "/health", timeout=5).json()["status"] == "ok"

    def rejected() -> float:
        lines = [line for line in requests.get(server.url + "/metrics", timeout=5).text.splitlines()
                 if line.startswith("eaglespec:requests_total{") and 'status="rejected"' in line]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = rejected()
    assert requests.post(server.url + "/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=5).status_code == 404
    assert rejected() == before + 1


def test_api_key(tiny_chat_checkpoint_256):
    import openai

    with running_server(load_spec(tiny_chat_checkpoint_256, draft=None), api_key="sekrit") as srv:
        url = srv.url + "/v1/chat/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = requests.post(url, json=chat(srv.model), headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(srv.url + "/v1/models", timeout=5).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        out = srv.client(api_key="sekrit").chat.completions.create(model=srv.model, max_tokens=3, temperature=0,
                                                                    messages=[{"role": "user", "content": "hi"}])
        assert out.usage.completion_tokens == 3
        # Without a head, speculative methods are refused, not crashed on.
        r = requests.post(url, json=chat(srv.model, eaglespec={"method": "eagle2"}), timeout=10,
                          headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 400 and "draft head" in r.json()["error"]["message"]
        assert requests.get(srv.url + "/health", timeout=5).status_code == 200  # open, as vLLM's
        assert requests.get(srv.url + "/metrics", timeout=5).status_code == 200


@pytest.mark.parametrize("argv,needle", [
    (["--total-tokens", "4"], "--total-tokens"),
    (["--port", "70000"], "--port"),
    (["--max-batch", "0"], "--max-batch"),
])
def test_cli_refuses_bad_options(argv, needle, capsys):
    assert main(["serve", "--model", "nonexistent-model", *argv]) == 2
    assert needle in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_and_exits(tiny_chat_checkpoint_256, tmp_path):
    """A real `python -m eaglespec.serve` process: SIGTERM while a stream runs lets it finish,
    refuses new connections, and the process exits 0."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "eaglespec.serve", "--model", str(tiny_chat_checkpoint_256),
                             "--dtype", "fp32", "--draft", "random", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.2)
        model = requests.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 200,
                "temperature": 0, "stream": True, "eaglespec": {"method": "eagle2"}}
        events: list = []
        first = threading.Event()

        def stream():
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
                for line in r.iter_lines(decode_unicode=True):
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert not t.is_alive()
        assert events[-1] == "[DONE]"  # the stream in flight was finished, not cut
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] in ("length", "stop")
        assert proc.wait(30) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
