"""Train a TreeSpark drafter from the command line: `treespark train` and `examples/train_drafter.py`.

    # offline default target, the target's own answers shipped in training_data/, TreeSpark losses
    treespark train --target default --data training_data/sharegpt_turns_smollm2_regen.jsonl.gz \\
        --preset treespark --output-dir runs/treespark

    # chats and plain text (a sequence per assistant turn; windows of text), L_ce towards the target's own argmax
    treespark train --target default --data chats.jsonl notes.txt --labels target --output-dir runs/text

    # regenerate reference responses with the target first (resumable), from a prompt mixture
    treespark train --target default --regenerate "sharegpt:0.7,my_code.jsonl:0.3" \\
        --num-prompts 2000 --output-dir runs/treespark

    # only regenerate (resumable; train on OUTPUT_DIR/references.jsonl later with --data), e.g. ShareGPT's
    # later turns with their history
    treespark train --target default --regenerate "sharegpt_turns:1" --num-prompts 16665 \
        --regen-max-prompt-tokens 512 --regenerate-only --output-dir runs/regen_turns

    # several GPUs or machines
    accelerate launch examples/train_drafter.py --target Qwen/Qwen3-4B --data refs.jsonl --output-dir runs/q4b

    # several CPU processes (one training run, the batch split over them)
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 examples/train_drafter.py --data refs.jsonl ...

Presets (one switch each): dspark, dspark_tree, treespark, no_survival, no_coverage, treespark_hd128.
An interrupted run resumes from its last checkpoint when started again with the same --output-dir.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from ..arg_types import json_object
from .freeze import PART_HELP
from .objective import LABELS
from .text_references import LABELS_HELP
from .trainer import PRESETS

LOSS_KEYS = ("ce", "l1", "conf", "surv", "cov", "gamma", "coverage_top_j", "coverage_margin", "coverage_cap",
             "replay_anchors")  # the fields of objective.LossConfig (kept in step by a test)

DATA_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")  # the files --data reads (train_help.DATA_SOURCES says what)
DRAFT_LAYERS = 2  # a fresh drafter's transformer layers when --draft-layers is not given
DEFAULT_MASK_TOKEN_ID = 16  # SmolLM2: a code-corpus marker chat text never produces


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The training options, shared by `treespark train` and `examples/train_drafter.py`; the data sources and
    losses they name are listed after them (`train_help`)."""
    from .train_help import DESCRIPTION, epilog

    p.description, p.epilog = p.description or DESCRIPTION, epilog()
    p.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a name/path")
    p.add_argument("--data", nargs="*", default=[],
                   help="training data, any mix of: regeneration JSONL (prompt_ids, response_ids: the target's own "
                        "answers), chat JSONL (messages or conversations: one sequence per assistant turn, in the "
                        "target's chat template) and .txt files (windows of --max-length tokens); .jsonl.gz read as "
                        "well. Which label each position gets: --labels")
    p.add_argument("--labels", choices=LABELS, default="text", help=LABELS_HELP)
    p.add_argument("--regenerate", help="prompt mixture to regenerate responses for, e.g. 'sharegpt:1.0'")
    p.add_argument("--num-prompts", type=int, default=1000, help="prompts to regenerate responses for")
    p.add_argument("--regen-batch-size", type=int, default=32, help="prompts per regeneration batch")
    p.add_argument("--regen-max-new-tokens", type=int, default=256, help="length cap of a regenerated response")
    p.add_argument("--regen-max-prompt-tokens", type=int, default=384,
                   help="skip prompts longer than this after the chat template (later ShareGPT turns carry their "
                        "history)")
    p.add_argument("--regenerate-only", action="store_true",
                   help="stop after regenerating (resumable): the file is OUTPUT_DIR/references.jsonl, for --data")
    p.add_argument("--output-dir", required=True, help="checkpoints, metrics, feature cache and final/ drafter")
    p.add_argument("--preset", choices=sorted(PRESETS), default="treespark", help="losses and drafter shape")
    p.add_argument("--init-from", help="start from this drafter instead of a fresh one")
    p.add_argument("--train-only", metavar="PARTS", help=PART_HELP)
    p.add_argument("--draft-layers", type=int, default=None,
                   help=f"drafter transformer layers (default {DRAFT_LAYERS}); with --init-from, more than the "
                        "drafter has adds layers that start as the identity (see grow_layers)")
    p.add_argument("--heads", type=int, default=4, help="drafter attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="drafter key/value heads")
    p.add_argument("--head-dim", type=int, help="override the preset's head dim")
    p.add_argument("--intermediate-size", type=int, default=1536, help="drafter MLP width")
    p.add_argument("--markov-rank", type=int, default=256, help="rank r of the Markov head")
    p.add_argument("--normalize-features", action=argparse.BooleanOptionalAction, default=False,
                   help="standardise each target feature dimension before the drafter's fc, with statistics of "
                        "the training data (a fresh drafter's `normalize_features`; see TreeSparkConfig)")
    p.add_argument("--anchor-features", action=argparse.BooleanOptionalAction, default=False,
                   help="also feed the target features of the position before the anchor into every block slot "
                        "(a fresh drafter's `anchor_features`; see TreeSparkConfig)")
    p.add_argument("--draft-vocab-size", type=int,
                   help="train over the N target ids most frequent in the responses of the data (a draft vocabulary: "
                        "the LM-head work shrinks by V/N); 0 = the whole vocabulary; default: the drafter's own "
                        "(the whole vocabulary for a fresh drafter)")
    p.add_argument("--mask-token-id", type=int, help=f"spare token id for mask slots (default: "
                   f"{DEFAULT_MASK_TOKEN_ID} for --target default, else a learned mask embedding)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per reference sequence (longer are cut)")
    p.add_argument("--max-sequences", type=int, help="use at most this many reference sequences")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (unless --max-steps)")
    p.add_argument("--max-steps", type=int, help="optimizer steps to train (default: --epochs epochs)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=6e-4,
                   help="peak learning rate (AdamW, cosine schedule); a resumed run given another value follows "
                        "the same schedule scaled to it")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument("--anchors", type=int, default=64, help="anchors per sequence in one optimizer step")
    p.add_argument("--updates-per-batch", type=int, default=1,
                   help="optimizer steps from one batch's target forward, each on its own --anchors anchors per "
                        "sequence (without a feature cache the target forward is about half of a step)")
    p.add_argument("--save-every", type=int, default=50, help="optimizer steps between checkpoints")
    p.add_argument("--feature-cache", help="directory for cached target features (default: OUTPUT_DIR/feature_cache;"
                   " measured faster than a target forward per step on a 2-core CPU); one per --max-length, data"
                   " and target")
    p.add_argument("--no-feature-cache", action="store_true", help="recompute target features every step")
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16"), default="auto",
                   help="bf16 autocast of the training step; auto: on a CUDA device that supports it or a CPU "
                        "with native bf16 instructions (see hf_treespark.precision), else no (default: auto)")
    p.add_argument("--tensorboard", action="store_true", help="log metrics to OUTPUT_DIR for TensorBoard")
    p.add_argument("--seed", type=int, default=0, help="drafter initialisation, data order and anchors")
    p.add_argument("--loss", type=json_object, default={},
                   help='loss overrides, a JSON object, e.g. \'{"surv": 1.0, "replay_anchors": 16}\'; keys: '
                        + ", ".join(LOSS_KEYS))
    p.add_argument("--eval-every", type=int, default=0,
                   help="optimizer steps between learning-curve points: acceptance on a development set, written to "
                        "OUTPUT_DIR/metrics.jsonl and plotted to OUTPUT_DIR/learning_curve.png; the drafter of the "
                        "highest dev_acceptance_length is kept in OUTPUT_DIR/best/ (0: off)")
    p.add_argument("--eval-budget", type=int, default=8, help="tree budget N of those evaluations")
    p.add_argument("--dev-data", help="development references (JSONL with prompt_ids and response_ids, the target's "
                                      "greedy answers); default: the committed development set, 207 held-out prompts "
                                      "of five kinds answered by the default target "
                                      "(training_data/dev/dev_set.jsonl.gz; an evaluation took 76 s on a busy 2-core "
                                      "CPU); another --target answers the same prompts once into "
                                      "OUTPUT_DIR/dev_set.jsonl.gz")
    p.add_argument("--push-to-hub", help="repository id to push the trained drafter to")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse option values that would train nothing or something other than asked, before loading anything."""
    from .objective import LossConfig

    unknown = sorted(set(args.loss) - set(LOSS_KEYS))
    if unknown:
        raise ValueError(f"--loss: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(LOSS_KEYS)}")
    LossConfig(**args.loss)  # refuses values that cannot work
    at_least_one = ("num_prompts", "regen_batch_size", "regen_max_new_tokens", "regen_max_prompt_tokens",
                    "heads", "kv_heads", "intermediate_size", "markov_rank", "max_length",
                    "batch_size", "grad_accum", "anchors", "updates_per_batch", "save_every", "eval_budget")
    if args.regenerate_only and not args.regenerate:
        raise ValueError("--regenerate-only needs --regenerate: the prompt mixture to answer")
    if args.eval_every < 0:
        raise ValueError(f"--eval-every must be >= 0 (got {args.eval_every}); 0 turns the learning curve off")
    if args.dev_data and not Path(args.dev_data).is_file():
        raise FileNotFoundError(f"--dev-data {args.dev_data}: no such file")
    if args.eval_every > 0 and not args.dev_data:
        from .dev_set import default_dev_set

        default_dev_set(args.target, args.output_dir)  # the committed set must be there for the default target
    for name in at_least_one:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.updates_per_batch > 1 and args.grad_accum > 1:
        raise ValueError(f"--updates-per-batch {args.updates_per_batch} with --grad-accum {args.grad_accum}: the one "
                         "makes several updates from a batch, the other one update from several batches; set one "
                         "of them to 1")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be at least 1 (got {args.max_steps}); leave it out to train for "
                         "--epochs epochs")
    if args.draft_vocab_size is not None and args.draft_vocab_size < 0:
        raise ValueError(f"--draft-vocab-size must be >= 0 (got {args.draft_vocab_size}); 0 trains over the whole "
                         "vocabulary")
    for name in ("head_dim", "max_sequences", "draft_layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    if not args.epochs > 0:
        raise ValueError(f"--epochs must be positive (got {args.epochs})")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive (got {args.lr})")
    if not args.data and not args.regenerate:
        raise ValueError("give --data files or --regenerate a prompt mixture")
    for path in args.data:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--data {path}: no such file")
        if not str(path).endswith(DATA_SUFFIXES):
            raise ValueError(f"--data {path}: give .jsonl[.gz] files (regeneration records or chats) or .txt files")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise NotADirectoryError(f"--output-dir {args.output_dir} is a file: give a directory")
    if args.feature_cache and Path(args.feature_cache).exists() and not Path(args.feature_cache).is_dir():
        raise NotADirectoryError(f"--feature-cache {args.feature_cache} is a file: give a directory")
    if args.push_to_hub is not None:
        from .push import check_push_target

        check_push_target(args.push_to_hub)


def load_target_config(name: str):
    """The config of the target `load_target` loads (no weights): for the checks before anything is built."""
    from transformers import AutoConfig

    from ..hub import assets

    return AutoConfig.from_pretrained(assets.default_target_path() if name == "default" else name)


def load_target(name: str, with_tokenizer: bool, device: str = "cpu"):
    """`(target, tokenizer or None)` on `device`: the offline default target, or a causal LM by name or path (sdpa)."""
    from ..hub import assets

    if name == "default":
        return assets.load_default_target(device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa").to(device)
    return target, (AutoTokenizer.from_pretrained(name) if with_tokenizer else None)


def build_drafter(args: argparse.Namespace, target):
    """The drafter to train: `--init-from`, or a fresh one shaped by the options and the preset.

    Its weights are float32 whatever precision a checkpoint was saved in (the shipped drafter is bf16):
    AdamW's updates are far below bf16's resolution of a weight; `--mixed-precision` runs the products in bf16.
    """
    import torch

    from ..drafter.modeling import TreeSparkDrafter

    if args.init_from:
        drafter = TreeSparkDrafter.from_pretrained(args.init_from, dtype=torch.float32)
        if args.draft_layers is not None and args.draft_layers != drafter.config.num_hidden_layers:
            if args.draft_layers < drafter.config.num_hidden_layers:
                raise ValueError(f"--draft-layers {args.draft_layers}: --init-from {args.init_from} has "
                                 f"{drafter.config.num_hidden_layers} layers; a drafter can grow, not shrink (leave "
                                 "--draft-layers out to keep its shape)")
            torch.manual_seed(args.seed)
            grow_layers(drafter, args.draft_layers)
        return drafter
    config = fresh_drafter_config(args, target)
    torch.manual_seed(args.seed)
    return TreeSparkDrafter(config)


def fresh_drafter_config(args: argparse.Namespace, target):
    """The config of a fresh drafter for `target` (a model or its config), shaped by the options and the preset."""
    from ..drafter.configuration import TreeSparkConfig
    from ..hub import assets

    mask = args.mask_token_id
    if mask is None and args.target == "default":
        mask = DEFAULT_MASK_TOKEN_ID
    fields = dict(num_hidden_layers=args.draft_layers or DRAFT_LAYERS, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate_size,
                  markov_rank=args.markov_rank, mask_token_id=mask, anchor_features=args.anchor_features,
                  normalize_features=args.normalize_features)
    fields.update(PRESETS[args.preset][1])
    if args.head_dim:
        fields["head_dim"] = args.head_dim
    if args.target == "default":
        fields["target_name_or_path"] = assets.DEFAULT_TARGET_NAME
    return TreeSparkConfig.for_target(target, **fields)


def refuse_other_models(init_from: str) -> None:
    """`ValueError`, in one paragraph, when `init_from` is a local directory whose `config.json` names another
    kind of model than a TreeSpark drafter (a plain causal LM, typically: transformers would load it as a drafter
    with every weight missing)."""
    from ..drafter.configuration import TreeSparkConfig

    path = Path(init_from) / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # not a readable local config: from_pretrained says what is wrong
    kind = saved.get("model_type") if isinstance(saved, dict) else None
    if kind is None or kind == TreeSparkConfig.model_type:
        return
    architectures = saved.get("architectures") or []
    named = f" ({', '.join(map(str, architectures))})" if architectures else ""
    raise ValueError(f"--init-from {init_from} holds a {kind} model{named}, not a TreeSpark drafter: --init-from "
                     "takes a drafter directory (a run's final/, or one saved with save_pretrained). To train "
                     f"a drafter for that model, give it as the target: --target {init_from}, without --init-from.")


def planned_drafter_config(args: argparse.Namespace, target_config):
    """The config of the drafter that `build_drafter` and `set_draft_vocabulary` will make, read without building
    it (for `--init-from`, its config.json only)."""
    from ..drafter.configuration import TreeSparkConfig

    if args.init_from:
        refuse_other_models(args.init_from)
        try:
            config = TreeSparkConfig.from_pretrained(args.init_from)
        except (OSError, ValueError) as err:
            raise OSError(f"--init-from {args.init_from}: no TreeSpark drafter there "
                          f"({' '.join(str(err).split())})") from None
        config.num_hidden_layers = max(config.num_hidden_layers, args.draft_layers or 0)
    else:
        config = fresh_drafter_config(args, target_config)
    if args.draft_vocab_size is not None:
        config.draft_vocab_size = args.draft_vocab_size or None
    return config


DRAFTER_SIZE_OPTIONS = ("draft_layers", "intermediate_size", "heads", "kv_heads", "head_dim", "markov_rank",
                        "draft_vocab_size")  # the options that size the drafter


def check_memory(args: argparse.Namespace, target_config, device, sequences: int | None = None) -> None:
    """Refuse, in one line naming the option, sizes whose training needs more memory than `device` has.

    Counted without building anything (`training.memory`), as lower bounds: the drafter's float32 weights,
    gradients and AdamW moments (16 bytes a parameter); given this process's number of reference `sequences` (a
    batch holds no more), one step's reference distributions beside them (`batch x --anchors x block_size x draft
    vocabulary`, float32); with `--regenerate`, the prompt list and one regeneration batch's key/value cache
    (`--regen-batch-size x --regen-max-new-tokens`, bf16).
    """
    from .memory import PROMPT_BYTES, TRAINED_PARAMETER_BYTES, available_memory, drafter_parameter_count, format_bytes

    available = available_memory(device)
    if available is None:
        return
    limit, where = available
    have = f"more than the {format_bytes(limit)} {where}"
    if args.regenerate:
        prompts = args.num_prompts * PROMPT_BYTES
        if prompts > limit:
            raise ValueError(f"--num-prompts {args.num_prompts}: the prompt list alone needs {format_bytes(prompts)}, "
                             f"{have}; ask for fewer prompts")
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = getattr(text, "num_attention_heads", 1)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_width = 2 * (getattr(text, "num_key_value_heads", None) or heads) * head_dim  # keys and values
        batch = min(args.regen_batch_size, args.num_prompts)
        cache = batch * args.regen_max_new_tokens * text.num_hidden_layers * kv_width * 2
        if cache > limit:
            raise ValueError(f"--regen-batch-size {args.regen_batch_size}: {batch} prompts answered at once with "
                             f"--regen-max-new-tokens {args.regen_max_new_tokens} need a {format_bytes(cache)} "
                             f"key/value cache, {have}; lower --regen-batch-size")
    if args.regenerate_only:
        return
    config = planned_drafter_config(args, target_config)
    drafter = drafter_parameter_count(config) * TRAINED_PARAMETER_BYTES
    vocab = config.draft_vocab_size or config.target_vocab_size
    batch = args.batch_size if sequences is None else min(args.batch_size, sequences)
    step = 0 if sequences is None else batch * args.anchors * config.block_size * vocab * 4
    if drafter > limit:
        raise ValueError(f"{_largest_size_option(args, target_config)}: a drafter of "
                         f"{drafter // TRAINED_PARAMETER_BYTES:,} parameters needs {format_bytes(drafter)} to train "
                         f"(float32 weights, gradients and AdamW moments: 16 bytes a parameter), {have}; give a "
                         "smaller size")
    if drafter + step > limit:
        raise ValueError(f"--batch-size {args.batch_size} with --anchors {args.anchors}: one training step holds "
                         f"{batch} x {args.anchors} x {config.block_size} x {vocab} reference probabilities "
                         f"({format_bytes(step)}, float32) beside the drafter's {format_bytes(drafter)}, {have}; "
                         "lower --batch-size or --anchors (--grad-accum keeps the batch per update)")


def _largest_size_option(args: argparse.Namespace, target_config) -> str:
    """`--option value` of the size option that adds the most parameters to the drafter (its default instead
    shrinks it most), or what else makes the drafter large."""
    from .memory import drafter_parameter_count

    parser = argparse.ArgumentParser()
    add_arguments(parser)  # for the options' defaults (None: the preset's, or the shape of --init-from)

    def count_with_default(name: str) -> int:
        changed = argparse.Namespace(**{**vars(args), name: parser.get_default(name)})
        return drafter_parameter_count(planned_drafter_config(changed, target_config))

    given = [name for name in DRAFTER_SIZE_OPTIONS
             if getattr(args, name) is not None and getattr(args, name) != parser.get_default(name)
             and not (args.init_from and name not in ("draft_layers", "draft_vocab_size"))]
    if not given:
        return f"--init-from {args.init_from}" if args.init_from else f"--target {args.target}"
    name = min(given, key=count_with_default)
    return f"--{name.replace('_', '-')} {getattr(args, name)}"


def grow_layers(drafter, num_layers: int) -> None:
    """Append transformer layers to `drafter` (in place) until it has `num_layers`, each starting as the identity.

    A new layer is initialised as a fresh one, then its attention's `o_proj` and its MLP's `down_proj` are zeroed:
    both of its residual branches add nothing, so the grown drafter drafts exactly what it did before, and
    training starts from the trained drafter's quality with more capacity (the zeroed projections get gradients
    at once; the layer's other weights follow as they move away from zero). The config's `num_hidden_layers`
    follows, so the grown drafter saves and loads as any other.
    """
    import torch

    from ..drafter.modeling import TreeSparkDecoderLayer

    config = drafter.config
    reference = next(drafter.parameters())
    for index in range(config.num_hidden_layers, num_layers):
        layer = TreeSparkDecoderLayer(config, index)
        layer.apply(drafter._init_weights)
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        drafter.layers.append(layer.to(device=reference.device, dtype=reference.dtype))
    config.num_hidden_layers = len(drafter.layers)


def set_draft_vocabulary(drafter, size: int | None, references):
    """`--draft-vocab-size`: restrict `drafter` to the `size` ids most frequent in the references' responses
    (0: widen it to the whole vocabulary; None: leave it as it is). Deterministic in the data, so a resumed
    run rebuilds the same vocabulary."""
    from collections import Counter

    from ..drafter.draft_vocab import coverage, rank_token_ids

    if size is None:
        return drafter
    drafter.full_vocabulary()
    if size == 0:
        return drafter
    counts = Counter()
    for ref in references:
        counts.update(ref.input_ids[ref.prompt_len:])
    ids = rank_token_ids(counts, size, drafter.config.target_vocab_size)
    print(f"[draft vocabulary] {size} ids cover {coverage(counts, ids):.2%} of the {sum(counts.values())} "
          "response tokens")
    return drafter.restrict_vocabulary(ids)


def _answered(path: Path, ids: set[str]) -> int:
    """How many of `ids` have a line in the regeneration file `path`."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip() and str(json.loads(line)["id"]) in ids)


def regenerate(args: argparse.Namespace, target, tokenizer, accelerator, out: Path) -> Path:
    """Regenerate reference responses on the main process (the others wait); say how many prompts got one."""
    from .data import mix_prompts, parse_mixture, regenerate_responses

    regen = out / "references.jsonl"
    if accelerator.is_main_process:
        prompts = mix_prompts(parse_mixture(args.regenerate), args.num_prompts, seed=args.seed)
        regenerate_responses(target.to(accelerator.device), tokenizer, prompts, regen,
                             batch_size=args.regen_batch_size, max_new_tokens=args.regen_max_new_tokens,
                             max_prompt_tokens=args.regen_max_prompt_tokens)
        answered = _answered(regen, {p.id for p in prompts})
        note = "" if answered == len(prompts) else " (the warnings above say why the others are missing)"
        print(f"[regenerate] {answered} of {len(prompts)} prompts answered in {regen}{note}")
    accelerator.wait_for_everyone()
    return regen


def dev_references(args: argparse.Namespace, target, tokenizer, accelerator, out: Path):
    """`--dev-data`, or the default development set (`dev_set.default_dev_set`: the committed file for the default
    target; for another, the same prompts answered by it once, in the main process, into OUTPUT_DIR)."""
    from .data import load_references
    from .dev_set import default_dev_set, ensure_dev_set, load_dev_set

    if args.dev_data:
        return load_references(args.dev_data, vocab_size=target.config.vocab_size)
    path = default_dev_set(args.target, out)
    if accelerator.is_main_process:
        ensure_dev_set(path, target, tokenizer)
    accelerator.wait_for_everyone()
    return load_dev_set(path, vocab_size=target.config.vocab_size)


def run(args: argparse.Namespace, prog: str = "treespark train") -> int:
    """Train as the options say; save the drafter to OUTPUT_DIR/final (and push it if asked). Ctrl-C ends the run
    with one line saying where a rerun resumes (a checkpoint is published whole or not at all, `publish_state`),
    exit status 130."""
    try:
        return _train(args)
    except KeyboardInterrupt:
        pass
    # here, after the handler: the interrupted frames are gone, and with them the progress bar they held (closed on
    # release), so this line comes last
    print(interrupted_message(Path(args.output_dir), prog), file=sys.stderr)
    return 130


def interrupted_message(out: Path, prog: str) -> str:
    """What an interrupted run in `out` says: the checkpoint a rerun resumes from, if there is one."""
    published = sorted(path for path in (out / "checkpoints").glob("step-*") if path.is_dir())
    if not published:
        return f"{prog}: interrupted before its first checkpoint; rerun the same command to start again"
    return f"{prog}: interrupted; rerun the same command to resume from its last checkpoint, {published[-1]}"


def _train(args: argparse.Namespace) -> int:
    """`run` itself."""
    from .datastore_inputs import load_tokenizer
    from .freeze import resolve_parts
    from .objective import LossConfig
    from .text_references import load_training_data
    from .trainer import TrainConfig, Trainer, build_accelerator

    check_arguments(args)
    out = Path(args.output_dir)
    cache = None if args.no_feature_cache else (args.feature_cache or str(out / "feature_cache"))
    config = TrainConfig(output_dir=str(out), preset=args.preset, epochs=args.epochs, max_steps=args.max_steps,
                         batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                         weight_decay=args.weight_decay, adam_eps=args.adam_eps,
                         anchors_per_sequence=args.anchors, updates_per_batch=args.updates_per_batch,
                         save_every=args.save_every, seed=args.seed,
                         feature_cache=cache, tensorboard=args.tensorboard, eval_every=args.eval_every,
                         eval_budget=args.eval_budget, mixed_precision=args.mixed_precision,
                         loss=LossConfig(**args.loss), labels=args.labels, train_only=args.train_only)
    # First, before anything else touches accelerate's state: under torchrun this joins the process group.
    accelerator = build_accelerator(config)
    target_config = load_target_config(args.target)
    if args.draft_vocab_size and args.draft_vocab_size > target_config.vocab_size:
        raise ValueError(f"--draft-vocab-size {args.draft_vocab_size} exceeds the target's vocabulary of "
                         f"{target_config.vocab_size} ids; use at most that, or 0 for the whole vocabulary")
    check_memory(args, target_config, accelerator.device)
    resolve_parts(args.train_only, planned_drafter_config(args, target_config))  # a part it lacks: refused now
    needs_dev_set = args.eval_every > 0 and not args.dev_data and not args.regenerate_only
    target, tokenizer = load_target(args.target, with_tokenizer=bool(args.regenerate) or needs_dev_set)
    data = [Path(p) for p in args.data]
    if args.regenerate:
        data.append(regenerate(args, target, tokenizer, accelerator, out))
        if args.regenerate_only:
            return 0
    named = None if args.target == "default" else args.target
    get_tokenizer = functools.cache(lambda: tokenizer or load_tokenizer(named))  # for chats and text in --data
    references = load_training_data(data, get_tokenizer, max_length=args.max_length, limit=args.max_sequences,
                                    vocab_size=target.config.vocab_size)
    if not references:
        raise ValueError(f"no usable reference sequences in {', '.join(map(str, data))} (see the warnings above)")
    check_memory(args, target_config, accelerator.device, -(-len(references) // accelerator.num_processes))
    drafter = set_draft_vocabulary(build_drafter(args, target), args.draft_vocab_size, references)
    trainer = Trainer(config, target, drafter, references, accelerator=accelerator)
    if drafter.feature_mean is not None and not args.init_from and trainer.latest_checkpoint() is None:
        trainer.set_feature_statistics()  # a fresh drafter; a resumed one has them in its checkpoint
    if args.eval_every:
        trainer.set_dev_set(dev_references(args, target, tokenizer, accelerator, out))
    result = trainer.train()
    if args.eval_every and accelerator.is_main_process:
        from .evaluate import plot_learning_curve

        print(f"learning curve: {plot_learning_curve(out / 'metrics.jsonl', out / 'learning_curve.png')}")
    if accelerator.is_main_process:
        from ..hub.sharing import save_drafter
        from .best_checkpoint import final_and_best
        from .push import push_trained_drafter

        drafter = trainer.unwrapped_drafter()
        save_drafter(drafter, out / "final")
        if result["steps"] == 0:
            print(f"nothing left to train: the run in {out} is at step {trainer.step} of {trainer.total_steps}; "
                  f"drafter saved to {out / 'final'}")
        else:
            print(f"trained {result['steps']} steps (to step {trainer.step} of {trainer.total_steps}) in "
                  f"{result['seconds']:.0f} s on {accelerator.num_processes} process(es); drafter saved to "
                  f"{out / 'final'}")
        if args.eval_every:
            print(final_and_best(out, trainer.step, trainer.best))
        if args.push_to_hub:
            commit = push_trained_drafter(drafter, args.push_to_hub, out / "final")
            print(f"[push] uploaded to {getattr(commit, 'commit_url', None) or args.push_to_hub}")
    # every rank waits for the main one to save (a rank that left with the process group open could abort at exit),
    # then trackers are finished and the group closed
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`examples/train_drafter.py`: parse, train, and turn bad input into one `prog: error: ...` line."""
    from ..help_format import DefaultsHelpFormatter, run_script

    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    return run_script(parser, functools.partial(run, prog=parser.prog), argv)
