"""The options of each `treespark` subcommand, one function each (their argparse types: `arg_types`).

Nothing here imports torch: the options of bench, train, train-depth1, distil and export come from their own
modules (which do), imported inside their functions, and `treespark` adds a subcommand's options only when that
subcommand is the one run (or asked for `--help`).
"""

from __future__ import annotations

import argparse

from ..arg_types import at_least, batch_sizes, temperature
from ..help_format import CPU_PACK_CHOICES, CPU_PACK_HELP, add_device_option, add_dtype_option, torch_dtype_name

TARGET_HELP = "target model name or path (default: offline SmolLM2-135M-Instruct)"


# ----- checks -------------------------------------------------------------------------------------------------


def is_utf8(text: str) -> bool:
    """False for a command-line argument that held bytes that are not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ----- one function per subcommand -----------------------------------------------------------------------------


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", help=TARGET_HELP)
    parser.add_argument("--drafter", help="drafter name or path (default: the shipped drafter)")
    parser.add_argument("--budget", type=int, help="tree budget N (non-root nodes verified per round)")
    parser.add_argument("--topk", type=int, help="children per frontier parent")
    parser.add_argument("--chain", action="store_true", help="chain mode (plain DSpark drafting)")
    parser.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    add_device_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)
    parser.add_argument("--compare", action="store_true",
                        help="also run plain decoding: speedup and exactness check")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.run import add_arguments

    add_arguments(parser)


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", help="drafter directory; its config.json gets acceptance_profile (default: the "
                                          "shipped drafter, latency only)")
    parser.add_argument("--target", help=TARGET_HELP)
    parser.add_argument("--suite", default="sharegpt", choices=("mtbench", "humaneval", "sharegpt"),
                        help="prompt suite (sharegpt: held-out first turns; the bench's copy, multiturn and math "
                             "suites are never calibrated on)")
    parser.add_argument("--num-prompts", type=at_least(1), default=8)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=96)
    parser.add_argument("--budgets", default="2,4,8,16,32,64")
    parser.add_argument("--force", action="store_true",
                        help="measure this machine's round latency again (on a quiet machine), replacing the "
                             "cached one")
    parser.add_argument("--batch-sizes", metavar="B[,B...]", type=batch_sizes,
                        help="also measure rounds of these batch sizes (1-256), for 'auto' in batched generate "
                             "(e.g. 2,4,8,16), and (with --drafter) the acceptance per row in batches of the smallest")
    parser.add_argument("--latency-only", action="store_true",
                        help="only the round latency; leave the drafter's acceptance_profile as it is")
    add_device_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)


def add_draft_vocab_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", nargs="+", required=True,
                        help="JSONL files of the target's outputs: token ids (response_ids, ...) or text (response, "
                             "...)")
    parser.add_argument("--size", type=int, default=16384, help="tokens in the draft vocabulary")
    parser.add_argument("--drafter", help="drafter directory (default: the shipped drafter)")
    parser.add_argument("--target", help="the target's name or path, for its tokenizer (default: the offline default)")
    parser.add_argument("--output", required=True, help="new directory for the restricted drafter")


def add_datastore_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", nargs="+", required=True,
                        help="the target's outputs: .txt plain text; .jsonl or .jsonl.gz records with prompt_ids and "
                             "response_ids (what `treespark train --data` reads), or chats (messages or "
                             "conversations: their assistant turns are indexed)")
    parser.add_argument("--output", required=True,
                        help="drafter directory to add datastore.safetensors to (or a new directory for it alone)")
    parser.add_argument("--target", help="the target's name or path, for its tokenizer and chat template (text and "
                                         "chats; default: the offline default target)")
    parser.add_argument("--vocab-size", type=at_least(1),
                        help="the target's vocabulary size (default: the --output drafter's target_vocab_size, else "
                             "the offline default target's)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--append", action="store_true", help="add to the datastore --output holds")
    again.add_argument("--force", action="store_true", help="replace the datastore --output holds")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help=TARGET_HELP)
    parser.add_argument("--drafter", help="drafter name or path (default: the shipped drafter)")
    parser.add_argument("--host", help="address to serve on (default: $GRADIO_SERVER_NAME or 127.0.0.1; "
                                       "0.0.0.0: the whole network)")
    parser.add_argument("--port", type=int, help="port to serve on (default: $GRADIO_SERVER_PORT or 7860)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    add_device_option(parser)
    add_dtype_option(parser)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.cli import add_arguments

    add_arguments(parser)


def add_train_depth1_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.depth1 import add_arguments

    add_arguments(parser)


def add_distil_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.distill import add_arguments

    add_arguments(parser)


def add_answers_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.answers_cli import add_arguments

    add_arguments(parser)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    from ..training.export import EXPORT_DTYPES, FORMATS

    parser.description = ("--format drafter: a training checkpoint as a drafter directory. --format dspark: a drafter "
                          "as a DSpark checkpoint that vLLM and SGLang serve (docs/serving.md), with their commands.")
    parser.add_argument("checkpoint", nargs="?",
                        help="a checkpoint of a training run, OUTPUT_DIR/checkpoints/step-N; with --format dspark "
                             "also a drafter directory, or nothing for the shipped drafter")
    parser.add_argument("--output", required=True, help="new directory for the drafter")
    parser.add_argument("--format", choices=FORMATS, default="drafter",
                        help="drafter: a drafter directory (from_pretrained); dspark: DeepSpec's DSpark layout")
    parser.add_argument("--dtype", type=torch_dtype_name, choices=EXPORT_DTYPES, default="bfloat16",
                        help="precision of the saved weights, bf16 or fp32 (the shipped drafter is bf16)")
    parser.add_argument("--target", help="dspark: the target whose embed_tokens and lm_head are copied in ('default': "
                                         "the offline default; default: the target the drafter records)")
    parser.add_argument("--mask-token-id", type=int,
                        help="dspark, a drafter with a learned mask embedding: the token id whose embed_tokens row "
                             "receives it (a reserved special token; refused for other drafters unless their own)")
    parser.add_argument("--without-depth-heads", action="store_true",
                        help="dspark: leave out the depth-1/depth-2 heads, which DSpark drafters have not (needed for "
                             "the shipped drafter; the block alone then drafts those depths)")


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="drafter directory, e.g. OUTPUT_DIR/final of a training run")
    parser.add_argument("--repo-id", required=True, help="Hub repository to create or update, ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hub token (default: the one `hf auth login` stored, or $HF_TOKEN)")
    parser.add_argument("--base-model", help="the target's Hub id, ORG/NAME, for the card's base_model and usage "
                                             "snippet (default: the target the drafter records, when it is a Hub id)")
