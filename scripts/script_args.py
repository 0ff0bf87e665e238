"""The scripts' argument checks: the argparse types of `hf_treespark/arg_types.py` (defined there once, for the
package's commands and the scripts alike) and `check_range`, which compares two options.

The types are read from this repository's `hf_treespark/arg_types.py` without importing the package: `import
hf_treespark` imports torch and transformers (seconds before a script could refuse a bad option), and
`compare_checkouts.py` may run with another checkout's package first on `PYTHONPATH`.

    parser.add_argument("--budget", type=at_least(1))   # error: argument --budget: must be a whole number >= 1, got '0'
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType


def _arg_types() -> ModuleType:
    """This repository's `hf_treespark/arg_types.py` as a module of its own (it imports nothing of the package)."""
    path = Path(__file__).resolve().parents[1] / "hf_treespark" / "arg_types.py"
    spec = importlib.util.spec_from_file_location("_treespark_arg_types", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_types = _arg_types()
at_least = _types.at_least
auto_or_at_least = _types.auto_or_at_least
whole_numbers = _types.whole_numbers
positive_number = _types.positive_number
non_negative_number = _types.non_negative_number
probability = _types.probability
names_from = _types.names_from
existing_file = _types.existing_file
existing_dir = _types.existing_dir
output_file = _types.output_file
output_file_and_folders = _types.output_file_and_folders
output_dir = _types.output_dir
drafter_dir = _types.drafter_dir


def check_range(parser: argparse.ArgumentParser, start: int, stop: int, start_flag: str = "--start",
                stop_flag: str = "--stop") -> None:
    """Exit through `parser.error` (status 2, one line naming both options and their values) unless `start < stop`:
    the half-open range `start..stop-1` would be empty, and the script would end having done nothing."""
    if start >= stop:
        parser.error(f"argument {start_flag}: {start_flag} {start} is not below {stop_flag} {stop}, so there is "
                     f"nothing to do: give {start_flag} S {stop_flag} E with S < E (S to E-1 are done)")
