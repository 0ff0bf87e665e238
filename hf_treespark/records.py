"""Reading JSONL records (plain or gzip-compressed), one line at a time, with errors that name the file and line.

Shared by the draft-vocabulary ranking (`draft_vocab.py`) and training data (`training/data.py`): both read the
target's answers as `treespark train` writes them.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path


def json_records(path: Path, parse) -> Iterator[tuple[int, tuple[dict, object]]]:
    """`(line number, (record, parse(record)))` for each non-empty line of a JSONL file (gzip-compressed when its
    name ends in `.gz`).

    A line that is not UTF-8 text, not a JSON object, or that `parse` rejects with `ValueError`, raises
    `ValueError` naming the file and line.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:  # decoded line by line: a decoding error names its own line
        line_no = 0
        try:
            for line_no, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                                     f"{e.start + 1} of the line); save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not a JSON line ({e})") from None
                try:
                    if not isinstance(record, dict):
                        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                    parsed = parse(record)
                except ValueError as e:
                    raise ValueError(f"{path}:{line_no}: {e}") from None
                yield line_no, (record, parsed)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a damaged or cut-short .gz file
            if line_no == 0 and isinstance(e, gzip.BadGzipFile):
                raise ValueError(f"{path}: not a gzip file ({e}), though its name ends in .gz; compress it with "
                                 "gzip or drop the .gz") from None
            raise ValueError(f"{path}: not a complete gzip file after line {line_no} ({e}); copy it again") from None
