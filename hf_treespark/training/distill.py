"""Distilling the depth-1 head from any text: the target's own argmax at every position, teacher-forced.

`treespark train-depth1` (`depth1.py`) labels a position with the next token of a response the target generated:
generation is slow and its positions fill disks. Here the label of anchor `a` is what the target itself would produce
there, `argmax p_target(. | x_0..x_a)`, read from ONE teacher-forced forward over any text: a forward of `T` tokens
labels up to `T - 1` positions, and nothing is generated. On the target's own greedy text the label is `x_{a+1}`,
`train-depth1`'s, and the fields extracted are the same (tests/test_distill.py).

    sources   ShareGPT conversations (outside the held-out band), .txt files, chat JSONL, cut into windows of
              `max_length` tokens whose anchors are the assistant turns' tokens or all (`distill_sources.py`)
    extract   B windows per target forward (`distill_extract.py`): the features at `drafter.config.target_layer_ids`,
              the label `argmax lm_head(h_final[a])`; then drafter passes, the depth-1 head off, for the anchor-slot
              state `h_1`; out come `depth1.FIELDS`: features at `a - 1` and `h_1` in bf16, `x_a`, the label
    train     `Depth1Trainer`'s optimizer, logits and learning rate, on batches drawn from a ring buffer of the last
              `buffer_positions` positions (`distill_stream.py`: nothing stored; `passes` samples per position on
              average), checkpointed with the stream's place; or (`max_disk_gb`) the positions stored as
              `PositionShards`, then trained as `train-depth1` trains its own; with `soft_targets` K the target's
              top-K probabilities from the same forward are kept too and mixed into the loss (`soft_targets.py`)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from ..help_format import add_device_option, resolve_device
from . import soft_targets as soft
from .depth1 import (
    Depth1Trainer,
    PositionShards,
    block_signature,
    data_fingerprint,
    extract,
    grow_depth1_head,
)
from .distill_extract import ANCHORS, distil_to_shards, position_bytes
from .distill_sources import POSITIONS, SHAREGPT, TextSequence, check_sources, sources_fingerprint, text_sequences

LABELS = "the target's argmax at each position of the given text, teacher-forced (nothing is generated)"
HELP = "train a drafter's depth-1 head on positions distilled from any text (resumable; see --help)"


# ----- the command --------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    """The options of `treespark distil`."""
    if p.description is None:
        p.description = (f"Train a drafter's depth-1 head on positions distilled from text. Labels: {LABELS}. One "
                         "target forward of T tokens labels up to T - 1 positions; the positions stream through a "
                         "shuffle buffer (nothing stored) or, with --max-disk-gb, are stored as bf16 shards first. "
                         "Rerun with the same options to resume.")
    p.add_argument("--drafter", help="drafter directory to train (grown by a depth-1 head of --width if it has none; "
                                     "default: the shipped drafter)")
    p.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a name/path")
    p.add_argument("--sources", nargs="+", default=[SHAREGPT],
                   help=f"the text to distil, in this order; labels: {LABELS}. 'sharegpt': the packaged ShareGPT "
                        "conversations, whole, in the target's chat template (never the held-out records "
                        "12,000-13,999); .txt files (every position); .jsonl[.gz] chats (messages or conversations) "
                        "or regenerated answers (prompt_ids, response_ids: the response's tokens are the anchors)")
    p.add_argument("--positions", choices=POSITIONS, default="assistant",
                   help="the positions of a chat that are labelled: its assistant turns' tokens (what the drafter "
                        "drafts), or all")
    p.add_argument("--anchors", choices=ANCHORS, default="agreeing",
                   help="agreeing: only positions whose token is the target's own argmax at the position before, as "
                        "every anchor at inference is (text the target would not have written trains a head that "
                        "does worse on the target's own text); all: every labelled position")
    p.add_argument("--max-length", type=int, default=512, help="tokens per window (longer texts are cut into several)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per target forward")
    p.add_argument("--train-batch-size", type=int, default=256, help="positions per optimizer step")
    p.add_argument("--buffer-positions", type=int, default=65_536,
                   help="positions the shuffle buffer holds (about 7 KB each for SmolLM2-135M)")
    p.add_argument("--passes", type=float, default=1.0, help="optimizer samples per distilled position, on average")
    p.add_argument("--max-positions", type=int, default=1_000_000,
                   help="positions to distil; the learning-rate schedule (warm-up, cosine to a tenth) spans them")
    p.add_argument("--width", type=int, default=2048, help="the MLP width of a fresh depth-1 head")
    p.add_argument("--fresh-head", action="store_true",
                   help="replace the drafter's depth-1 head, if it has one, by a fresh one of --width (to compare "
                        "sources from the same start); default: train the head it has")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--max-disk-gb", type=float,
                   help="store the positions as bf16 shards in OUTPUT_DIR/positions, at most this many GB, then train "
                        "on them (default: stream them, nothing stored)")
    p.add_argument("--dev-data", help="development references, prompt_ids and response_ids, read whole (default: the "
                                      "committed development set, as train-depth1's: 207 held-out prompts of five "
                                      "kinds answered by the default target, training_data/dev/dev_set.jsonl.gz; "
                                      "another --target answers the same prompts once into "
                                      "OUTPUT_DIR/dev_set.jsonl.gz)")
    p.add_argument("--eval-every", type=int, default=500, help="optimizer steps between development evaluations")
    p.add_argument("--save-every", type=int, default=500, help="optimizer steps between checkpoints")
    soft.add_soft_arguments(p)
    add_device_option(p, help="where the target, the drafter and the training step run (the positions and the "
                              "shuffle buffer stay there too): cpu, cuda or cuda:N; auto: cuda when this machine has "
                              "a CUDA GPU, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True,
                   help="checkpoint, metrics.jsonl, development positions and the trained drafter (final/); rerun "
                        "to resume")


def check_arguments(args) -> list[str]:
    """Every option checked before anything loads (`args.device` resolved here: "auto" becomes cpu or cuda); returns
    the sources (`check_sources`)."""
    least = {"--max-length": (args.max_length, 2), "--batch-size": (args.batch_size, 1),
             "--train-batch-size": (args.train_batch_size, 1), "--buffer-positions": (args.buffer_positions, 1),
             "--max-positions": (args.max_positions, 1), "--width": (args.width, 1),
             "--eval-every": (args.eval_every, 1), "--save-every": (args.save_every, 1)}
    for flag, (value, minimum) in least.items():
        if value < minimum:
            raise ValueError(f"{flag} must be at least {minimum}, got {value}")
    for flag, value in {"--passes": args.passes, "--lr": args.lr, "--max-disk-gb": args.max_disk_gb}.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a finite number > 0, got {value}")
    if args.buffer_positions < args.train_batch_size:
        raise ValueError(f"--buffer-positions {args.buffer_positions} is smaller than --train-batch-size "
                         f"{args.train_batch_size}: give the buffer a few forwards' positions (--batch-size x "
                         "--max-length) or more")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise ValueError(f"--output-dir {args.output_dir} is a file: give a directory")
    if args.drafter and not (Path(args.drafter) / "config.json").is_file():
        raise ValueError(f"--drafter {args.drafter} has no config.json: give a drafter directory (e.g. "
                         "runs/treespark/final)")
    if args.dev_data and not Path(args.dev_data).is_file():
        raise ValueError(f"--dev-data {args.dev_data}: no such file")
    soft.check_soft_arguments(args)
    args.device = str(resolve_device(args.device, kinds=("cpu", "cuda")))
    return check_sources(list(args.sources))


def claim_output_dir(out: Path, run: dict[str, str]) -> None:
    """`OUTPUT_DIR/distil.json` says what the run in it distils (`mode`, `sources`, `drafter` fingerprints, and `soft`
    with soft targets); a rerun of other options, or a directory of another kind of run, is refused before anything
    is written."""
    path, flags = out / "distil.json", {"mode": "--max-disk-gb (stored or streamed)", "drafter": "--drafter or --width",
                                        "sources": "--sources, --positions, --anchors, --max-length or --target",
                                        "soft": "--soft-targets or --soft-weight"}
    if path.is_file():
        saved = _read_run_file(path, run)
        changed = [flags[k] for k in flags if saved.get(k) != run.get(k)]
        if changed:
            raise ValueError(f"{out} holds a distil run of other {'; '.join(changed)}: give the same options to "
                             "resume it, or another --output-dir")
        return
    if (out / "checkpoint.pt").exists() or (out / "positions").exists():
        raise ValueError(f"{out} holds another kind of run (no distil.json): give another --output-dir")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run))


def _read_run_file(path: Path, run: dict[str, str]) -> dict:
    """`path` (a `distil.json`) as an object whose fields of `run` are strings; `ValueError` naming the file, and
    the field where one is wrong, otherwise."""
    fix = (f"If the file is damaged, delete it (the run in {path.parent} then resumes only with its own options) "
           "or give another --output-dir.")
    try:
        saved = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}). {fix}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err.msg}, line {err.lineno}). {fix}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a JSON {type(saved).__name__}, not an object. {fix}")
    for key in run:
        if key in saved and not isinstance(saved[key], str):
            raise ValueError(f"{path}: field {key!r} is {saved[key]!r}, not a fingerprint (a string). {fix}")
    return saved


def run(args) -> int:
    """`treespark distil`: train a drafter's depth-1 head on positions distilled from `--sources`, streamed or (with
    --max-disk-gb) stored first; save OUTPUT_DIR/final."""
    sources = check_arguments(args)
    from ..drafter.modeling import TreeSparkDrafter
    from ..hub.assets import DEFAULT_DRAFTER_DIR
    from .cli import load_target
    from .dev_set import DEV_MAX_LENGTH, default_dev_set, ensure_dev_set, load_dev_set

    torch.manual_seed(args.seed)
    out = Path(args.output_dir)
    target, tokenizer = load_target(args.target, with_tokenizer=True, device=args.device)
    base = TreeSparkDrafter.from_pretrained(args.drafter or DEFAULT_DRAFTER_DIR, dtype=torch.float32).to(args.device)
    stored_dtype = base.config.dtype if isinstance(getattr(base.config, "dtype", None), str) else "bfloat16"
    drafter = grow_depth1_head(base, args.width, fresh=args.fresh_head).bind_target(target).eval()
    if args.max_disk_gb:
        check_disk_budget(args, drafter)
    run_file = {} if not args.soft_targets else {"soft": f"top-{args.soft_targets}, weight {args.soft_weight:g}"}
    block = block_signature(drafter)
    signature = block + ("-fresh" if args.fresh_head else "")
    text = sources_fingerprint(sources, args.positions, args.max_length, tokenizer)
    text += "" if args.anchors == "all" else f"-{args.anchors}"  # a run from before the option keeps its own
    claim_output_dir(out, {"mode": "stored" if args.max_disk_gb else "streamed", "sources": text, "drafter": signature,
                           **run_file})
    dev_path = Path(args.dev_data) if args.dev_data else ensure_dev_set(default_dev_set(args.target, out), target,
                                                                         tokenizer)
    dev_refs = load_dev_set(dev_path, vocab_size=target.config.vocab_size)
    dev_shards = PositionShards(out / "dev_positions", block, data_fingerprint(dev_refs, [dev_path], DEV_MAX_LENGTH))
    extract(target, drafter, dev_refs, dev_shards)
    dev = {"dev": {k: v.to(drafter.fc.weight.device) for k, v in dev_shards.load().items()}}
    sequences = text_sequences(sources, tokenizer, args.positions, args.max_length)
    identity = soft.soft_signature(f"{signature}-{text}", args.soft_targets)
    if args.max_disk_gb:
        learned = _train_stored(args, target, drafter, sequences, dev, PositionShards(out / "positions", identity))
    else:
        learned = _train_streamed(args, target, drafter, sequences, dev, identity)
    if not learned:
        raise ValueError(f"no position to learn from in --sources {' '.join(args.sources)}: they hold no labelled "
                         f"position (--positions {args.positions}, --anchors {args.anchors}; empty files, chats "
                         "without an assistant turn, or text whose every token disagrees with the target's argmax "
                         "under --anchors agreeing). Nothing was trained or saved; give other sources.")
    final = out / "final"
    drafter.save_pretrained(final, dtype=getattr(torch, stored_dtype))
    print(f"[distil] saved {final}")
    return 0


def check_disk_budget(args, drafter) -> None:
    """`ValueError` saying what the run needs when `--max-disk-gb` cannot hold one optimizer step's positions."""
    each = position_bytes(drafter, args.soft_targets)
    limit = int(args.max_disk_gb * 1e9 // each)
    if limit >= args.train_batch_size:
        return
    step_gb, all_gb = args.train_batch_size * each / 1e9, args.max_positions * each / 1e9
    raise ValueError(f"--max-disk-gb {args.max_disk_gb:g} holds {limit:,} positions of {each:,} bytes each (the "
                     f"features of {drafter.config.num_target_features} target layers and the drafter's state, in "
                     f"bf16): --train-batch-size {args.train_batch_size} needs at least {step_gb:.3g} GB, and "
                     f"--max-positions {args.max_positions:,} needs {all_gb:.3g} GB. Give --max-disk-gb "
                     f"{all_gb:.3g} (or at least {step_gb:.3g}), or leave it out to stream the positions through "
                     "the shuffle buffer (nothing stored).")


def _train_streamed(args, target, drafter, sequences: Iterator[TextSequence], dev: dict, fingerprint: str) -> int:
    """Train on the positions streamed from `sequences`; returns how many were distilled in all."""
    from .distill_stream import DistilTrainer, StreamConfig, distil_stream

    trainer = DistilTrainer(drafter, args.output_dir, fingerprint, lr=args.lr, batch_size=args.train_batch_size,
                            seed=args.seed, soft_weight=args.soft_weight)
    resumed = trainer.resume()
    stream = trainer.stream  # the checkpoint's, when resumed
    if resumed:
        print(f"[distil] resumed at step {trainer.step}: window {stream['sequences_done']:,} of the sources, "
              f"{stream['positions_seen']:,} positions distilled")
    config = StreamConfig(batch_size=args.batch_size, buffer_positions=args.buffer_positions, passes=args.passes,
                          max_positions=args.max_positions, eval_every=args.eval_every, save_every=args.save_every,
                          anchors=args.anchors, soft_targets=args.soft_targets)
    print(f"[distil] streaming up to {args.max_positions:,} positions through a buffer of {args.buffer_positions:,}; "
          f"{config.total_steps(args.train_batch_size):,} steps of {args.train_batch_size}")
    distil_stream(target, drafter, sequences, trainer, dev, config)
    print(f"[distil] {stream['positions_seen']:,} positions distilled from {stream['sequences_done']:,} windows; "
          f"{trainer.step:,} steps")
    if stream["positions_seen"] < args.max_positions:
        print(f"[distil] the sources ran out before --max-positions {args.max_positions:,}: the learning rate stopped "
              "before the end of its schedule (give --max-positions the positions the sources hold)")
    return stream["positions_seen"]


def _train_stored(args, target, drafter, sequences: Iterator[TextSequence], dev: dict, shards: PositionShards) -> int:
    """Store the positions distilled from `sequences` within `--max-disk-gb`, then train on them; returns how many
    were stored (0: nothing trained)."""
    each = position_bytes(drafter, args.soft_targets)
    limit = min(args.max_positions, int(args.max_disk_gb * 1e9 // each))
    state = distil_to_shards(target, drafter, sequences, shards, limit, batch_size=args.batch_size,
                             anchors=args.anchors, soft_k=args.soft_targets)
    if not state["positions"]:
        return 0
    print(f"[distil] {state['positions']:,} positions stored in {shards.directory} "
          f"({state['positions'] * each / 1e9:.2f} GB of --max-disk-gb {args.max_disk_gb})")
    data = shards.load()
    trainer = Depth1Trainer(drafter, args.output_dir, lr=args.lr, batch_size=args.train_batch_size, seed=args.seed,
                            soft_weight=args.soft_weight)
    if trainer.resume():
        print(f"[distil] resumed at step {trainer.step}")
    total = math.ceil(args.passes * len(data["label"]) / args.train_batch_size)
    trainer.train(data, total, dev, eval_every=args.eval_every, save_every=args.save_every)
    return state["positions"]
