"""How often bf16 speculative decoding reproduces bf16 vanilla decoding, and why it diverges.

In bf16, scoring a tree of tokens in one forward rounds differently from decoding one token at a
time, so a near-tie argmax can flip. This script measures, on MT-bench first turns (greedy):

  * agreement: how many answers are token-for-token identical between vanilla and `--method`;
  * the rounding noise between the two paths: for the vanilla continuation, the top-2 logit gap
    computed token by token (decode path) against the same gap computed 16 tokens per forward
    (verify path); median, p99 and max of |difference|;
  * for every divergence, the top-2 gap at the first differing position, in bf16 (decode path)
    and in an fp32 reference forward: a divergence is "at a near-tie" when the bf16 gap is within
    the measured path noise.

`--fp32-logits` repeats everything with the LM head computed in fp32 (an fp32 copy of its
weight): bf16 logits keep only 8 mantissa bits, so exact ties between the top two tokens are
common, and an fp32 head removes that source of flips. The cost is printed (ms per vanilla token).

  python scripts/bf16_agreement.py --draft default --questions 20 --max-new-tokens 128
Prints numbers, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglespec.api import EagleSpec, set_threads
from eaglespec.config import TreeConfig
from eaglespec.model import Transformer

MT_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench" / "question.jsonl"


class Fp32Head(torch.nn.Module):
    """LM head that accumulates and returns fp32 logits from bf16 features."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


@torch.inference_mode()
def path_logits(target: Transformer, ids: list[int], n_prompt: int, chunk: int) -> torch.Tensor:
    """Logits [len(ids) - n_prompt + 1, V]; row j predicts ids[n_prompt + j] (the last row the
    token after ids). The prompt is prefilled, then the rest fed `chunk` tokens per forward
    (chunk 1 = the decode path, 16 = like a verify pass)."""
    cache = target.new_cache(len(ids) + 1)
    out = target(torch.tensor(ids[:n_prompt])[None], torch.arange(n_prompt)[None], cache, logits_for="last")
    rows = [out.logits[0, -1:].float()]
    for s in range(n_prompt, len(ids), chunk):
        e = min(s + chunk, len(ids))
        out = target(torch.tensor(ids[s:e])[None], torch.arange(s, e)[None], cache)
        rows.append(out.logits[0].float())
    return torch.cat(rows)  # row j predicts ids[n_prompt + j]


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    v = logits.topk(2, dim=-1).values
    return v[..., 0] - v[..., 1]


@dataclass
class Report:
    identical: int = 0
    answers: int = 0
    noise: list[float] = field(default_factory=list)
    divergences: list[dict] = field(default_factory=list)
    vanilla_ms_per_token: list[float] = field(default_factory=list)


def measure(engine: EagleSpec, ref: EagleSpec, questions: list[dict], method: str, max_new: int,
            noise_questions: int) -> Report:
    rep = Report()
    tree = TreeConfig(method=method)
    for qi, q in enumerate(questions):
        van = engine.generate(q["turns"][0], method="vanilla", max_new_tokens=max_new)
        spec = engine.generate(q["turns"][0], method=method, max_new_tokens=max_new, tree=tree)
        _, prompt = engine.encode(q["turns"][0])
        rep.answers += 1
        rep.vanilla_ms_per_token.append(1e3 * van.wall_s / van.new_tokens)
        if van.token_ids == spec.token_ids:
            rep.identical += 1
        else:
            i = next((j for j, (a, b) in enumerate(zip(van.token_ids, spec.token_ids)) if a != b),
                     min(len(van.token_ids), len(spec.token_ids)))
            ids = prompt + van.token_ids[:i]
            a, b = (van.token_ids + [-1])[i], (spec.token_ids + [-1])[i]
            lo = path_logits(engine.target, ids, len(ids), 1)[-1]
            lr = path_logits(ref.target, ids, len(ids), 1)[-1]
            d = {"qid": q["question_id"], "position": i, "vanilla_token": a, "spec_token": b,
                 "bf16_top2_gap": float(top2_gap(lo)), "fp32_top2_gap": float(top2_gap(lr))}
            if a >= 0 and b >= 0:
                d["bf16_gap_between_them"] = float(lo[a] - lo[b])
                d["fp32_gap_between_them"] = float(lr[a] - lr[b])
            rep.divergences.append(d)
        if qi < noise_questions:
            ids = prompt + van.token_ids
            dec = path_logits(engine.target, ids, len(prompt), 1)
            ver = path_logits(engine.target, ids, len(prompt), 16)
            top = dec.topk(2, dim=-1).indices
            gd = dec.gather(-1, top)
            gv = ver.gather(-1, top)
            rep.noise += ((gd[:, 0] - gd[:, 1]) - (gv[:, 0] - gv[:, 1])).abs().tolist()
        print(f"q{q['question_id']}: {'identical' if van.token_ids == spec.token_ids else 'DIVERGES'} "
              f"(tau {spec.tau:.2f})", flush=True)
    return rep


def summarise(name: str, rep: Report) -> dict:
    noise = sorted(rep.noise) or [0.0]
    p = lambda q: noise[min(len(noise) - 1, int(q * len(noise)))]  # noqa: E731
    near = sum(1 for d in rep.divergences if d["bf16_top2_gap"] <= p(0.99))
    out = {"variant": name, "identical": f"{rep.identical}/{rep.answers}",
           "path_noise_top2_gap": {"median": p(0.5), "p99": p(0.99), "max": noise[-1], "n": len(rep.noise)},
           "divergences_at_near_tie": f"{near}/{len(rep.divergences)}",
           "vanilla_ms_per_token": statistics.median(rep.vanilla_ms_per_token),
           "divergences": rep.divergences}
    print(json.dumps(out, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default="default")
    ap.add_argument("--method", default="eagle2", choices=["eagle", "eagle2"])
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--noise-questions", type=int, default=3, help="questions used to measure path noise")
    ap.add_argument("--data", default=str(MT_BENCH))
    ap.add_argument("--fp32-logits", action="store_true", help="also run with an fp32 LM head")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_threads()
    questions = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()][: args.questions]
    engine = EagleSpec.load(dtype="bf16", draft=args.draft)
    ref = EagleSpec.load(dtype="fp32")
    t0 = time.perf_counter()
    results = [summarise("bf16", measure(engine, ref, questions, args.method, args.max_new_tokens,
                                         args.noise_questions))]
    if args.fp32_logits:
        engine.target.lm_head = Fp32Head(engine.target.lm_head.weight)
        # Lanes hold proposers that gathered the old LM-head rows: start new ones (drafting stays
        # in the head's bf16).
        engine.engine.lanes.clear()
        results.append(summarise("bf16 + fp32 LM head", measure(engine, ref, questions, args.method,
                                                                args.max_new_tokens, args.noise_questions)))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
