"""Every shell command in the README and the usage pages parses, and reads only files that ship in the repository.

The commands are the lines of the pages' shell code blocks (continuation lines joined, comments dropped, `&&` and `;`
split) whose program is `treespark`, `python` or `bash scripts/...` (a `.venv/bin/` prefix and leading `VAR=value`
assignments allowed). Each is checked the way CI can afford, in a clean clone (`.ci/run` runs this file):

* `treespark VERB ...`: the `treespark` parser itself (`cli.commands.parse`) takes the arguments;
* `python SCRIPT.py ...` and `python -m MODULE ...`: the script runs in a subprocess until its `argparse` parser has
  taken the arguments, then stops (`python -m pytest ...`: the test files named exist);
* `bash scripts/X.sh`: the script exists and `bash -n` reads it;
* every argument naming a path under a folder the repository ships (`training_data/`, `examples/`, ...) exists (a
  glob matches at least one file), and no argument reaches outside the repository (`../`, an absolute path).

`problems` is what the tests call; its own test shows that it catches an unknown option, a missing file and a path
outside the repository.
"""

from __future__ import annotations

import contextlib
import glob
import io
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from hf_treespark.cli import commands

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/usage.md", "docs/demo.md", "docs/devices.md")
SHELL_FENCES = ("bash", "sh", "shell", "console")
SHIPPED = ("training_data", "examples", "scripts", "docs", "tests", "demo", "hf_treespark")  # folders in a clone
SEPARATORS = ("&&", "||", ";", "|")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

# Runs a script or module until its argparse parser has taken the command line, then exits 0 (an unknown option:
# argparse's own exit status 2). A script that never parses ends with status 3.
PARSE_ONLY = """
import argparse, os, runpy, sys

parse_args = argparse.ArgumentParser.parse_args


def parse_and_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise SystemExit(0)


argparse.ArgumentParser.parse_args = parse_and_stop
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
sys.exit(3)
"""


