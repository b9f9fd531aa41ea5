"""Tokenizer and chat template: a thin layer over `transformers`.

GGUF files carry their tokenizer; building it through transformers takes ~13 s, so the result is
saved once in the user cache (keyed like the converted weights) and reloaded in well under 1 s.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .files import DIR_MODE, TMP_SUFFIX, remove_stale_temps
from .weights import ModelLoadError, ModelSource, cache_dir, source_key


@dataclass
class Tokenizer:
    """Encode/decode plus the chat template. `hf` is the transformers tokenizer."""

    hf: object
    eos_token_ids: list[int] = field(default_factory=list)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...] -> prompt text."""
        if not self.has_chat_template:
            raise ModelLoadError("this model has no chat template; use --no-chat for raw text prompts")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already holds its special tokens; adding BOS again would
        # change the model's input relative to the reference implementation.
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _gguf_tokenizer(src: ModelSource):
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / source_key(src.path)
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            shutil.rmtree(cached, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    except Exception as e:  # transformers raises many types for a bad GGUF vocabulary
        raise ModelLoadError(f"{src.path}: cannot build its tokenizer ({type(e).__name__}: {e})") from None
    tmp = None
    try:  # save into a temp dir, then rename: a concurrent reader never sees half a tokenizer
        cached.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(cached.parent)  # left by a process killed while saving
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=cached.name + ".", suffix=TMP_SUFFIX))
        tok.save_pretrained(str(tmp))
        tmp.chmod(DIR_MODE)  # mkdtemp's 0700 would differ from its neighbours
        tmp.rename(cached)
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def load_tokenizer(src: ModelSource, eos_token_ids: list[int] | None = None) -> Tokenizer:
    from transformers import AutoTokenizer

    if src.kind == "gguf":
        hf = _gguf_tokenizer(src)
    else:
        try:
            hf = AutoTokenizer.from_pretrained(str(src.path))
        except Exception as e:
            raise ModelLoadError(f"{src.path}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
    eos = set(eos_token_ids or [])
    if getattr(hf, "eos_token_id", None) is not None:
        eos.add(int(hf.eos_token_id))
    return Tokenizer(hf=hf, eos_token_ids=sorted(eos))
