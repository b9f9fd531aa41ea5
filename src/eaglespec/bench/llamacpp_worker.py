"""The llama.cpp baseline in a child process: `python -m eaglespec.bench.llamacpp_worker GGUF N_CTX THREADS`.

llama-cpp-python has crashed (SIGSEGV) on one of our machines; in a child process a crash is a
note in the bench report, not the end of the run. Protocol: one JSON object per line each way.
Request {"ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "eos"}; reply
{"tokens", "wall_s"} (or {"error"}). The first reply, {"ready": true} or {"error"}, follows loading.
"""

from __future__ import annotations

import json
import sys
import time


def generate(llm, req: dict) -> dict:
    if req.get("seed") is not None and hasattr(llm, "set_seed"):
        llm.set_seed(int(req["seed"]))
    eos = set(req["eos"]) | {llm.token_eos()}
    new: list[int] = []
    t0 = time.perf_counter()
    for tok in llm.generate(req["ids"], temp=req["temperature"], top_k=req["top_k"], top_p=req["top_p"],
                            min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True):
        new.append(int(tok))
        if tok in eos or len(new) >= req["max_new_tokens"]:
            break
    return {"tokens": new, "wall_s": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    path, n_ctx, threads = argv[0], int(argv[1]), int(argv[2])
    out = sys.stdout
    try:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, seed=0, verbose=False)
    except Exception as e:  # not installed, a build without this quantisation, a bad file
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = generate(llm, json.loads(line))
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
