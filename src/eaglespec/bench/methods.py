"""The decoding methods under test, all on the same target weights and dtype.

  vanilla, eagle, eagle2   eaglespec's one decode loop (EagleSpec), no draft / static / dynamic tree
  eagle-chain              a single depth-5 chain draft: only used for n-alpha (--alpha)
  hf                       transformers `generate` (greedy or sampling) on a LlamaForCausalLM
                           that shares our weight tensors (no copy)
  hf-pld                   the same with prompt lookup decoding (`prompt_lookup_num_tokens`)
  llamacpp                 llama-cpp-python on the same GGUF file (optional; its arithmetic differs:
                           quantised matmuls instead of our dequantised weights)

Every method takes the same prompt token ids and returns a MethodOutput.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from ..config import SamplingConfig, TreeConfig
from ..runtime.request import tau

METHODS = ("vanilla", "eagle", "eagle2", "hf", "hf-pld", "llamacpp")
CHAIN = "eagle-chain"
CHAIN_CHOICES = [[0] * d for d in range(1, 6)]  # [[0], [0, 0], ..., [0, 0, 0, 0, 0]]
PLD_TOKENS = 10  # candidate tokens per prompt-lookup step (transformers' documented example value)
LOSSLESS = {"vanilla", "eagle", "eagle2", CHAIN}  # greedy output must equal vanilla's, token for token


@dataclass
class MethodOutput:
    token_ids: list[int]  # new tokens only
    text: str
    wall_s: float  # generation only: prefill included, tokenisation and model load excluded
    steps: int  # target forwards after the prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens per step; [] if not observable
    accepted_per_depth: list[int] = field(default_factory=list)  # [d]: steps accepting a depth-(d+1) draft
    stop_reason: str = ""

    @property
    def tau(self) -> float:
        """runtime.request.tau over the method's target forwards (1.0 for a one-token answer)."""
        return tau(len(self.token_ids), self.steps) if self.steps else 1.0


class Method:
    """A named way to generate: run(prompt ids) -> MethodOutput."""

    name = ""
    lossless = False

    def run(self, prompt_text: str, prompt_ids: list[int], max_new_tokens: int,
            sampling: SamplingConfig) -> MethodOutput:
        raise NotImplementedError


class EngineMethod(Method):
    """vanilla / eagle / eagle2 / eagle-chain through EagleSpec.generate."""

    def __init__(self, name: str, engine, tree: TreeConfig | None) -> None:
        self.name, self.engine, self.tree = name, engine, tree
        self.lossless = name in LOSSLESS
        self.base = tree.method if tree is not None else "vanilla"

    def run(self, prompt_text, prompt_ids, max_new_tokens, sampling):
        # The rendered chat text re-encodes to exactly prompt_ids (EagleSpec.encode does the same).
        r = self.engine.generate(prompt_text, method=self.base, chat=False, max_new_tokens=max_new_tokens,
                                 sampling=sampling, tree=self.tree)
        return MethodOutput(r.token_ids, r.text, r.wall_s, r.steps, list(r.accept_lengths),
                            list(r.accepted_per_depth), r.stop_reason)


def hf_model_from(target):
    """A transformers LlamaForCausalLM whose parameters are views of `target`'s (fused) tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = target.config
    if c.architecture not in ("llama", "mistral", "qwen2") or c.sliding_window:
        from ..config import ConfigError

        raise ConfigError(f"the transformers baseline runs plain Llama-block targets (Llama, Mistral without a "
                          f"window, Qwen2), not {c.architecture!r}")
    rope_scaling = None
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings}
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                      rope_scaling=rope_scaling, rms_norm_eps=c.rms_norm_eps,
                      max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
                      attention_bias=c.qkv_bias, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_ids or None,
                      pad_token_id=None)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": target.embed.weight,
                                   "model.norm.weight": target.norm.weight, "lm_head.weight": target.lm_head.weight}
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(target.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attn.wqkv.weight.split([nq, nkv, nkv])  # row slices: views, no copy
        sd |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
               p + "self_attn.o_proj.weight": layer.attn.wo.weight,
               p + "input_layernorm.weight": layer.attn_norm.weight,
               p + "post_attention_layernorm.weight": layer.mlp_norm.weight}
        if c.qkv_bias:  # Qwen2: biases on q/k/v only; Llama's attention_bias also gives o_proj one
            qb, kb, vb = layer.attn.wqkv.bias.split([nq, nkv, nkv])
            sd |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb,
                   p + "self_attn.o_proj.bias": torch.zeros(c.hidden_size, dtype=target.dtype, device=target.device)}
        gate, up = layer.mlp.w_gate_up.weight.split(c.intermediate_size)
        sd |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
               p + "mlp.down_proj.weight": layer.mlp.w_down.weight}
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"HF model from our weights: missing {missing[:4]}, unexpected {unexpected[:4]}")
    # Non-persistent RoPE buffers were made on the meta device: rebuild them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(target.device)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(f"HF model from our weights: tensors left on the meta device: {meta[:4]}")
    return model.eval().requires_grad_(False)


@dataclass
class ForwardCounter:
    """A forward pre-hook counting target forwards: steps of transformers' generate loops."""

    calls: int = 0

    def __call__(self, module, args) -> None:
        self.calls += 1


