"""The server in-process for tests: uvicorn on an ephemeral loopback port in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import requests
import torch

from eaglespec.api import EagleSpec
from eaglespec.serve.app import ServeSettings, create_app

# Prompts of the tiny word-level model (tests/conftest.py WORDS): every word is one token.
PROMPTS = ["hello world", "the cat sat on the mat", "red blue green", "one two three four five six",
           "why is the sun big", "where is the river", "a dog and a bird", "up down left right yes no"]


def load_spec(checkpoint, draft: str | None = "random") -> EagleSpec:
    spec = EagleSpec.load(str(checkpoint), dtype="fp32")
    if draft is not None:
        spec.set_draft(draft)
    return spec


@dataclass
class Server:
    url: str
    app: object
    spec: EagleSpec
    server: object
    thread: threading.Thread

    @property
    def model(self) -> str:
        return self.app.state.settings.model_name

    @property
    def worker(self):
        return self.app.state.worker

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                      timeout=kw.pop("timeout", 30.0), **kw)


@contextlib.contextmanager
def running_server(spec: EagleSpec, **settings):
    """Serve `spec` until the block ends; yields a Server. One intra-op thread (tiny models)."""
    import uvicorn

    settings.setdefault("model_name", spec.source.name)
    app = create_app(spec, ServeSettings(**settings))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Server(url, app, spec, server, thread)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        torch.set_num_threads(old_threads)


def sse_events(response: requests.Response) -> list[dict | str]:
    """Parsed `data:` payloads of a streamed response ('[DONE]' kept as the string)."""
    import json

    out = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_samples(text: str) -> dict[tuple, float]:
    """Prometheus text -> {(name, sorted labels...): value}; parsing it is part of the check."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def oracle_engine(spec: EagleSpec, p_oracle: float = 0.7, noise: float = 0.1, seed: int = 0, memo: bool = False):
    """Swap the spec's engine for one whose drafts are often the target's own tokens (a random head
    on a tiny model drafts nothing acceptable), so accepted drafts show in streams and metrics.
    Call before the server starts: the server drives whatever `spec.engine` is then. With
    p_oracle 1, noise 0 and memo, a row's drafts depend on its context only (not on its batch), so
    seeded sampling gives the same answer alone and in a batch, as with a real head."""
    from spec_helpers import OracleProposer, RecordingEngine

    spec.engine = RecordingEngine(
        spec.target, spec.head, eos_ids=spec.tokenizer.eos_token_ids, decode=spec.tokenizer.decode,
        proposer=lambda head, target, tree: OracleProposer(head, target, tree, seed, p_oracle, noise, memo))
    return spec
