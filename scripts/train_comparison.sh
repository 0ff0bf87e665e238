#!/usr/bin/env bash
# Issue 11's comparison: the three presets trained from scratch on the same data (both shared
# regenerated ShareGPT files, in the same order: same --seed), for the same number of steps and anchors
# (64 anchors per step, 4 updates per batch of 2 responses), with the same hyper-parameters and the same
# draft vocabulary (16,384 ids); each run evaluates the same development set every 400 steps. The presets
# differ only in what the paper compares: `dspark` (DSpark losses, head dim 128, chain decoding),
# `dspark_tree` (DSpark losses, the TreeSpark shape), `treespark` (plus the replayed survival and coverage
# losses). One run at a time; resumable: run it again after an interruption (a finished run is skipped).
# The same comparison at another scale or on other data: DATA (files for --data: regeneration files, chat JSONL or
# .txt), LABELS (--labels: text, or target for text the target did not write), STEPS, DRAFT_VOCAB and OUT (the runs'
# prefix), e.g.  STEPS=20000 DATA="runs/chats.jsonl" LABELS=target OUT=runs/cmp8m bash scripts/train_comparison.sh
# Then benchmark the three side by side (per-prompt spread in results.json):
#   .venv/bin/treespark bench --num-prompts 20 --methods plain,dspark,dspark_tree,treespark \
#       --drafter dspark=runs/cmp-dspark/final --drafter dspark_tree=runs/cmp-dspark_tree/final \
#       --drafter treespark=runs/cmp-treespark/final --output-dir runs/cmp-bench
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-1600}
DEV=${DEV:-runs/s9/dev_references.jsonl}
DATA=${DATA:-"../shared/data/sharegpt_smollm2_regen.jsonl ../shared/data/sharegpt_smollm2_regen_part2.jsonl"}
LABELS=${LABELS:-text}
DRAFT_VOCAB=${DRAFT_VOCAB:-16384}
OUT=${OUT:-runs/cmp}
read -r -a data <<< "$DATA"
for preset in treespark dspark_tree dspark; do
  out="$OUT-$preset"
  if [ -f "$out/final/config.json" ]; then echo "$out: done"; continue; fi
  mkdir -p "$out"
  dev_args=()
  if [ -f "$DEV" ]; then dev_args=(--dev-data "$DEV"); fi
  .venv/bin/treespark train --target default \
    --data "${data[@]}" --labels "$LABELS" \
    --preset "$preset" --draft-vocab-size "$DRAFT_VOCAB" --anchors 32 --updates-per-batch 4 \
    --loss '{"ce": 1.0, "replay_anchors": 8}' --no-feature-cache --batch-size 2 --lr 2e-3 --seed 11 \
    --max-steps "$STEPS" --save-every 200 --eval-every 400 "${dev_args[@]}" \
    --output-dir "$out" >> "$out/train.log" 2>&1
done
