"""The package keeps one room per idea: sizes a reader can hold, and imports that only run downwards.

Read from the source with `ast` (nothing is imported): every function under 120 lines, every class under 250,
every module under 600; each module sits in a layer of `LAYERS` and imports only from its own layer or lower
ones. A new module must be given a layer here, which is the point: where it sits is a decision, not an accident.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_treespark"
MAX_FUNCTION, MAX_CLASS, MAX_MODULE = 120, 250, 600

# The one module that defines argparse types (functions raising `argparse.ArgumentTypeError`), and the parsers of a
# format that only one script reads, which stay beside it (not a count, number, list, file or directory).
ARG_TYPES = PACKAGE / "arg_types.py"
ONE_SCRIPT_FORMATS = {
    ("scripts/plot_runs.py", "run_spec"),  # LABEL=METRICS_JSONL
    ("scripts/profile_train_step.py", "target_spec"),  # ARCH[:VOCAB[:DTYPE]]
}

# Lowest first. A module may import from its own layer and the layers before it, never from a later one. A
# subpackage is one layer (its modules import each other freely, without cycles: tests/test_engine.py).
LAYERS = [
    # leaves: the version, the cache directory, JSON lines, dtype "auto", the shared options, the argparse types
    {"version", "storage", "records", "precision", "help_format", "arg_types"},
    # the algorithm (torch only), then the branches other than the drafter's, then the drafter
    {"core"},
    {"sources"},
    {"drafter"},
    # decoding with a drafter: session, budget, guard, the generate integration
    {"decoding"},
    # measuring a round's cost (it times the decoding session)
    {"calibration"},
    # models coming and going: the default target, loading, cards, push, export
    {"hub"},
    # the package's entry (registers the drafter, routes generate), the bench and the demo
    {"__init__", "bench", "demo"},
    # training reads everything above; nothing above reads it
    {"training"},
    # the command line: one function per subcommand, dispatching to all of the above
    {"cli"},
]


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(rel.parts)


def _layer(module: str) -> int:
    """The layer of `module` ('training.data' -> the layer of the subpackage 'training')."""
    key = module.split(".")[0]
    for i, names in enumerate(LAYERS):
        if key in names:
            return i
    raise AssertionError(f"hf_treespark/{module.replace('.', '/')}.py has no layer in tests/test_structure.py's "
                         "LAYERS: add it where it belongs")


def _imports(path: Path) -> set[str]:
    """The package modules that `path` imports, relative or absolute, at any depth of the file."""
    parts = _name(path).split(".")
    package = parts if path.name == "__init__.py" else parts[:-1]
    if parts == ["__init__"]:
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else list(package)
                stem = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hf_treespark":
                stem = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # `from . import assets` names a module; `from .x import y` names x
                candidate = stem + [alias.name]
                is_module = (PACKAGE.joinpath(*candidate).with_suffix(".py").is_file()
                             or PACKAGE.joinpath(*candidate, "__init__.py").is_file())
                found.add(".".join(candidate if is_module else stem) or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_treespark":
                    found.add(".".join(alias.name.split(".")[1:]) or "__init__")
    return found


def test_no_function_class_or_module_is_too_long_to_read():
    too_long = []
    for path in _modules():
        rel = path.relative_to(PACKAGE.parent)
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE:
            too_long.append(f"{rel}: module of {lines} lines (at most {MAX_MODULE})")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                size = node.end_lineno - node.lineno + 1
                limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                if size > limit:
                    too_long.append(f"{rel}:{node.lineno}: {node.name} is {size} lines (at most {limit})")
    assert not too_long, "split these by idea:\n" + "\n".join(too_long)


def test_imports_only_run_downwards():
    upward = []
    for path in _modules():
        module = _name(path)
        mine = _layer(module)
        for imported in sorted(_imports(path)):
            theirs = _layer(imported)
            if theirs > mine:
                upward.append(f"hf_treespark/{module.replace('.', '/')}.py (layer {mine}) imports {imported} "
                              f"(layer {theirs})")
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(upward)


def test_the_decoding_loop_imports_no_calibration_bench_cli_or_training():
    """The loop receives its cost table (`budget.use_cost_table`, wired by `import hf_treespark`): measuring,
    benchmarking, the command line and training all sit above it, and it reaches none of them."""
    forbidden = {"calibration", "bench", "cli", "training"}
    decoding = [path for path in _modules() if _name(path).split(".")[0] == "decoding"]
    assert len(decoding) > 5, "the check should see the decoding subpackage"
    found = [f"{_name(path)} imports {module}" for path in decoding for module in sorted(_imports(path))
             if module.split(".")[0] in forbidden]
    assert not found, found


def test_the_structure_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a leaf module that imports the training package is caught."""
    fake = tmp_path / "hf_treespark"
    (fake / "training").mkdir(parents=True)
    (fake / "training" / "__init__.py").write_text("")
    (fake / "training" / "data.py").write_text("X = 1\n")
    (fake / "core").mkdir()
    (fake / "core" / "tree.py").write_text("from ..training.data import X\n")
    (fake / "version.py").write_text("def main():\n" + "    pass\n" * (MAX_FUNCTION + 1))
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _imports(fake / "core" / "tree.py") == {"training.data"}
    try:
        test_imports_only_run_downwards()
    except AssertionError as e:
        assert "core/tree.py (layer 1) imports training.data" in str(e)
    else:
        raise AssertionError("an upward import was not caught")
    try:
        test_no_function_class_or_module_is_too_long_to_read()
    except AssertionError as e:
        assert f"main is {MAX_FUNCTION + 2} lines" in str(e)
    else:
        raise AssertionError("a function too long was not caught")


