"""What the `treespark` commands share: `--help` with every default, one-line errors, and the choices of
options several commands take. It imports no torch: the command line is parsed before anything heavy
is imported (`treespark --help` answers at once)."""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")  # `--dtype`: "auto" and `precision.DTYPES`
CPU_PACK_CHOICES = ("auto", "on", "off")
CPU_PACK_HELP = ("linear layers through prepacked oneDNN kernels (cheaper multi-token verify forwards on a CPU); "
                 "auto: on for a CPU with oneDNN")


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


def refuse_empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`parser.error` naming the first option of `parser` given an empty (or blank) value: `--batch-size ""` is a
    mistake, never a way to ask for the default."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            name = action.option_strings[-1] if action.option_strings else action.dest
            parser.error(f"{name} is empty: give a value" + ("" if action.required or not action.option_strings
                                                            else ", or leave the option out for its default"))


def cpu_pack_option(value: str) -> bool | str:
    """The command-line `--cpu-pack auto|on|off` as `cpu_gemm.should_pack` takes it."""
    return {"auto": "auto", "on": True, "off": False}[value]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` shows each option's default once, options without help text included (None and False left out;
    a help text that already says `(default: ...)` is shown as written)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or action.default is False or "%(default)" in help_text \
                or "(default:" in help_text:
            return action.help or ""
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if not action.help and action.option_strings and shown:
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


def run_script(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int],
               argv: list[str] | None = None) -> int:
    """Parse `argv`, call `run(args)`, and turn bad input into one `prog: error: ...` line (exit status 2)."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
