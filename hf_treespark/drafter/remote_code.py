"""The package's modules as remote code: the set an entry module needs, computed from its imports, written flat.

transformers loads remote code (`trust_remote_code=True`: the drafter's `auto_map`, a `custom_generate/` folder)
from one flat folder and follows only single-dot relative imports (`from .tree import ...`). The package is
laid out in subpackages (`from ..core.tree import ...`), so what ships is flattened: every module the entry
imports, at any depth of the file (function-level imports too), copied into one folder with each relative
import rewritten to `from .<module> import ...`. The modules that ship must therefore have distinct file names
and import each other by module (`from ..core.tree import X`), never as `from . import module`.

Standard library only: this module ships as remote code itself (the drafter's `save_pretrained` imports it).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
_RELATIVE = re.compile(r"^(\s*)from (\.+)([\w.]*) import ", flags=re.MULTILINE)


class RemoteCodeError(ValueError):
    """The modules an entry needs cannot be written as one flat folder of remote code."""


def _path(module: str) -> Path:
    return PACKAGE_DIR.joinpath(*module.split(".")).with_suffix(".py")


def _resolve(module: str, level: int, name: str | None) -> str:
    """The dotted name (relative to the package) that `from <level dots><name> import` in `module` refers to."""
    package = module.split(".")[:-1]
    if level - 1 > len(package):
        raise RemoteCodeError(f"{module}: a relative import climbs out of the package")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + (name.split(".") if name else []))


def _imported(module: str) -> list[str]:
    """The package modules that `module` imports relatively, in the order they appear."""
    found = []
    for node in ast.walk(ast.parse(_path(module).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = _resolve(module, node.level, node.module)
            if not node.module or not _path(target).is_file():
                raise RemoteCodeError(f"hf_treespark/{module.replace('.', '/')}.py: `from {'.' * node.level}"
                                      f"{node.module or ''} import ...` names a package, which flat remote code "
                                      "cannot hold; import from the module itself")
            found.append(target)
    return found


def module_closure(*entries: str) -> list[str]:
    """`entries` (dotted names relative to `hf_treespark`, e.g. `"drafter.modeling"`) and every package module they
    import relatively, directly or not, sorted. Raises `RemoteCodeError` when two of them share a file name (a
    flat folder cannot hold both) or one imports a package rather than a module."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_imported(module))
    names: dict[str, str] = {}
    for module in sorted(seen):
        leaf = module.split(".")[-1]
        if leaf in names:
            raise RemoteCodeError(f"{names[leaf]} and {module} would both be {leaf}.py in a flat remote-code folder: "
                                  "rename one")
        names[leaf] = module
    return sorted(seen)


def flat_source(module: str) -> str:
    """The text of `module` with every relative import rewritten to the flat form, `from .<file name> import`."""

    def flat(match: re.Match) -> str:
        indent, dots, name = match.groups()
        return f"{indent}from .{_resolve(module, len(dots), name).split('.')[-1]} import "

    return _RELATIVE.sub(flat, _path(module).read_text(encoding="utf-8"))


def write_flat(directory: str | os.PathLike, *entries: str, rename: dict[str, str] | None = None) -> list[Path]:
    """Write `module_closure(*entries)` flat into `directory` (each module as `<file name>.py`, or as
    `rename[module]`); returns the files written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for module in module_closure(*entries):
        target = directory / (rename or {}).get(module, module.split(".")[-1] + ".py")
        target.write_text(flat_source(module), encoding="utf-8")
        written.append(target)
    return written
