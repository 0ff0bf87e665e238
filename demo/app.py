"""The TreeSpark Gradio demo: `python demo/app.py [--target NAME_OR_PATH] [--drafter NAME_OR_PATH] [--port 7860]`.

The same as `treespark demo`. The app itself lives in the package (so the installed command has it):
the page in `hf_treespark/demo/page.py`, the run it drives in `hf_treespark/demo/run.py`; `build_app` is
re-exported here for scripts that want the `gr.Blocks` object.
"""

from __future__ import annotations

import sys

from hf_treespark.cli.commands import main as treespark_main
from hf_treespark.demo.page import build_app, launch

__all__ = ["build_app", "launch", "main"]


def main(argv: list[str] | None = None) -> int:
    """Parse `--target --drafter --host --port --share --dtype` and serve the app until Ctrl+C."""
    return treespark_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
