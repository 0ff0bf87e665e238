"""Training throughput (anchors/s) per preset and setting, on the offline default target and the shared data.

Each row builds a fresh drafter for the preset, runs `--warmup` optimizer steps, then times `--steps` more,
all in this one process (so the rows are comparable), and prints a Markdown table:

    python scripts/train_throughput.py --data ../shared/data/sharegpt_smollm2_regen.jsonl

Target features are computed per step (`--feature-cache DIR` fills a cache there first, untimed, and reads it
instead); the "target" column is the part of a step spent in that forward (or in reading the cache).
"""

from __future__ import annotations

import argparse
import time

from script_args import at_least, existing_file, output_dir

ROWS = [  # (preset, draft vocabulary size or None, replay anchors per sequence or None)
    ("dspark", None, None),
    ("dspark", 16384, None),
    ("dspark_tree", 16384, None),
    ("treespark", None, None),
    ("treespark", 16384, None),
    ("treespark", 16384, 16),
    ("treespark", 16384, 8),
    ("treespark", 8192, 16),
]


def measure(target, references, preset: str, vocab: int | None, replay: int | None, args) -> dict:
    import torch

    from hf_treespark.drafter.configuration import TreeSparkConfig
    from hf_treespark.drafter.modeling import TreeSparkDrafter
    from hf_treespark.training.cli import DEFAULT_MASK_TOKEN_ID, set_draft_vocabulary
    from hf_treespark.training.trainer import PRESETS, TrainConfig, Trainer, fill_feature_cache

    torch.manual_seed(0)
    drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, mask_token_id=DEFAULT_MASK_TOKEN_ID,
                                                          **PRESETS[preset][1]))
    drafter = set_draft_vocabulary(drafter, vocab, references)
    config = TrainConfig(output_dir=args.output_dir, preset=preset, max_steps=10**6, batch_size=args.batch_size,
                         anchors_per_sequence=args.anchors, save_every=10**6, log_every=10**6,
                         feature_cache=args.feature_cache, loss={"replay_anchors": replay})
    trainer = Trainer(config, target, drafter, references)
    if trainer.feature_cache is not None:  # filled before the clock starts, as `Trainer.train` does
        fill_feature_cache(trainer.feature_cache, target, drafter.config.target_layer_ids, references, progress=False)
    loader = iter(trainer._epoch_loader(0, 0))
    for _ in range(args.warmup):
        trainer.train_step(next(loader), 0)
    seen, seconds, target_seconds = trainer.anchors_seen, 0.0, 0.0
    for _ in range(args.steps):
        batch = next(loader)
        start = time.perf_counter()
        with torch.no_grad():
            trainer._features(batch)
        target_seconds += time.perf_counter() - start
        start = time.perf_counter()
        trainer.train_step(batch, 0)
        seconds += time.perf_counter() - start
    anchors = trainer.anchors_seen - seen
    return {"anchors_per_s": anchors / seconds, "step_s": seconds / args.steps,
            "target_share": target_seconds / seconds}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` with each option's default and the docstring as written (parsing imports no torch)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data", type=existing_file, nargs="+", required=True, help="reference JSONL files")
    p.add_argument("--sequences", type=at_least(1), default=64, help="references to draw batches from")
    p.add_argument("--batch-size", type=at_least(1), default=4, help="sequences per step")
    p.add_argument("--anchors", type=at_least(1), default=64, help="anchors per sequence")
    p.add_argument("--warmup", type=at_least(0), default=1, help="untimed steps per row")
    p.add_argument("--steps", type=at_least(1), default=3, help="timed steps per row")
    p.add_argument("--max-length", type=at_least(2), default=512, help="tokens per reference sequence")
    p.add_argument("--feature-cache", type=output_dir,
                   help="read target features from this cache instead of a target forward")
    p.add_argument("--output-dir", type=output_dir, default="runs/throughput", help="scratch directory")
    p.add_argument("--dtype", default="auto", help="target dtype")
    args = p.parse_args()

    import torch

    from hf_treespark.hub.assets import load_default_target
    from hf_treespark.precision import dtype_name, resolve_dtype
    from hf_treespark.training.data import check_token_ids, load_references

    try:
        resolve_dtype(args.dtype)
    except ValueError as err:
        p.error(f"argument --dtype: {err}")
    try:  # read before the target loads (the token ids are checked against its vocabulary once it has)
        references = load_references(args.data, max_length=args.max_length, limit=args.sequences)
    except ValueError as err:
        p.error(str(err))
    batches = -(-len(references) // args.batch_size)
    if batches < args.warmup + args.steps:
        p.error(f"--data gives {len(references)} reference sequence(s): {batches} batch(es) of --batch-size "
                f"{args.batch_size}, fewer than --warmup {args.warmup} + --steps {args.steps}; give more data "
                "(or a larger --sequences), or fewer steps")
    target, _ = load_default_target(dtype=args.dtype)
    try:
        check_token_ids(references, target.config.vocab_size)
    except ValueError as err:
        p.error(f"--data: {err}")
    print(f"target dtype {dtype_name(next(target.parameters()).dtype)}, {torch.get_num_threads()} threads, "
          f"batch {args.batch_size} x {args.anchors} anchors, {args.steps} timed steps per row")
    print("| preset | draft vocabulary | replayed anchors / sequence | anchors/s | s / step | target forward share |")
    print("|---|---|---|---|---|---|")
    for preset, vocab, replay in ROWS:
        r = measure(target, references, preset, vocab, replay, args)
        print(f"| {preset} | {vocab or 'full (49,152)'} | {replay or 'all'} | {r['anchors_per_s']:.1f} | "
              f"{r['step_s']:.2f} | {r['target_share']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
