"""Where hf_treespark keeps what it computes once: converted models and measured round latencies."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$HF_TREESPARK_CACHE`, or `~/.cache/hf_treespark`."""
    return Path(os.environ.get("HF_TREESPARK_CACHE", Path.home() / ".cache" / "hf_treespark"))
