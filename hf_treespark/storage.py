"""Where hf_treespark keeps what it computes once: converted models and measured round latencies."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout


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


def acquire_lock(lock: Path, timeout: float, notice_after: float, notice: str) -> FileLock:
    """Take the lock file `lock` (`filelock`: `flock` on Linux and macOS, `msvcrt` on Windows; the operating system
    lets go of it when its holder exits, however it exits), waiting at most `timeout` seconds for another process
    that holds it.

    Takes the lock file's path, the longest wait in seconds (0: one try), after how many seconds of waiting to print
    `notice` (one line, which should name `lock` and what its holder is doing) on stderr, and that line.
    Returns the held lock: the caller releases it (`.release()`). Raises `filelock.Timeout` when another process
    held the lock all that time (no line is printed when `timeout <= notice_after`), and `OSError`, whose
    `filename` is the file that failed, when the lock file cannot be created or opened.
    """
    held = FileLock(str(lock))
    first = min(notice_after, timeout)
    try:
        held.acquire(timeout=first)
    except Timeout:
        if first >= timeout:
            raise
        print(notice, file=sys.stderr, flush=True)
        held.acquire(timeout=timeout - first)
    return held
