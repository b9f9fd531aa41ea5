#!/usr/bin/env bash
# Heads trained at equal budget (same conversations, epochs and batch), then benchmarked alike:
#   A  EAGLE-2 head, original ShareGPT answers (the shipped head's recipe)
#   B  EAGLE-2 head, the target's own answers (eaglespec regenerate)
#   C  B with the training-time test (--ttt-steps 3)
#   D  EAGLE-3 head on the target's own answers, --ttt-steps 3
# Two runs at a time, one per core.  Usage: scripts/compare_heads.sh REGENERATED.jsonl N OUT
set -euo pipefail
regen=$1 n=$2 out=$3
py=${PYTHON:-python}
$py scripts/pair_datasets.py "$regen" "$out/data" "$n"
common=(--max-length 640 --draft-vocab 8192 --lr 1e-3 --epochs ${EPOCHS:-3} --batch-tokens 4096 --warmup-steps 30
        --val-fraction 0.05 --eval-every 0 --checkpoint-every 50 --no-progress)
train() { OMP_NUM_THREADS=1 taskset -c "$1" $py -m eaglespec train --out "$out/$2" --data "$out/data/$3.jsonl" \
            "${common[@]}" "${@:4}" > "$out/$2.train.log" 2>&1; }
train 0 A original & train 1 B regenerated & wait
mkdir -p "$out/C" && ln -sfn ../B/features "$out/C/features"  # same dump as B
train 0 C regenerated --ttt-steps 3 & train 1 D regenerated --head eagle3 --ttt-steps 3 & wait
mt=${MT_BENCH:-../shared/data/mt_bench/question.jsonl} gsm=${GSM8K:-../shared/data/gsm8k/train.jsonl}
bench() { OMP_NUM_THREADS=1 taskset -c "$1" $py -m eaglespec bench --mt-bench "$mt" --gsm8k "$gsm" \
            --datasets mt_bench,gsm8k,humaneval --limit ${LIMIT:-4} --max-new-tokens 128 --methods vanilla,eagle2 \
            --total-tokens 16 --depth 5 --topk 4 --alpha --no-progress --draft "$out/$2/head" --out "$out/bench_$2" \
            > "$out/bench_$2.log" 2>&1; }
bench 0 A & bench 1 B & wait
bench 0 C & bench 1 D & wait
for h in A B C D; do echo "== $h"; cat "$out/bench_$h/report.md"; done
