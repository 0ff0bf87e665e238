"""Distillation throughput (positions/s) per phase, on the offline default target and the shipped drafter.

For each max length and batch size (windows per target forward), `treespark distil`'s default source (ShareGPT
conversations, assistant positions) gives `--batches` timed batches, after one untimed, and each phase is timed apart:

    target forward   the teacher-forced forward: the features and the labels (the target's argmax)
    drafter h_1      the drafter's block passes, the depth-1 head off, over every labelled anchor
    training step    optimizer steps of `--train-batch-size` positions on a fresh depth-1 head of `--width`
    end to end       positions / (target + drafter + the training time of `--passes` samples per position)

    python scripts/distil_throughput.py --batch-sizes 1,4,8 --max-lengths 256,512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_args import at_least, positive_number, whole_numbers  # noqa: E402


def measure(target, drafter, windows, batch_size: int, args) -> dict:
    import torch

    from hf_treespark.training.distill_extract import distil_batch
    from hf_treespark.training.distill_stream import DistilTrainer

    batches = [[next(windows) for _ in range(batch_size)] for _ in range(args.batches + 1)]
    distil_batch(target, drafter, batches[0], anchors=args.anchors)  # untimed: first-call costs
    seconds, parts = {}, []
    for batch in batches[1:]:
        parts.append(distil_batch(target, drafter, batch, seconds=seconds, anchors=args.anchors))
    data = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    positions = len(data["label"])
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = DistilTrainer(drafter, scratch, fingerprint="", batch_size=args.train_batch_size, warmup=1)
        rows = [torch.randint(positions, (args.train_batch_size,), generator=generator)
                for _ in range(args.train_steps + 1)]
        trainer.train_step(data, rows[0], 10**6)  # untimed
        start = time.perf_counter()
        for chosen in rows[1:]:
            trainer.train_step(data, chosen, 10**6)
        train_rate = args.train_steps * args.train_batch_size / (time.perf_counter() - start)
    drafter.eval()
    total = seconds["target"] + seconds["drafter"] + args.passes * positions / train_rate
    return {"tokens": sum(len(s.input_ids) for b in batches[1:] for s in b) / args.batches,
            "positions": positions / args.batches, "target": positions / seconds["target"],
            "drafter": positions / seconds["drafter"], "train": train_rate, "end_to_end": positions / total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=whole_numbers, default=[1, 4, 8], help="windows per target forward")
    p.add_argument("--max-lengths", type=whole_numbers, default=[256, 512], help="tokens per window")
    p.add_argument("--batches", type=at_least(1), default=2, help="timed batches per row")
    p.add_argument("--train-steps", type=at_least(1), default=5, help="timed optimizer steps per row")
    p.add_argument("--train-batch-size", type=at_least(1), default=256, help="positions per optimizer step")
    p.add_argument("--passes", type=positive_number, default=1.0, help="optimizer samples per position, for end to end")
    p.add_argument("--positions", choices=("assistant", "all"), default="assistant")
    p.add_argument("--anchors", choices=("agreeing", "all"), default="agreeing",
                   help="agreeing: positions whose token is the target's argmax at the one before (distil's default)")
    p.add_argument("--width", type=at_least(1), default=2048, help="the depth-1 head's MLP width")
    p.add_argument("--dtype", default="auto", help="the target's dtype")
    args = p.parse_args()

    import torch

    from hf_treespark import load_default_drafter, load_default_target
    from hf_treespark.training.depth1 import grow_depth1_head
    from hf_treespark.training.distill_sources import text_sequences

    target, tokenizer = load_default_target(dtype=args.dtype)
    drafter = grow_depth1_head(load_default_drafter(dtype=torch.float32), args.width).bind_target(target).eval()
    print(f"target {next(target.parameters()).dtype}, {torch.get_num_threads()} threads, {args.positions} positions, "
          f"{args.anchors} anchors, "
          f"{args.batches} timed batches and {args.train_steps} steps of {args.train_batch_size} per row")
    print("| max length | windows / forward | tokens / forward | positions / forward | target forward pos/s | "
          "drafter h_1 pos/s | training pos/s | end to end pos/s |")
    print("|---|---|---|---|---|---|---|---|")
    for max_length in args.max_lengths:
        for batch_size in args.batch_sizes:
            windows = text_sequences(["sharegpt"], tokenizer, args.positions, max_length)  # the same text per row
            r = measure(target, drafter, windows, batch_size, args)
            print(f"| {max_length} | {batch_size} | {r['tokens']:.0f} | {r['positions']:.0f} | {r['target']:.0f} | "
                  f"{r['drafter']:.0f} | {r['train']:.0f} | {r['end_to_end']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