def shell_commands(page: str) -> list[tuple[int, str]]:
    """`(line number, command)` of each command in `page`'s shell code blocks."""
    found, fence, pending, start = [], None, "", 0
    for number, line in enumerate((REPO / page).read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip() if fence is None else None
            continue
        if fence not in SHELL_FENCES:
            continue
        if not pending:
            start = number
        pending += stripped.removeprefix("$ ")
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError as err:
            found.append((start, f"<unreadable: {err}> {pending}"))
            words = []
        pending = ""
        command: list[str] = []
        for word in [*words, ";"]:
            if word not in SEPARATORS:
                command.append(word)
                continue
            if _program(command)[0] is not None:
                found.append((start, shlex.join(command)))
            command = []
    return found


def _program(words: list[str]) -> tuple[str | None, list[str]]:
    """`(kind, arguments)`: kind "treespark", "python" or "bash", or None for any other program."""
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words:
        return None, []
    name = words[0].removeprefix(".venv/bin/")
    if name == "treespark":
        return "treespark", words[1:]
    if name in ("python", "python3"):
        return "python", words[1:]
    if name == "bash" and len(words) > 1 and words[1].startswith("scripts/"):
        return "bash", words[1:]
    return None, []


def problems(command: str) -> list[str]:
    """What is wrong with `command` (empty when it parses and names only files that exist)."""
    if command.startswith("<unreadable"):
        return [command]
    kind, words = _program(shlex.split(command))
    found, args = [], []
    for word in words:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if value.startswith(("../", "~/")) or (value.startswith("/") and not value.startswith(str(REPO))):
            found.append(f"{value!r} is outside the repository: a clone does not have it")
        if any(ch in value for ch in "*?[") and value.split("/")[0] in SHIPPED:
            matches = sorted(glob.glob(value, root_dir=REPO))
            if not matches:
                found.append(f"{value!r} matches no file")
            args.extend(matches if word == value else [word])
            continue
        path = value.split("::")[0]
        if path.split("/")[0] in SHIPPED and "/" in path.rstrip("/") and not (REPO / path).exists():
            found.append(f"{path!r}: no such file in the repository")
        args.append(word)
    if kind == "treespark":
        found += _treespark_problems(args)
    elif kind == "python":
        found += _python_problems(tuple(args))
    elif kind == "bash" and (REPO / args[0]).is_file():
        done = subprocess.run(["bash", "-n", args[0]], cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            found.append(f"bash -n {args[0]}: {done.stderr.strip()}")
    return found


def _treespark_problems(argv: list[str]) -> list[str]:
    """The `treespark` parser's complaint about `argv`, if any."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            commands.parse(argv)
    except SystemExit as exit_info:
        if exit_info.code not in (0, None):
            return [f"treespark {shlex.join(argv)}: {errors.getvalue().strip().splitlines()[-1]}"]
    return []


@cache
def _python_problems(argv: tuple[str, ...]) -> list[str]:
    """Whether `python ARGV` parses its command line (`PARSE_ONLY`); `-m pytest`: the files it names exist."""
    if argv[:2] == ("-m", "pytest"):
        return []  # its paths were checked with the others; what it collects is the suite's business
    if not argv or (argv[0] != "-m" and not (REPO / argv[0]).is_file()):
        return [f"python {shlex.join(argv)}: no such script"]
    done = subprocess.run([sys.executable, "-c", PARSE_ONLY, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    if done.returncode == 0:
        return []
    why = "it never parsed a command line" if done.returncode == 3 else (done.stderr.strip().splitlines() or ["?"])[-1]
    return [f"python {shlex.join(argv)}: exit {done.returncode}: {why}"]


ALL = [(page, number, text) for page in PAGES for number, text in shell_commands(page)]


@pytest.mark.parametrize(("page", "number", "command"), ALL,
                         ids=[f"{page}:{number}:{_program(shlex.split(text))[0]}" for page, number, text in ALL])
def test_every_documented_command_parses_and_names_files_that_ship(page, number, command):
    assert problems(command) == [], f"{page}:{number}: {command}"


def test_the_pages_hold_the_commands_they_document():
    """The extraction finds what the pages show (a broken extraction must not pass by finding nothing)."""
    found = {page: [text for _, text in shell_commands(page)] for page in PAGES}
    assert any(text.startswith(".venv/bin/treespark train --target default --data 'training_data/")
               for text in found["README.md"])
    assert "bash scripts/setup.sh" in found["README.md"]
    assert sum(text.startswith(".venv/bin/treespark ") for text in found["docs/usage.md"]) >= 4
    assert all(found.values()), found


def test_a_command_with_an_unknown_option_a_missing_file_or_a_path_outside_the_repository_is_caught():
    assert problems(".venv/bin/treespark generate --prompt 'Hi there' --compare") == []
    unknown = problems(".venv/bin/treespark generate --prompt hi --no-such-option")
    assert len(unknown) == 1 and "unrecognized arguments: --no-such-option" in unknown[0], unknown
    choice = problems("treespark bench --dtype fp64")
    assert len(choice) == 1 and "invalid choice: 'fp64'" in choice[0], choice
    outside = problems("treespark train --data ../shared/data/x.jsonl --output-dir runs/x")
    assert outside == ["'../shared/data/x.jsonl' is outside the repository: a clone does not have it"]
    assert problems("treespark train --data training_data/nothing_*.jsonl.gz --output-dir runs/x") == [
        "'training_data/nothing_*.jsonl.gz' matches no file"]
    assert problems("bash scripts/no_such_script.sh") == ["'scripts/no_such_script.sh': no such file in the repository"]
    script = problems(".venv/bin/python examples/train_drafter.py --output-dir runs/x --no-such-option")
    assert len(script) == 1 and "unrecognized arguments: --no-such-option" in script[0], script
