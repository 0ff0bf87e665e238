"""Where hf_treespark keeps what it computes once: converted models and measured round latencies."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """`$HF_TREESPARK_CACHE`, or `~/.cache/hf_treespark`."""
    return Path(os.environ.get("HF_TREESPARK_CACHE", Path.home() / ".cache" / "hf_treespark"))


def unwritable_reason(folder: Path) -> str | None:
    """Why files cannot be written in `folder` (created if missing), or None when they can.

    Tried for real (a file is created and removed): permission bits say nothing to root, and a read-only
    file system refuses whoever asks."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as err:
        return f"{err.filename or folder}: {err.strerror or err}"
    return None
