"""The HTTP routes: OpenAI chat and text completions (streamed as server-sent events or whole),
models, health, metrics and the chat page.

Handlers only check, tokenise and turn tokens into OpenAI bodies; every token comes from the
engine, through the worker (worker.py). Every refusal is an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import Detokenizer, EagleSpec
from ..config import SamplingConfig, TreeConfig
from ..runtime.engine import Request
from .metrics import ServerMetrics
from .schemas import ApiError, ChatCompletionRequest, CompletionRequest, SpecOptions
from .worker import EngineWorker, Job, QueueFull

TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context_full": "length"}


@dataclass
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 128  # requests waiting for a row beyond this are answered 429
    max_lanes: int = 4  # speculation settings kept allocated at once (idle ones are dropped)
    method: str = "vanilla"  # for requests that do not name one
    tree: TreeConfig | None = None  # the server's tree for its default method
    max_body_bytes: int = 4 << 20


def create_app(spec: EagleSpec, settings: ServeSettings) -> FastAPI:
    """An app serving `spec`'s engine; the engine thread runs while the app's lifespan does."""
    metrics = ServerMetrics(settings.model_name)
    worker = EngineWorker(spec.engine, metrics, settings.max_waiting, settings.max_lanes)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        worker.start()
        yield
        worker.stop()  # after the server stopped taking requests and drained (or timed out)

    app = FastAPI(title="eaglespec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.spec, app.state.settings = worker, metrics, spec, settings
    window = spec.target.config.max_position_embeddings
    vocab = spec.target.config.vocab_size

    @app.exception_handler(ApiError)
    async def _api_error(_req, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(err.status_code, str(err.detail), kind).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal(_req, err: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}", "server_error").body(),
                            status_code=500)

    def authorise(http: HttpRequest) -> None:
        if settings.api_key is None:
            return
        header = http.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", code="invalid_api_key")

    async def read_body(http: HttpRequest, model_cls):
        raw = bytearray()
        async for part in http.stream():
            raw += part
            if len(raw) > settings.max_body_bytes:
                raise ApiError(413, f"the body is larger than {settings.max_body_bytes} bytes")
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
        try:
            return model_cls.model_validate(obj)
        except ValidationError as e:
            first = e.errors()[0]
            # A union's members show in the location ('stop', 'str'): keep field names and indices only.
            loc = [str(x) for x in first["loc"] if isinstance(x, int) or x not in TYPE_TAGS and "[" not in x]
            param = ".".join(loc) or None
            raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                           code="invalid_value") from None

    def decoding(opts: SpecOptions | None, temperature: float) -> tuple[str, TreeConfig | None]:
        """The method and tree of a request: its own `eaglespec` field over the server's defaults
        (whose tree depends on whether the request samples: Engine.default_tree)."""
        opts = opts or SpecOptions()
        method = opts.method or settings.method
        sizes = {k: v for k in ("total_tokens", "depth", "top_k") if (v := getattr(opts, k)) is not None}
        if sizes and method != "eagle2":
            raise ApiError(400, f"eaglespec: tree sizes apply to method eagle2 only, not {method}", param="eaglespec")
        if method == "vanilla":
            return method, None
        if spec.head is None:
            raise ApiError(400, f"method {method} needs a draft head; this server has none (start it with --draft)",
                           param="eaglespec.method")
        base = settings.tree if settings.tree is not None and settings.tree.method == method else \
            spec.engine.default_tree(method, temperature)
        if not sizes:
            return method, base
        return method, TreeConfig("eagle2", total_tokens=sizes.get("total_tokens", base.total_tokens),
                                  depth=sizes.get("depth", base.depth), top_k=sizes.get("top_k", base.top_k))

    def build(body, ids: list[int], prompt_param: str) -> Request:
        if body.model != settings.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")
        method, tree = decoding(body.eaglespec, body.temperature)
        n, budget = len(ids), body.token_budget()
        if n == 0:
            raise ApiError(400, "the prompt is empty", param=prompt_param)
        if n >= window:
            raise ApiError(400, f"the prompt has {n} tokens; this model's context window is {window} tokens",
                           param=prompt_param, code="context_length_exceeded")
        if budget is not None and n + budget > window:
            raise ApiError(400, f"max_tokens {budget} is too large: the prompt has {n} tokens and the context window "
                           f"is {window}; ask for at most {window - n}", param="max_tokens",
                           code="context_length_exceeded")
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        sampling = SamplingConfig(body.temperature, top_k, body.top_p, body.seed)
        return Request(ids, method, tree, sampling, budget, body.stop_strings())

    def submit(req: Request) -> Job:
        if not worker.alive:
            raise ApiError(503, "the engine is not running", "server_error")
        try:
            return worker.submit(req, asyncio.get_running_loop())
        except QueueFull as e:
            raise ApiError(429, f"too many requests waiting: {e}; retry later", "rate_limit_error",
                           code="rate_limit_exceeded") from None

    def encode(call, param: str) -> list[int]:
        try:
            return call()
        except (TypeError, ValueError) as e:  # GenerationError, ConfigError, ModelLoadError are ValueErrors
            raise ApiError(400, str(e), param=param) from None

    async def generate(http: HttpRequest, chat: bool):
        try:
            authorise(http)
            if chat:
                body = await read_body(http, ChatCompletionRequest)
                messages = [m.as_dict() for m in body.messages]
                ids = encode(lambda: spec.encode(messages, chat=True)[1], "messages")
            else:
                body = await read_body(http, CompletionRequest)
                if isinstance(body.prompt, str):
                    ids = encode(lambda: spec.encode(body.prompt, chat=False)[1], "prompt")
                else:
                    if any(not 0 <= t < vocab for t in body.prompt):
                        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
                    ids = list(body.prompt)
            req = build(body, ids, "messages" if chat else "prompt")
            job = submit(req)
        except ApiError:
            metrics.rejected()
            raise
        answer = Answer(job, chat, settings.model_name, spec.tokenizer.decode, body.stop_strings(),
                        bool(body.eaglespec and body.eaglespec.tokens))
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(answer.events(worker, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await answer.whole(worker, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await generate(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await generate(http, chat=False)

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        authorise(http)
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "eaglespec", "max_model_len": window,
                                            "speculative": spec.head is not None}]}

    @app.get("/health")
    async def health():
        if not worker.alive:
            why = "" if worker.failure is None else f": {type(worker.failure).__name__}: {worker.failure}"
            return JSONResponse({"status": "engine stopped" + why}, status_code=503)
        running, waiting = worker.counts()
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    page = resources.files("eaglespec.serve").joinpath("page/index.html").read_text(encoding="utf-8")

    @app.get("/")
    async def index():
        return HTMLResponse(page)

    return app


class Answer:
    """Turns one job's updates into OpenAI bodies: SSE chunks, or one response at the end."""

    def __init__(self, job: Job, chat: bool, model: str, decode, stop: list[str], with_tokens: bool) -> None:
        self.job, self.chat, self.model, self.with_tokens = job, chat, model, with_tokens
        self.detok = Detokenizer(decode, stop)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.n_tokens = 0

    def _pieces(self, chunks: list[list[int]], drafted: list[int]) -> tuple[str, list[dict]]:
        """New text, and (when asked for) each token's text and whether it was an accepted draft."""
        if self.t_first is None and any(chunks):
            self.t_first = time.perf_counter()
        text, tokens = [], []
        for chunk, d in zip(chunks, drafted):
            self.n_tokens += len(chunk)
            if not self.with_tokens:
                text.append(self.detok.push(chunk))
                continue
            for i, tok in enumerate(chunk):  # one token at a time, so each gets its own text
                piece = self.detok.push([tok])
                text.append(piece)
                tokens.append({"text": piece, "draft": i < d})
        return "".join(text), tokens

    def _finish_reason(self) -> str:
        st = self.job.req.stats
        return FINISH_REASONS.get(st.stop_reason, "abort")

    def _usage(self) -> dict:
        req = self.job.req
        n = len(req.prompt_ids)
        # cached_tokens: prompt tokens whose KV the engine reused (the history of a chat's next turn).
        return {"prompt_tokens": n, "completion_tokens": self.n_tokens, "total_tokens": n + self.n_tokens,
                "prompt_tokens_details": {"cached_tokens": req.stats.cached_tokens}}

    def _stats(self) -> dict:
        """The speculation report (an extra field: clients that do not know it ignore it)."""
        req, st = self.job.req, self.job.req.stats
        tree = None
        if req.tree is not None:
            tree = ({"total_tokens": req.tree.total_tokens, "depth": req.tree.depth, "top_k": req.tree.top_k}
                    if req.method == "eagle2" else {"nodes": len(req.tree.choices) + 1})
        wall = time.perf_counter() - self.t0
        return {"method": req.method, "tree": tree, "steps": st.steps, "tau": round(st.tau, 4),
                "accepted_tokens": sum(st.accepted_per_depth),
                "draft_tokens": sum(s - 1 for s in st.tree_sizes if s > 1),
                "accepted_per_position": list(st.accepted_per_depth), "stop_reason": st.stop_reason,
                "time_to_first_token_s": None if self.t_first is None else round(self.t_first - self.t0, 6),
                "wall_s": round(wall, 6), "tokens_per_s": round(self.n_tokens / wall, 3) if wall > 0 else 0.0}

    def _chunk(self, text: str, finish: str | None = None, extra: dict | None = None) -> str:
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [choice]}
        if extra:
            body["eaglespec"] = extra
        return sse(body)

    async def events(self, worker: EngineWorker, include_usage: bool) -> AsyncIterator[str]:
        done = False
        try:
            if self.chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                           "model": self.model, "choices": [role]})
            while not done:
                update = await self.job.queue.get()
                done = update.done
                if update.error is not None:
                    yield sse(ApiError(500, f"generation failed: {update.error}", "server_error").body())
                    yield "data: [DONE]\n\n"
                    return
                text, tokens = self._pieces(update.chunks, update.drafted)
                if done:
                    text += self.detok.finish()
                if text or tokens:
                    extra = {"tokens": tokens, "steps": self.job.req.stats.steps} if self.with_tokens else None
                    yield self._chunk(text, extra=extra)
            yield self._chunk("", self._finish_reason(), self._stats())
            if include_usage:
                yield sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                           "created": self.created, "model": self.model, "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping): free the row now
                worker.cancel(self.job)

    async def whole(self, worker: EngineWorker, http: HttpRequest) -> Response:
        text, done = [], False
        getter = None
        try:
            while not done:
                getter = getter or asyncio.ensure_future(self.job.queue.get())
                finished, _ = await asyncio.wait({getter}, timeout=0.5)
                if not finished:
                    if await http.is_disconnected():
                        return Response(status_code=499)  # nobody to answer; the finally frees the row
                    continue
                update, getter = getter.result(), None
                done = update.done
                if update.error is not None:
                    raise ApiError(500, f"generation failed: {update.error}", "server_error")
                text.append(self._pieces(update.chunks, update.drafted)[0])
            text.append(self.detok.finish())
        finally:
            if getter is not None:
                getter.cancel()
            if not done:
                worker.cancel(self.job)
        content = "".join(text)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                      "finish_reason": self._finish_reason()}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": self._finish_reason()}
            obj = "text_completion"
        return JSONResponse({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                             "choices": [choice], "usage": self._usage(), "eaglespec": self._stats()})


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
