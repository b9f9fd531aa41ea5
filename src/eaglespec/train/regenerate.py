"""--regenerate: replace each assistant turn with the target's own greedy answer.

A head trained on the target's own outputs sees exactly the distribution it will draft at
inference time. Answers are appended to a jsonl file as they are made, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from .data import Conversation


def regenerate(engine, convs: list[Conversation], cache_file: Path, max_new_tokens: int = 256,
               progress: bool = True) -> list[Conversation]:
    done: dict[str, list[dict[str, str]]] = {}
    if cache_file.is_file():
        for line in cache_file.read_text().splitlines():
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec["messages"]
            except (json.JSONDecodeError, KeyError):
                continue  # a line cut by a kill: redo that conversation
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    out = []
    with open(cache_file, "a") as f:
        for i, conv in enumerate(tqdm(convs, desc="regenerate", disable=not progress, dynamic_ncols=True)):
            key = conv.id or str(i)
            if key not in done:
                msgs: list[dict[str, str]] = []
                for m in conv.messages:
                    if m["role"] == "assistant":
                        r = engine.generate(list(msgs), max_new_tokens=max_new_tokens)
                        msgs.append({"role": "assistant", "content": r.text})
                    else:
                        msgs.append(dict(m))
                done[key] = msgs
                f.write(json.dumps({"key": key, "messages": msgs}) + "\n")
                f.flush()
            out.append(Conversation(messages=done[key], id=conv.id))
    return out
