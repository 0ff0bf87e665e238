"""The `treespark` console command's entry point, outside the package so that `--help` and `--version` are instant.

`import hf_treespark` imports torch and transformers (it registers the drafter with transformers' auto
classes and routes `generate()`): several seconds. Parsing the command line needs neither. So this
module makes the package's modules importable without running its `__init__`, parses the command line
with `hf_treespark.cli.commands`, and runs the package's `__init__` (the whole `import hf_treespark`) just before
the command itself runs. `python -m hf_treespark.cli.commands` and `hf_treespark.cli.commands.main` work as before.

The options of bench, train, train-depth1, distil and export come from the modules that run them, which import
torch: their `--help` takes that import (a few seconds), though still not the package's `__init__`.
"""

from __future__ import annotations

import importlib.util
import sys


def main(argv: list[str] | None = None) -> int:
    if "hf_treespark" in sys.modules:  # already imported (a script, a test): nothing to defer
        from hf_treespark.cli.commands import main as run

        return run(argv)
    spec = importlib.util.find_spec("hf_treespark")
    package = importlib.util.module_from_spec(spec)
    sys.modules["hf_treespark"] = package  # its submodules import now; its __init__ runs below
    from hf_treespark.cli.commands import main as run

    return run(argv, before_command=lambda: spec.loader.exec_module(package))


if __name__ == "__main__":
    sys.exit(main())
