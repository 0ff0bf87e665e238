"""Learning curves of several training runs on one figure: development-set acceptance length and depth-1
acceptance against training anchors seen (the `metrics.jsonl` that `treespark train --eval-every` writes).

    python scripts/plot_runs.py docs/training/runs.png "ce 0.1=runs/a/metrics.jsonl" "ce 1.0=runs/b/metrics.jsonl"
"""

from __future__ import annotations

import argparse
from pathlib import Path

from script_args import existing_file, output_file_and_folders

FIELDS = ("anchors_seen", "dev_acceptance_length", "dev_depth_rates")


def run_spec(text: str) -> tuple[str, str]:
    """argparse type of a run: `LABEL=METRICS_JSONL`, the file existing."""
    label, sep, path = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: give LABEL=METRICS_JSONL")
    return label, existing_file(path)


def read_rows(parser: argparse.ArgumentParser, path: str) -> list[dict]:
    """The development-set evaluations of one run, each with the fields the figure draws; refused by name when
    there is none or a row lacks a field."""
    from hf_treespark.training.evaluate import read_curve

    try:
        rows = read_curve(path)
    except UnicodeDecodeError:
        parser.error(f"{path} is not UTF-8 text: give the metrics.jsonl of a training run")
    if not rows:
        parser.error(f"{path} has no development-set evaluation")
    for row in rows:
        missing = [f for f in FIELDS if f not in row]
        rates = row.get("dev_depth_rates")
        if missing or not (isinstance(rates, list) and rates):
            parser.error(f"{path}: an evaluation lacks {', '.join(map(repr, missing or ['dev_depth_rates']))}: "
                         "give the metrics.jsonl of `treespark train --eval-every`")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_png", type=output_file_and_folders)
    parser.add_argument("runs", type=run_spec, nargs="+", help="LABEL=METRICS_JSONL")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (length, depth1) = plt.subplots(1, 2, figsize=(11, 4))
    kind = Path(args.out_png).suffix.lstrip(".").lower() or "png"
    formats = fig.canvas.get_supported_filetypes()
    if kind not in formats:
        parser.error(f"argument out_png: matplotlib cannot write {kind!r} figures; end the name in one of "
                     f"{', '.join(sorted(formats))}")
    curves = [(label, read_rows(parser, path)) for label, path in args.runs]  # every file checked before drawing
    for label, rows in curves:
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
