#!/bin/sh
# The head bench the README's head tables use: 20 prompts of each of the four datasets (100 turns:
# MT-bench has two), 128 new tokens, the (16, 5, 4) tree, int4 weights, one thread pinned to one
# core, with n-alpha (--alpha). Every eagle2 answer is checked against vanilla at T=0.
#   sh scripts/bench20.sh NAME HEAD CORE [TEMPERATURE]   -> runs/bench20_NAME/report.md
# HEAD: a head directory or "default" (the shipped head).
set -e
name=$1 head=$2 core=${3:-0} temp=${4:-0}
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=1 taskset -c "$core" .venv/bin/eaglespec bench --limit 20 --methods vanilla,eagle2 \
  --draft "$head" --quant int4 --total-tokens 16 --depth 5 --topk 4 --max-new-tokens 128 \
  --temperature "$temp" --alpha --no-progress --out "runs/bench20_$name"
