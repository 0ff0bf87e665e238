#!/usr/bin/env bash
# Paired rerun of the three cells below 0.98: 20 prompts, both orders (old,new then new,old), same sitting.
cd /work/main
OUT=runs/s61
run() { # label suite batch file
  PYTHONPATH=/tmp/$1 HF_TREESPARK_CACHE=/tmp/cache_$1 .venv/bin/python scripts/compare_checkouts.py run $OUT/prompts.json $2 $1 $OUT/$4 --batch-size $3
}
.venv/bin/python scripts/compare_checkouts.py dump $OUT/prompts.json --num-prompts 20
for cell in "humaneval 1" "copy 1" "sharegpt 4"; do
  set -- $cell
  run old $1 $2 batch$2_a.jsonl; run new $1 $2 batch$2_a.jsonl
  run new $1 $2 batch$2_b.jsonl; run old $1 $2 batch$2_b.jsonl
  echo "done $1 $2 $(date +%T)"
done
