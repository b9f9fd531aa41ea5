"""`make demo`: the main job on the embedded default model.

Streams a chat answer to a fixed prompt with plain decoding, then (when a trained draft head
ships for the model) the same prompt with EAGLE-2, and prints tokens/s of both and the speedup.
"""

from __future__ import annotations

import sys

from .api import EagleSpec, default_head_path, set_threads
from .quant import greedy_exact
from .weights import DEFAULT_MODEL

PROMPT = "Explain in a few sentences why the sky is blue."


def run(engine: EagleSpec, method: str, max_new_tokens: int):
    print(f"\n--- {method} ---", flush=True)
    stream = engine.stream(PROMPT, method=method, max_new_tokens=max_new_tokens)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    r = stream.result
    extra = f", tau {r.tau:.2f}" if method != "vanilla" else ""
    print(f"\n[{method}: {r.new_tokens} tokens in {r.wall_s:.2f} s = {r.tokens_per_s:.1f} tokens/s{extra}]")
    return r


def main(max_new_tokens: int = 128) -> int:
    set_threads()
    engine = EagleSpec.load(DEFAULT_MODEL, dtype="auto")
    print(f"eaglespec demo: {engine.source.name}, {engine.target.dtype}, quant {engine.target.quant}, "
          f"loaded in {engine.load_s:.1f} s")
    print(f"prompt: {PROMPT}")
    vanilla = run(engine, "vanilla", max_new_tokens)
    if not (default_head_path(engine.source.name) / "config.json").is_file():
        print("\n(no trained draft head ships yet: speculative decoding needs `eaglespec train` first)")
        return 0
    engine.set_draft("default")
    eagle = run(engine, "eagle2", max_new_tokens)
    if eagle.token_ids == vanilla.token_ids:
        same = "identical"
    elif greedy_exact(engine.target):
        same = "DIFFERENT: this mode guarantees identical output, so this is a bug; please report it"
    else:
        same = "DIFFERENT (near-tie rounding in this mode, see README)"
    print(f"\nvanilla {vanilla.tokens_per_s:.1f} tokens/s, eagle2 {eagle.tokens_per_s:.1f} tokens/s: "
          f"speedup {eagle.tokens_per_s / vanilla.tokens_per_s:.2f}x, output {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
