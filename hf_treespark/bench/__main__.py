"""`python -m hf_treespark.bench`: the benchmark (`bench.run`)."""

import sys

from .run import main

sys.exit(main())
