"""Request bodies of the OpenAI-compatible endpoints (pydantic), and the OpenAI-style error.

Types are strict (a string where a number belongs is a 400, not silently converted); fields this
server does not know are ignored, as clients send many optional ones. Values a field may take are
checked here; whether a request fits the model's context is checked by the app (it needs the
tokenised prompt).
"""

from __future__ import annotations

import math
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import MAX_SEED, MAX_TREE_DEPTH, MAX_TREE_TOKENS, MAX_TREE_TOPK

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class SpecOptions(BaseModel):
    """The extra `eaglespec` field: how this request is decoded, and what the stream reports."""

    model_config = ConfigDict(strict=True, extra="forbid")  # a typo here would silently change nothing

    method: Literal["vanilla", "eagle", "eagle2"] | None = None
    total_tokens: int | None = Field(None, ge=1, le=MAX_TREE_TOKENS)
    depth: int | None = Field(None, ge=1, le=MAX_TREE_DEPTH)
    top_k: int | None = Field(None, ge=1, le=MAX_TREE_TOPK)
    # Stream chunks carry each token's text and whether it was an accepted draft (the chat page).
    tokens: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extra; -1 and 0 mean off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: Union[bool, int, None] = None
    user: str | None = None
    eaglespec: SpecOptions | None = None

    @field_validator("temperature", "top_p", "frequency_penalty", "presence_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported (they would change the target's distribution); use 0")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stops

    def stop_strings(self) -> list[str]:
        return [s for s in (self.stop or []) if s]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def as_dict(self) -> dict[str, str]:
        """The engine's form: the newer 'developer' role is a system message; text parts are joined."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    # A string, a list of one string, or token ids (as OpenAI's API takes them).
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    def token_budget(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions
