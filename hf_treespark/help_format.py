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


def cpu_pack_option(value: str) -> bool | str:
    """The command-line `--cpu-pack auto|on|off` as `cpu_gemm.should_pack` takes it."""
    return {"auto": "auto", "on": True, "off": False}[value]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` shows each option's default, options without help text included (None and False left out)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "%(default)" in (action.help or ""):
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
