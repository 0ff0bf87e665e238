"""`python -m hf_treespark.cli`: the `treespark` command (`cli.commands`)."""

import sys

from .commands import main

sys.exit(main())
