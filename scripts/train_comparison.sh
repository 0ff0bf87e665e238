#!/usr/bin/env bash
# Issue 5's comparison: the three presets on the same data (the first 520 of the shared regenerated
# ShareGPT responses, one epoch), the same steps and the same hyper-parameters, one after the other.
# Resumable: run it again after an interruption. Then calibrate, ship and benchmark:
#   .venv/bin/treespark calibrate --drafter runs/cmp-treespark/final --num-prompts 4 --max-new-tokens 64 --budgets 2,4,8,16,32
#   .venv/bin/python scripts/ship_drafter.py runs/cmp-treespark/final
#   .venv/bin/treespark bench --num-prompts 5 --max-new-tokens 64 --output-dir docs/bench \
#       --drafter dspark=runs/cmp-dspark/final --drafter dspark_tree=runs/cmp-dspark_tree/final
set -euo pipefail
cd "$(dirname "$0")/.."
for preset in treespark dspark_tree dspark; do
  .venv/bin/python examples/train_drafter.py --target default \
    --data ../shared/data/sharegpt_smollm2_regen.jsonl --preset "$preset" \
    --output-dir "runs/cmp-$preset" --batch-size 2 --anchors 32 --max-length 512 \
    --max-sequences 520 --max-steps 260 --lr 2e-3 --save-every 20 --loss '{"ce": 1.0}' \
    --feature-cache runs/feature_cache_520
done
