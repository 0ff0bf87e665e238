"""What the `treespark` commands share: `--help` with every default, one-line errors, and the options several
commands take (`--device`, `--dtype`, `--cpu-pack`); the argparse types that check values are `arg_types`'s. It
imports no torch at module level: the command line is parsed before anything heavy is imported (`treespark --help`
answers at once); `resolve_device` imports it when a command runs."""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module imports no torch
    import torch

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")  # `--dtype`: "auto" and `precision.DTYPES`
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's names, taken as the short ones
DTYPE_HELP = "precision of the models; auto: bf16 where the device computes it natively, else fp32"
DEVICE_KINDS = ("cpu", "cuda", "mps")
DEVICE_HELP = "where the models run: cpu, cuda, cuda:N or mps; auto: cuda when this machine has a CUDA GPU, else cpu"
CPU_PACK_CHOICES = ("auto", "on", "off")
CPU_PACK_HELP = ("linear layers through prepacked oneDNN kernels (cheaper multi-token verify forwards on a CPU); "
                 "auto: on for a CPU with oneDNN")


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


def add_device_option(parser: argparse.ArgumentParser, help: str = DEVICE_HELP) -> None:
    """`--device DEVICE` (default auto), checked when the command runs (`resolve_device`), not at parsing: parsing
    imports no torch."""
    parser.add_argument("--device", default="auto", metavar="DEVICE", help=help)


def add_dtype_option(parser: argparse.ArgumentParser, help: str = DTYPE_HELP) -> None:
    """`--dtype auto|fp32|bf16|fp16` (default auto); torch's names (`bfloat16`, ...) are taken as the short ones."""
    parser.add_argument("--dtype", type=_dtype_name, choices=DTYPE_CHOICES, default="auto", help=help)


def _dtype_name(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


def torch_dtype_name(text: str) -> str:
    """argparse type of a `--dtype` whose choices are torch's names (`treespark export`): the short names every
    other command takes (`bf16`, `fp32`, `fp16`) are read as those."""
    return {short: name for name, short in DTYPE_ALIASES.items()}.get(text, text)


def resolve_device(text: str, option: str = "--device", kinds: tuple[str, ...] = DEVICE_KINDS) -> torch.device:
    """The `torch.device` that `--device text` names on this machine: "auto" is cuda when `torch.cuda.is_available()`,
    else cpu; cpu, cuda, cuda:N and mps must be present here. Raises `ValueError` in one line naming the option, the
    device and what this machine has (e.g. "--device cuda: this machine has no CUDA GPU; use --device cpu")."""
    import torch

    text = str(text).strip()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in kinds:
        others = "".join(f", {kind}" for kind in kinds if kind not in ("cpu", "cuda"))
        what = "is not a device" if device is None else f"is not a device this command runs on ({device.type})"
        raise ValueError(f"{option} {text!r} {what}: use cpu, cuda or cuda:N{others}, or auto (cuda when this "
                         "machine has a CUDA GPU, else cpu)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "" if torch.version.cuda or torch.version.hip else f" (torch {torch.__version__}: a CPU-only build)"
            raise ValueError(f"{option} {text}: this machine has no CUDA GPU{build}; use {option} cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{option} {text}: this machine has {count} CUDA GPU{'s' * (count != 1)}; use "
                             f"{option} cuda:0" + (f"..cuda:{count - 1}" if count > 1 else "") + f" or {option} cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{option} {text}: this machine has no MPS device (an Apple GPU); use {option} cpu")
    return device


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
    """Parse `argv`, call `run(args)`, and turn bad input into one `prog: error: ...` line (exit status 2), and Ctrl-C
    into `prog: interrupted` (status 130, the shell's for SIGINT), without a traceback."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{parser.prog}: interrupted", file=sys.stderr)
        return 130
