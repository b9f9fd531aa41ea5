"""The Python API: one engine object that the CLI, the benchmarks and the server all use.

    engine = EagleSpec.load("smollm2-135m-instruct", draft="default", dtype="auto")
    for piece in (s := engine.stream("Hi!", method="eagle2")):
        print(piece, end="")
    print(s.result.tokens_per_s, s.result.tau)
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Union

import torch

from .config import ConfigError, SamplingConfig, TreeConfig
from .draft import Head, init_random_head, load_head
from .runtime.engine import Engine, Request
from .runtime.request import GenerationStats, check_request, check_text, cut_at_stop_string
from .model import Transformer
from .tokenizer import Tokenizer, load_tokenizer
from .weights import DEFAULT_MODEL, ModelSource, load_model, resolve_model

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]
METHODS = ("vanilla", "eagle", "eagle2")
HEADS_DIR = Path(__file__).parent / "heads"


def resolve_dtype(dtype: str | torch.dtype, device: str, integer_linears: bool = False) -> torch.dtype:
    """auto: bf16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16 or AMX), else fp32;
    except that a CPU target whose linears the package's integer kernels run (`integer_linears`:
    a 4- or 8-bit GGUF under --quant auto/int4/int8 where those kernels build) gets bf16 anyway:
    there bf16 is only the activations' format, and the integer products need it (an AVX2-only
    EPYC decodes the default model 4-6x faster than in fp32; README, "AVX2 CPUs")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if dtype in table:
        return table[dtype]
    if dtype != "auto":
        raise ValueError(f"--dtype must be auto, bf16, fp16 or fp32, got {dtype!r}")
    if str(device).startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() or integer_linears else torch.float32


def integer_linears_here(src: ModelSource, quant: str) -> bool:
    """Whether `src`'s linears would run the integer CPU kernels: a GGUF of 4- or 8-bit blocks under
    a quant mode that keeps them, on a CPU where the kernel builds (`resolve_dtype`)."""
    if src.kind != "gguf" or quant not in ("auto", "int4", "int8", "int8a16"):
        return False
    from . import kernels
    from .weights import gguf_config, gguf_linear_kind, read_gguf

    if quant == "auto":
        reader = read_gguf(src.path)
        kind = gguf_linear_kind(reader, gguf_config(reader, src.path))
        if kind not in ("Q4_0", "Q4_1", "Q8_0"):
            return False
        quant = "int4" if kind.startswith("Q4") else "int8"
    kernel = {"int4": kernels.int4_kernel, "int8": kernels.int8_kernel, "int8a16": kernels.int8_a16_kernel}[quant]
    return kernel() is not None


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def batched_quant_default(device: str) -> str:
    """The quant mode whose long and batched forwards (regeneration, feature dumps) are fastest
    here: `none` on CUDA and on CPUs with native bf16 matmul (oneDNN's bf16 products beat the
    integer kernels at hundreds of rows), else `auto`, the GGUF's integer blocks on the package's
    kernels (on an AVX2-only EPYC: 2.0x fp32's tokens/s for a 32-row decode step and 1.18x for the
    feature dump; README, "Session 17")."""
    if str(device).startswith("cuda") or cpu_has_native_bf16():
        return "none"
    return "auto"


def resolve_device(device: str) -> str:
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (this torch build or machine has none)")
    return device


def default_head_path(model_name: str) -> Path:
    return HEADS_DIR / model_name


@dataclass
class GenerationResult:
    prompt: str
    text: str
    token_ids: list[int]  # new tokens only
    new_tokens: int
    wall_s: float  # generation only (prefill included, model load excluded)
    tokens_per_s: float
    method: str
    steps: int
    tau: float
    accept_lengths: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    stop_reason: str = ""
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class Detokenizer:
    """Token ids in, text pieces out, for a stream: the text is cut at the earliest stop string, and
    an incomplete UTF-8 character (decoded as U+FFFD) is held back until it completes. The whole
    answer is decoded each time, because pieces of one word can decode differently on their own."""

    def __init__(self, decode, stop_strings: list[str]) -> None:
        self.decode, self.stop = decode, list(stop_strings)
        self.token_ids: list[int] = []
        self.text = ""  # what has been handed out so far (the whole answer after finish())

    def push(self, tokens: list[int]) -> str:
        """Add tokens; return the new text they complete ('' while a character is incomplete)."""
        self.token_ids.extend(tokens)
        text = cut_at_stop_string(self.decode(self.token_ids), self.stop)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        piece, self.text = text[len(self.text):], text
        return piece

    def finish(self) -> str:
        """The rest of the text once no more tokens come (a trailing incomplete character too)."""
        text = cut_at_stop_string(self.decode(self.token_ids), self.stop)
        piece = text[len(self.text):] if text.startswith(self.text) else ""
        self.text = text
        return piece


