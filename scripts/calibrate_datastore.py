"""Fit the datastore's step-probability calibration (`hf_treespark.sources.datastore.DATASTORE_CALIBRATION`).

A store is built from the target's responses in every reference file but the held-out one; at every other
position of the first `--positions` tokens of 300 held-out answers, each node of the retrieved trie whose parent
path is the target's real continuation is one example: features `logit(share')`, `log(context)`,
`log(parent count)` (see the module docstring), label whether its token is the target's next one. A logistic
regression (Newton's method) gives the coefficients; the script prints them, the calibration by decile, and
the accepted tokens per position of the retrieved tree with the fitted and with the shipped coefficients.

    .venv/bin/python scripts/calibrate_datastore.py \\
        --store ../shared/data/sharegpt_smollm2_regen.jsonl training_data/sharegpt_turns_smollm2_regen.jsonl.gz \\
        --heldout ../shared/data/sharegpt_smollm2_regen_part2.jsonl
"""

from __future__ import annotations

import argparse
import math
import random

import numpy as np
from script_args import at_least, existing_file


def examples(store, heldout, positions: int):
    from hf_treespark.sources import datastore

    rows, labels = [], []
    for ref in heldout:
        ids, start = ref.input_ids, ref.prompt_len
        for t in range(start + 1, min(len(ids) - 1, start + positions), 2):
            n, counts, total = store.counts(ids[:t])
            if n == 0:
                continue
            truth = tuple(ids[t:t + datastore.DEPTH])
            for prefix, count in counts.items():
                if prefix[:-1] != truth[: len(prefix) - 1]:
                    continue  # only nodes whose parent was right: the step probability is conditional
                parent = counts.get(prefix[:-1], total)
                share = (count + 0.5) / (parent + 1.0)
                rows.append((1.0, math.log(share / (1 - share)), math.log(n + len(prefix) - 1), math.log(parent)))
                labels.append(float(len(truth) >= len(prefix) and truth[len(prefix) - 1] == prefix[-1]))
    return np.array(rows), np.array(labels)


def fit(x: np.ndarray, y: np.ndarray, steps: int = 25) -> np.ndarray:
    w = np.zeros(x.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-x @ w))
        grad = x.T @ (y - p)
        hess = (x * (p * (1 - p))[:, None]).T @ x + 1e-6 * np.eye(x.shape[1])
        w += np.linalg.solve(hess, grad)
    return w


def accepted_per_position(store, heldout, positions: int) -> float:
    total = count = 0
    for ref in heldout:
        ids, start = ref.input_ids, ref.prompt_len
        for t in range(start + 1, min(len(ids) - 1, start + positions), 2):
            nodes = store.branches(ids[:t])
            depth_ok = {-1: 0}
            for i, (parent, token, _) in enumerate(nodes):
                d = depth_ok.get(parent)
                if d is not None and t + d < len(ids) and ids[t + d] == token:
                    depth_ok[i] = d + 1
            total += max(depth_ok.values())
            count += 1
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=existing_file, nargs="+", required=True)
    parser.add_argument("--heldout", type=existing_file, required=True)
    parser.add_argument("--num-heldout", type=at_least(1), default=300)
    parser.add_argument("--positions", type=at_least(2), default=128)
    args = parser.parse_args()

    from hf_treespark.sources import datastore
    from hf_treespark.sources.datastore import Datastore, sequences_from_references
    from hf_treespark.training.data import load_references

    try:
        heldout = load_references(args.heldout, max_length=1 << 30)
        if not heldout:
            raise ValueError(f"--heldout {args.heldout} holds no reference sequences (prompt_ids, response_ids)")
        stored = load_references(args.store, max_length=1 << 30)
        if not stored:
            raise ValueError(f"--store {' '.join(args.store)}: no reference sequences (prompt_ids, response_ids)")
    except ValueError as err:
        parser.error(str(err))
    store = Datastore.build(sequences_from_references(stored), 1 << 30)
    random.seed(0)
    heldout = random.sample(heldout, min(args.num_heldout, len(heldout)))
    x, y = examples(store, heldout, args.positions)
    if not len(y):
        parser.error("no held-out position has a match in the store: nothing to fit (give more --store or "
                     "--heldout references, or a larger --positions)")
    w = fit(x, y)
    p = 1 / (1 + np.exp(-x @ w))
    coefficients = tuple(round(float(v), 2) for v in w)
    print(f"{len(y)} examples, base rate {y.mean():.3f}; coefficients a, b, c, d = {coefficients}")
    for lo in np.arange(0, 1, 0.1):
        sel = (p >= lo) & (p < lo + 0.1)
        if sel.any():
            print(f"  predicted [{lo:.1f}, {lo + 0.1:.1f}): {sel.sum():6d} nodes, observed {y[sel].mean():.3f}")
    shipped = datastore.DATASTORE_CALIBRATION
    print(f"accepted tokens per position (first {args.positions}), shipped {shipped}: "
          f"{accepted_per_position(store, heldout, args.positions):.3f}")
    datastore.DATASTORE_CALIBRATION = tuple(float(v) for v in w)
    print(f"accepted tokens per position (first {args.positions}), fitted: "
          f"{accepted_per_position(store, heldout, args.positions):.3f}")


if __name__ == "__main__":
    main()
