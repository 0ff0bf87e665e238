"""Learning curves of several training runs on one figure: development-set acceptance length and depth-1
acceptance against training anchors seen (the `metrics.jsonl` that `treespark train --eval-every` writes).

    python scripts/plot_runs.py docs/training/runs.png "ce 0.1=runs/a/metrics.jsonl" "ce 1.0=runs/b/metrics.jsonl"
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_png")
    parser.add_argument("runs", nargs="+", help="LABEL=METRICS_JSONL")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_treespark.training.evaluate import read_curve

    fig, (length, depth1) = plt.subplots(1, 2, figsize=(11, 4))
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"{spec!r}: give LABEL=METRICS_JSONL")
        rows = read_curve(path)
        if not rows:
            parser.error(f"{path} has no development-set evaluation")
        anchors = [r["anchors_seen"] for r in rows]
        length.plot(anchors, [r["dev_acceptance_length"] for r in rows], "o-", label=label)
        depth1.plot(anchors, [100 * r["dev_depth_rates"][0] for r in rows], "s-", label=label)
    length.set_ylabel("acceptance length (dev set)")
    depth1.set_ylabel("depth-1 acceptance (%)")
    for ax in (length, depth1):
        ax.set_xlabel("training anchors seen")
        ax.grid(alpha=0.3)
    length.legend(loc="upper left", fontsize="small")  # rising curves leave that corner free
    fig.tight_layout()
    Path(args.out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out_png, dpi=110)
    print(args.out_png)


if __name__ == "__main__":
    main()
