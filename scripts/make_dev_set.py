"""Regenerate the development set (`hf_treespark.training.dev_set`): its prompts answered greedily by the offline
default target (dtype "auto": bf16 on a CPU that computes it natively), at most 256 new tokens each, continuously
batched; written whole to OUTPUT (default: the committed training_data/dev/dev_set.jsonl.gz). A few minutes on a
2-core CPU; run it alone. Then prints the kinds and sizes:

    .venv/bin/python scripts/make_dev_set.py [--output training_data/dev/dev_set.jsonl.gz]
"""
import argparse
import sys
import time
from collections import Counter

from script_args import at_least, output_file_and_folders


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=output_file_and_folders, help="where to write (default: the committed file)")
    p.add_argument("--slots", type=at_least(1), default=32, help="rows answered at once")
    args = p.parse_args()

    import torch

    import hf_treespark
    from hf_treespark.training.data import load_references
    from hf_treespark.training.dev_set import DEV_MAX_LENGTH, DEV_SET_PATH, dev_kinds, generate_dev_set

    torch.manual_seed(0)
    target, tokenizer = hf_treespark.load_default_target()
    start = time.perf_counter()
    path = generate_dev_set(target, tokenizer, args.output or DEV_SET_PATH, slots=args.slots)
    refs = load_references(path, max_length=DEV_MAX_LENGTH)
    kinds = dev_kinds(path)
    tokens = Counter()
    for ref in refs:
        tokens[kinds[ref.id]] += len(ref.input_ids) - ref.prompt_len
    print(f"{path}: {len(refs)} prompts in {time.perf_counter() - start:.0f} s, target dtype {target.dtype}, "
          f"{path.stat().st_size:,} bytes")
    for kind, count in sorted(Counter(kinds.values()).items()):
        print(f"  {kind}: {count} prompts, {tokens[kind]:,} response tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