class Stream:
    """Iterates over text pieces as tokens are accepted; `.result` is set when it ends."""

    def __init__(self, engine: "EagleSpec", prompt_text: str, ids: list[int], method: str, tokens: Iterator[list[int]],
                 stats: GenerationStats, stop_strings: list[str]) -> None:
        self._engine, self._prompt, self._tokens, self._stats = engine, prompt_text, tokens, stats
        self._method, self._stop = method, stop_strings
        self.token_ids: list[int] = []
        self.result: GenerationResult | None = None
        self.on_tokens = None  # optional callback(list[int]) for token-level consumers

    def __iter__(self) -> Iterator[str]:
        detok = Detokenizer(self._engine.tokenizer.decode, self._stop)
        for chunk in self._tokens:
            self.token_ids.extend(chunk)
            if self.on_tokens is not None:
                self.on_tokens(chunk)
            piece = detok.push(chunk)
            if piece:
                yield piece
        piece = detok.finish()
        if piece:
            yield piece
        text = detok.text
        s = self._stats
        self.result = GenerationResult(
            prompt=self._prompt, text=text, token_ids=list(self.token_ids), new_tokens=len(self.token_ids),
            wall_s=s.wall_s, tokens_per_s=s.tokens_per_s, method=self._method, steps=s.steps, tau=s.tau,
            accept_lengths=list(s.accept_lengths), accepted_per_depth=list(s.accepted_per_depth),
            stop_reason=s.stop_reason, prefill_s=s.prefill_s, draft_s=s.draft_s, verify_s=s.verify_s)

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        """Stop early: cancel the request and free its row (iteration, if resumed, just ends)."""
        self._tokens.close()


