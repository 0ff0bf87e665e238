"""Train a TreeSpark drafter: the same as `treespark train` (see `hf_treespark/training/cli.py`).

    python examples/train_drafter.py --target default --data training_data/*.jsonl.gz \\
        --preset treespark --output-dir runs/treespark

    # several CPU processes: one run, the batch split over them
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/train_drafter.py --data refs.jsonl ...

`python examples/train_drafter.py --help` lists every option with its default. Ctrl-C stops a run with one line
naming the checkpoint that the same command resumes from.
"""

import sys

from hf_treespark.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
