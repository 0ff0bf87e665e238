"""Every argparse type of the `treespark` commands and of the repository's scripts, each defined here once: counts,
numbers, comma-separated lists, JSON objects, files and directories. A type refuses a bad value with one line saying
what the value must be and what was given; argparse names the option:

    parser.add_argument("--budget", type=at_least(1))   # error: argument --budget: must be a whole number >= 1, got '0'

It imports no torch: a command line is parsed, and refused, before anything heavy loads (`treespark --help` answers
at once, a script stops before it loads a model). tests/test_structure.py checks that no other module of the package
or the scripts raises `argparse.ArgumentTypeError`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

# ----- counts and numbers --------------------------------------------------------------------------------------


def at_least(minimum: int) -> Callable[[str], int]:
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


def auto_or_at_least(minimum: int) -> Callable[[str], str | int]:
    """argparse type of "auto" or a count: the string "auto", or a whole number >= `minimum`."""

    def auto_or_count(text: str) -> str | int:
        if text == "auto":
            return text
        try:
            return at_least(minimum)(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be 'auto' or a whole number >= {minimum}, got {text!r}") from None

    return auto_or_count


def whole_numbers(text: str) -> list[int]:
    """argparse type: whole numbers >= 1 separated by commas, as a list."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1 separated by commas, got {text!r}")
    return values


def _number(text: str, fits: Callable[[float], bool], what: str) -> float:
    """`text` as a float when it is finite and `fits`; else an `ArgumentTypeError` saying it must be `what`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and fits(value)):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, lambda value: value > 0, "a finite number > 0")


def non_negative_number(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, lambda value: value >= 0, "a finite number >= 0")


def temperature(text: str) -> float:
    """argparse type of `--temperature`: a finite number >= 0, the error saying that 0 is greedy."""
    return _number(text, lambda value: value >= 0, "a finite number >= 0 (0 = greedy)")


def probability(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _number(text, lambda value: 0 <= value <= 1, "a number in [0, 1]")


# ----- batch sizes ---------------------------------------------------------------------------------------------

MAX_BATCH_SIZE = 256  # rows of `--batch-size(s)`; why: `_batch_sizes`'s error


def batch_sizes_option(text: str, option: str = "--batch-size") -> list[int]:
    """`--batch-size 1,2,4`: whole numbers in [1, MAX_BATCH_SIZE] (the error says why the bound). Raises
    `ValueError` naming the option."""
    return _batch_sizes(text, f"{option} {text!r}: ")


def batch_sizes(text: str) -> list[int]:
    """argparse type of `--batch-size(s) B[,B...]` (see `batch_sizes_option`): an empty value is refused."""
    try:
        return _batch_sizes(text, "")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _batch_sizes(text: str, prefix: str) -> list[int]:
    if not str(text).strip():
        raise ValueError(f"{prefix}is empty: give batch sizes, e.g. 1,2,4,8,16")
    parts = [part.strip() for part in str(text).split(",")]
    if not all(part.isascii() and part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"{prefix}expected whole numbers >= 1 separated by commas, e.g. 1,2,4,8,16; got {text!r}")
    sizes = [int(part) for part in parts]
    if max(sizes) > MAX_BATCH_SIZE:
        raise ValueError(f"{prefix}batch size {max(sizes)} is more than {MAX_BATCH_SIZE}, the most allowed: every "
                         "row keeps its own key/value cache, tree and logits (256 rows of the default target over "
                         "256 cached tokens already hold 3 GB of float32 cache), and on a CPU TreeSpark's batched "
                         f"speedup is near 1.0x by 16 rows; choose sizes in 1-{MAX_BATCH_SIZE}")
    return sizes


# ----- names and JSON ------------------------------------------------------------------------------------------


def names_from(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: names from `choices` separated by commas, at least one, none twice, as a list."""

    def names(text: str) -> list[str]:
        given = [name.strip() for name in text.split(",") if name.strip()]
        if not given or any(name not in choices for name in given) or len(set(given)) != len(given):
            raise argparse.ArgumentTypeError(f"must be names from {', '.join(choices)} separated by commas, each "
                                             f"once, got {text!r}")
        return given

    return names


def json_object(text: str) -> dict:
    """argparse type: a JSON object, as a dict."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"key\": 1.0}}', got {text!r}")
    return value


# ----- files and directories -----------------------------------------------------------------------------------


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


def output_file_and_folders(text: str) -> str:
    """argparse type: a file to write whose missing folders the caller creates; refuses a directory, and a path
    through an existing file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name")
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        raise argparse.ArgumentTypeError(f"{text}: a folder on its path is a file")
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
