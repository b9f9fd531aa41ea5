"""Two datasets over the same conversations for an equal-budget comparison: the first N records of
a regenerated file (`eaglespec regenerate`) and the original ShareGPT answers of those ids.

    python scripts/pair_datasets.py runs/regen/greedy.jsonl runs/cmp/data 300
    -> runs/cmp/data/original.jsonl, runs/cmp/data/regenerated.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eaglespec.train.data import load_conversations
from eaglespec.train.regenerate import _keys


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    regen = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    out, n = Path(sys.argv[2]), int(sys.argv[3])
    if len(regen) < n:
        sys.exit(f"{sys.argv[1]} holds {len(regen)} conversations, fewer than {n}")
    convs = load_conversations(None).conversations  # the packaged ShareGPT, as regenerate read it
    by_key = dict(zip(_keys(convs), convs))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "original.jsonl", "w") as fo, open(out / "regenerated.jsonl", "w") as fr:
        for r in regen[:n]:
            fo.write(json.dumps({"id": r["id"], "messages": by_key[r["id"]].messages}, ensure_ascii=False) + "\n")
            fr.write(json.dumps({"id": r["id"], "messages": r["messages"]}, ensure_ascii=False) + "\n")
    print(f"{n} conversations -> {out}/original.jsonl, {out}/regenerated.jsonl")


if __name__ == "__main__":
    main()