class HFMethod(Method):
    """transformers generate; prompt_lookup > 0 turns on prompt lookup decoding."""

    def __init__(self, name: str, model, counter: ForwardCounter, eos_ids: list[int], decode,
                 prompt_lookup: int = 0) -> None:
        self.name, self.model, self.counter, self.prompt_lookup = name, model, counter, prompt_lookup
        self.eos, self.decode = list(eos_ids), decode

    def run(self, prompt_text, prompt_ids, max_new_tokens, sampling):
        from transformers import GenerationConfig

        kw: dict = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, num_beams=1,
                        eos_token_id=self.eos or None, pad_token_id=self.eos[0] if self.eos else 0)
        if not sampling.greedy:  # top_k=0 switches off transformers' default top-k of 50
            kw |= dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        gc = GenerationConfig(**kw)
        ids = torch.tensor([prompt_ids], device=self.model.device)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        self.counter.calls = 0
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            wall = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        reason = "eos" if new and new[-1] in self.eos else "max_new_tokens"
        return MethodOutput(new, self.decode(new), wall, max(0, self.counter.calls - 1),
                            stop_reason=reason)


class BaselineCrashed(RuntimeError):
    """A baseline's child process died; the bench notes it and goes on without that baseline."""


class LlamaCppMethod(Method):
    """llama-cpp-python in a child process (bench/llamacpp_worker.py), generating from our prompt
    ids (so both see the same input tokens); a crash of the child is reported, not fatal."""

    name = "llamacpp"

    def __init__(self, proc, eos_ids: list[int], decode) -> None:
        self.proc, self.eos, self.decode = proc, list(eos_ids), decode

    def run(self, prompt_text, prompt_ids, max_new_tokens, sampling):
        req = {"ids": list(prompt_ids), "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
               "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed, "eos": self.eos}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self.proc.wait()
            raise BaselineCrashed(f"llamacpp crashed (exit code {code}{', a signal' if code < 0 else ''})")
        reply = json.loads(line)
        if "error" in reply:
            raise BaselineCrashed(f"llamacpp failed: {reply['error']}")
        new = reply["tokens"]
        reason = "eos" if new and new[-1] in self.eos else "max_new_tokens"
        return MethodOutput(new, self.decode(new), reply["wall_s"], max(0, len(new) - 1), stop_reason=reason)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def load_llamacpp(engine, n_ctx: int) -> tuple[Method | None, str]:
    """(method, '') or (None, why it is skipped). Never raises: llamacpp is an optional baseline."""
    if engine.source.kind != "gguf":
        return None, "llamacpp skipped: it needs a GGUF model (--model FILE.gguf), not a checkpoint directory"
    if importlib.util.find_spec("llama_cpp") is None:
        return None, ("llamacpp skipped: llama-cpp-python is not installed; "
                      "install it with: pip install 'eaglespec[llamacpp]' (builds llama.cpp, about 5 minutes)")
    proc = subprocess.Popen([sys.executable, "-m", "eaglespec.bench.llamacpp_worker", str(engine.source.path),
                             str(n_ctx), str(torch.get_num_threads())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    reply = json.loads(first) if first else {"error": f"the worker exited with code {proc.wait()}"}
    if "error" in reply:
        proc.kill()
        return None, f"llamacpp skipped: cannot load {engine.source.path} ({reply['error']})"
    return LlamaCppMethod(proc, engine.tokenizer.eos_token_ids, engine.tokenizer.decode), ""


def check_names(names: list[str]) -> None:
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {', '.join(unknown)}; choose from {', '.join(METHODS)}")


def build_methods(names: list[str], engine, tree: TreeConfig | None = None, alpha: bool = False,
                  n_ctx: int = 4096) -> tuple[list[Method], list[str]]:
    """Methods by name, vanilla first (the reference), plus eagle-chain when alpha; and notes on
    what was added or skipped. `tree` carries --total-tokens/--depth/--topk/--tree-choices."""
    check_names(names)
    notes: list[str] = []
    if "vanilla" not in names:
        notes.append("vanilla added: it is the reference for speedup and the lossless check")
    names = ["vanilla"] + [n for n in dict.fromkeys(names) if n != "vanilla"] + ([CHAIN] if alpha else [])
    t = tree or engine.engine.default_tree("eagle2")
    trees = {"vanilla": None, "eagle": TreeConfig(method="eagle", choices=t.choices),
             "eagle2": TreeConfig(method="eagle2", total_tokens=t.total_tokens, depth=t.depth, top_k=t.top_k),
             CHAIN: TreeConfig(method="eagle", choices=CHAIN_CHOICES)}
    out: list[Method] = []
    hf_model = counter = None
    for name in names:
        if name in trees:
            out.append(EngineMethod(name, engine, trees[name]))
        elif name in ("hf", "hf-pld"):
            if hf_model is None:  # one model for hf and hf-pld
                hf_model, counter = hf_model_from(engine.target), ForwardCounter()
                hf_model.register_forward_pre_hook(counter)
            out.append(HFMethod(name, hf_model, counter, engine.tokenizer.eos_token_ids, engine.tokenizer.decode,
                                PLD_TOKENS if name == "hf-pld" else 0))
        elif name == "llamacpp":
            m, note = load_llamacpp(engine, min(n_ctx, engine.target.config.max_position_embeddings))
            if m is None:
                notes.append(note)
            else:
                out.append(m)
    return out, notes