def _argument_type_errors(path: Path) -> list[str]:
    """The functions of `path` (nested ones by their own name) that raise `ArgumentTypeError`, however it was
    imported; `<module>` for a raise outside any function."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Raise) and child.exc is not None:
                raised = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                name = raised.attr if isinstance(raised, ast.Attribute) else getattr(raised, "id", None)
                if name == "ArgumentTypeError":
                    found.append(function)
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            visit(child, child.name if is_function else function)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_argparse_types_are_defined_once_in_arg_types():
    """Every argparse type that refuses a value (a count, a number, a list, a JSON object, a file, a directory) is
    `hf_treespark/arg_types.py`'s: the package's commands import it, the scripts through `scripts/script_args.py`.
    A function elsewhere that raises `ArgumentTypeError` is a copy waiting to drift (its wording, its bounds); only a
    parser of one script's own format is kept beside the script, named in `ONE_SCRIPT_FORMATS`."""
    root = PACKAGE.parent
    paths = [*_modules(), *sorted((root / "scripts").glob("*.py")), *sorted((root / "examples").glob("*.py"))]
    copies = [f"{path.relative_to(root)}: {function}" for path in paths if path != ARG_TYPES
              for function in _argument_type_errors(path)
              if (str(path.relative_to(root)), function) not in ONE_SCRIPT_FORMATS]
    assert not copies, "define these argparse types in hf_treespark/arg_types.py and import them:\n" + "\n".join(copies)
    assert {"_number", "existing_file", "drafter_dir"} <= set(_argument_type_errors(ARG_TYPES))  # the check sees it
    kept = {(str(path.relative_to(root)), function) for path in paths for function in _argument_type_errors(path)}
    assert ONE_SCRIPT_FORMATS <= kept, "ONE_SCRIPT_FORMATS names a parser that is gone: take it off the list"


def test_the_argument_type_check_sees_a_copy(tmp_path):
    """The check itself can fail: a type raising `ArgumentTypeError`, imported either way, nested or not."""
    copy = tmp_path / "copy.py"
    copy.write_text("import argparse\nfrom argparse import ArgumentTypeError\n\n"
                    "def positive(text):\n    raise argparse.ArgumentTypeError('no')\n\n"
                    "def at_least(minimum):\n    def count(text):\n        raise ArgumentTypeError\n"
                    "    return count\n\n"
                    "def fine(text):\n    raise ValueError(text)\n")
    assert _argument_type_errors(copy) == ["positive", "count"]