class EagleSpec:
    """A target model, its tokenizer and (optionally) an EAGLE draft head."""

    def __init__(self, target: Transformer, tokenizer: Tokenizer, source: ModelSource,
                 head: Head | None = None, head_name: str = "") -> None:
        self.target, self.tokenizer, self.source = target, tokenizer, source
        self.head, self.head_name = head, head_name
        # The one engine every request runs through (CLI, bench, server, this API).
        self.engine = Engine(target, head, eos_ids=tokenizer.eos_token_ids, decode=tokenizer.decode)
        self.load_s = 0.0

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, draft: str | None = None, dtype: str | torch.dtype = "auto",
             device: str = "cpu", quant: str = "auto") -> "EagleSpec":
        """quant: 'auto' | 'none' | 'int8' | 'int4' for the target's linears (see eaglespec.quant)."""
        t0 = time.perf_counter()
        device = resolve_device(device)
        src = model if isinstance(model, ModelSource) else resolve_model(model)
        integer = dtype == "auto" and device == "cpu" and not cpu_has_native_bf16() and integer_linears_here(src, quant)
        dt = resolve_dtype(dtype, device, integer)
        target, src = load_model(src, dt, device, quant=quant)
        tok = load_tokenizer(src, target.config.eos_token_ids)
        engine = cls(target, tok, src)
        if draft is not None:
            engine.set_draft(draft)
        engine.load_s = time.perf_counter() - t0
        return engine

    def set_draft(self, draft: str, seed: int = 0) -> None:
        """draft: 'default' (the head shipped for this model), 'random' / 'random3' (seeded EAGLE-1/2 /
        EAGLE-3 heads, for tests) or a path to a head directory (either kind, detected)."""
        cfg, dt, dev = self.target.config, self.target.dtype, self.target.device
        if draft == "random":
            head, name = init_random_head(cfg, seed=seed, dtype=dt, device=dev), "random"
        elif draft == "random3":  # EAGLE-3's reduced vocabulary: at most 32,000 draft tokens
            head = init_random_head(cfg, seed=seed, dtype=dt, device=dev, kind="eagle3",
                                    draft_vocab=min(cfg.vocab_size, 32000))
            name = "random3"
        else:
            path = default_head_path(self.source.name) if draft == "default" else Path(draft)
            if draft == "default" and not (path / "config.json").is_file():
                raise ConfigError(f"no trained draft head ships for model {self.source.name!r}; "
                                  "pass --draft PATH (a head directory) or --draft random")
            if not path.exists():
                raise ConfigError(f"draft head {path} does not exist")
            head, name = load_head(path, cfg, dt, dev), str(draft)
        self.engine.set_head(head)
        self.head, self.head_name = head, name

    def encode(self, prompt: Prompt, chat: bool = True, system: str | None = None) -> tuple[str, list[int]]:
        """Prompt text (or messages) -> (rendered prompt text, token ids)."""
        if isinstance(prompt, str):
            check_text(prompt)
            if not chat:
                return prompt, self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        messages = check_messages(prompt)
        if system is not None:
            check_text(system, "system", empty_ok=True)
        if system is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
        text = self.tokenizer.render_chat(messages)
        return text, self.tokenizer.encode(text)

    def stream(self, prompt: Prompt, *, method: str = "vanilla", max_new_tokens: int | None = 256,
               sampling: SamplingConfig | None = None, tree: TreeConfig | None = None, chat: bool = True,
               system: str | None = None, stop: str | list[str] = ()) -> Stream:
        """stop: a stop string or a list of them."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        # Types are checked here, so a wrong one is named now instead of failing deep in torch or jinja2.
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)):
            raise TypeError(f"max_new_tokens must be an int or None, got {type(max_new_tokens).__name__} "
                            f"{max_new_tokens!r}")
        for name, value, kind in (("sampling", sampling, SamplingConfig), ("tree", tree, TreeConfig),
                                  ("system", system, str)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}")
        if not isinstance(chat, bool):
            raise TypeError(f"chat must be True or False, got {type(chat).__name__}")
        stop = [stop] if isinstance(stop, str) else stop  # one string is one stop string, not its characters
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        if method != "vanilla":
            with self.engine.lock:
                if self.head is None:
                    self.set_draft("default")
            tree = tree or self.engine.default_tree(method, (sampling or SamplingConfig()).temperature)
            if tree.method != method:
                tree = TreeConfig(method=method, total_tokens=tree.total_tokens, depth=tree.depth,
                                  top_k=tree.top_k, choices=tree.choices)
        text, ids = self.encode(prompt, chat, system)
        check_request(self.target.config.max_position_embeddings, len(ids), max_new_tokens)
        req = self.engine.submit(Request(ids, method, tree if method != "vanilla" else None,
                                         sampling or SamplingConfig(), max_new_tokens, list(stop)))
        return Stream(self, text, ids, method, self.engine.chunks(req), req.stats, list(stop))

    def generate(self, prompt: Prompt, **kwargs) -> GenerationResult:
        return self.stream(prompt, **kwargs).run()


def check_messages(messages) -> Messages:
    """A chat: a list of {"role": "system"|"user"|"assistant", "content": str}, or an error naming the message."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"prompt must be a string or a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("prompt: the list of messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"prompt[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"prompt[{i}]['role'] must be 'system', 'user' or 'assistant', got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise TypeError(f"prompt[{i}]['content'] must be a string, got "
                            f"{'nothing' if 'content' not in m else type(m['content']).__name__}")
        check_text(m["content"], f"prompt[{i}]['content']", empty_ok=True)
    return list(messages)


def set_threads() -> None:
    """Use every core this process may run on for intra-op work unless the user chose
    (OMP_NUM_THREADS). The affinity mask, not the machine's count: under `taskset` or a cgroup
    cpuset, threads beyond it share cores, and a descheduled OpenMP thread stalls every region."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(cores or 1)
