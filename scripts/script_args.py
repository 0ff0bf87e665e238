"""Argument types shared by the repository's scripts: each refuses a bad value with one line naming it and what to
give, from the command line alone (no torch, no model), so a script stops before it loads anything.

    parser.add_argument("--budget", type=at_least(1))   # error: argument --budget: must be a whole number >= 1, got '0'
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def at_least(minimum: int):
    """argparse type of a count: a whole number >= `minimum`."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}")
        return value

    return count


def whole_numbers(text: str) -> list[int]:
    """argparse type: whole numbers >= 1 separated by commas."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1 separated by commas, got {text!r}")
    return values


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    return value


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _finite(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_number(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _finite(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = _finite(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def existing_file(text: str) -> str:
    """argparse type: a file that exists."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def existing_dir(text: str) -> str:
    """argparse type: a directory that exists."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file: give a directory")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return text


def output_file(text: str) -> str:
    """argparse type: a file to write, in a directory that exists (an existing file is replaced only at the end)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path.parent}: no such directory (create it, or write elsewhere)")
    return text


def output_dir(text: str) -> str:
    """argparse type: a directory to write into, created when missing; refuses an existing file."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file: give a directory")
    return text


def drafter_dir(text: str) -> str:
    """argparse type: a TreeSpark drafter directory, read as far as its `config.json` (the weights load later)."""
    config = Path(existing_dir(text)) / "config.json"
    if not config.is_file():
        raise argparse.ArgumentTypeError(f"{text} has no config.json: give a trained drafter directory (e.g. "
                                         "runs/treespark/final)")
    try:
        fields = json.loads(config.read_bytes())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{config} is not JSON ({err}): save the drafter again") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type != "treespark":
        raise argparse.ArgumentTypeError(f"{config} is a {model_type!r} config, not a TreeSpark drafter's: give a "
                                         "drafter directory (e.g. runs/treespark/final)")
    return text


def check_range(parser: argparse.ArgumentParser, start: int, stop: int, start_flag: str = "--start",
                stop_flag: str = "--stop") -> None:
    """Exit through `parser.error` (status 2, one line naming both options and their values) unless `start < stop`:
    the half-open range `start..stop-1` would be empty, and the script would end having done nothing."""
    if start >= stop:
        parser.error(f"argument {start_flag}: {start_flag} {start} is not below {stop_flag} {stop}, so there is "
                     f"nothing to do: give {start_flag} S {stop_flag} E with S < E (S to E-1 are done)")
