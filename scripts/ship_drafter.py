"""Install a trained drafter as the package's embedded default (`hf_treespark/default_drafter/`).

    python scripts/ship_drafter.py runs/cmp-treespark/final [--table bench_results/results.md]

Stores bf16 weights (the package carries the modeling code, so no remote-code copies and no
`auto_map`), keeps the drafter's `acceptance_profile` and draft vocabulary, sets `tree_budget="auto"`
and `tree_lookup`, and writes the model card (`hf_treespark.hub.card.model_card`) with the given acceptance
table and the drafter's `acceptance_profile`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from script_args import at_least, auto_or_at_least, drafter_dir, existing_file


def keep_unchanged_datastore(shipped: Path, staged: Path) -> None:
    """Keep the shipped datastore file when the staged one holds the same tensors and metadata: safetensors writes
    metadata keys in no fixed order, so a re-save of the same datastore is a new 10 MB binary for version control."""
    if not (shipped.exists() and staged.exists()):
        return
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(shipped), "np") as old, safe_open(str(staged), "np") as new:
        same = (old.metadata() == new.metadata() and sorted(old.keys()) == sorted(new.keys())
                and all(np.array_equal(old.get_tensor(k), new.get_tensor(k)) for k in old.keys()))
    if same:
        shutil.copyfile(shipped, staged)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", type=drafter_dir, help="trained drafter directory (e.g. runs/treespark/final)")
    parser.add_argument("--table", type=existing_file,
                        help="markdown file with the acceptance table for the model card")
    parser.add_argument("--budget", type=auto_or_at_least(1), default="auto",
                        help="tree budget to ship ('auto' or an integer)")
    parser.add_argument("--lookup", type=at_least(0), default=0, help="tokens per lookup branch to ship (0 = off)")
    args = parser.parse_args(argv)
    try:
        table = Path(args.table).read_text(encoding="utf-8") if args.table else None
    except UnicodeDecodeError:
        parser.error(f"argument --table: {args.table} is not UTF-8 text: give the markdown file of the table")

    import torch
    from safetensors import SafetensorError

    from hf_treespark.drafter.modeling import TreeSparkDrafter
    from hf_treespark.hub.assets import DEFAULT_DRAFTER_DIR
    from hf_treespark.hub.sharing import save_drafter
    from hf_treespark.sources.datastore import DATASTORE_FILE

    try:
        drafter = TreeSparkDrafter.from_pretrained(args.drafter, dtype=torch.bfloat16)
        drafter.config.tree_budget = args.budget
        drafter.config.tree_lookup = args.lookup
        drafter.config.validate_fields()
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        parser.error(f"argument drafter: {args.drafter} does not load as a TreeSpark drafter ({reason})")
    staging = DEFAULT_DRAFTER_DIR.with_name("default_drafter.staging")
    shutil.rmtree(staging, ignore_errors=True)
    save_drafter(drafter, staging, acceptance_table=table, dtype=torch.bfloat16)  # whatever the source stored
    for extra in staging.glob("*.py"):
        extra.unlink()
    shutil.rmtree(staging / "custom_generate", ignore_errors=True)  # the package carries the decoding code
    config_path = staging / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("auto_map", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    TreeSparkDrafter.from_pretrained(staging)  # refuse to ship what does not load
    keep_unchanged_datastore(DEFAULT_DRAFTER_DIR / DATASTORE_FILE, staging / DATASTORE_FILE)
    shutil.rmtree(DEFAULT_DRAFTER_DIR, ignore_errors=True)
    staging.rename(DEFAULT_DRAFTER_DIR)
    size = sum(p.stat().st_size for p in DEFAULT_DRAFTER_DIR.iterdir()) / 2**20
    print(f"shipped {args.drafter} -> {DEFAULT_DRAFTER_DIR} ({size:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
