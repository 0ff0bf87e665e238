"""The `treespark` command."""

from __future__ import annotations

import argparse
import functools
import math
import os
import socket
import sys
import time

from .budget import ensure_latency
from .cpu_gemm import CPU_PACK_CHOICES, CPU_PACK_HELP, cpu_pack_option
from .help_format import DefaultsHelpFormatter
from .loading import load_pair
from .precision import DTYPE_CHOICES, dtype_name


def _load_pair(args):
    return load_pair(args.target, args.drafter, args.dtype, cpu_pack=cpu_pack_option(getattr(args, "cpu_pack", "auto")))


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from . import assets
    from .exactness import check_greedy_equivalence

    target, tokenizer, drafter = _load_pair(args)
    if args.budget is None and not args.chain:
        ensure_latency(target, drafter)
    inputs = assets.chat_inputs(tokenizer, args.prompt)
    knobs = {"tree_chain": args.chain}
    if args.budget is not None:
        knobs["tree_budget"] = args.budget
    if args.topk is not None:
        knobs["tree_topk"] = args.topk
    sample = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens, streamer=streamer,
                          return_dict_in_generate=True, **sample, **knobs)
    seconds = time.perf_counter() - start
    new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    print(f"\n[treespark] {new} tokens in {len(out.rounds)} rounds, mean acceptance length "
          f"{out.acceptance_length:.2f}, tree budget {out.tree_budget}, {new / seconds:.1f} tokens/s "
          f"({dtype_name(target.dtype)})")
    if args.compare:
        start = time.perf_counter()
        plain = target.generate(**inputs, max_new_tokens=args.max_new_tokens, **sample)
        plain_seconds = time.perf_counter() - start
        plain_new = plain.shape[1] - inputs["input_ids"].shape[1]
        print(f"[plain]     {plain_new} tokens, {plain_new / plain_seconds:.1f} tokens/s; "
              f"speedup {(new / seconds) / (plain_new / plain_seconds):.2f}x")
        if not sample["do_sample"]:
            report = check_greedy_equivalence(target, plain, out.sequences)
            print(f"[check]     {report}")
            if not report.ok:
                return 1
    return 0


def cmd_bench(args) -> int:
    from .bench import run_from_args

    return run_from_args(args)


def cmd_calibrate(args) -> int:
    """Measure the drafter's acceptance length per tree budget and store it in its config."""
    import json
    from pathlib import Path

    from . import assets
    from .bench import select_prompts
    from .budget import calibrate_acceptance

    config_path = Path(args.drafter) / "config.json"
    if not config_path.is_file():
        raise OSError(f"No TreeSpark drafter directory at {args.drafter!r} (config.json missing)")
    target, tokenizer, drafter = _load_pair(args)
    try:
        budgets = tuple(int(n) for n in args.budgets.split(","))
    except ValueError:
        raise ValueError(f"--budgets {args.budgets!r}: expected comma-separated integers, e.g. 2,4,8") from None
    if not budgets or min(budgets) < 1:
        raise ValueError(f"--budgets {args.budgets!r}: budgets must be positive integers")
    if args.suite == "sharegpt":  # held-out records past those the benchmark draws from
        texts = assets.sharegpt_prompts("heldout", limit=400)[200:]
    else:
        texts = select_prompts(args.suite, 4 * args.num_prompts)
    prompts = [inputs for inputs in (assets.chat_inputs(tokenizer, t) for t in texts)
               if inputs["input_ids"].shape[1] <= 512][: args.num_prompts]
    ensure_latency(target, drafter)
    profile = calibrate_acceptance(target, drafter, prompts, budgets, args.max_new_tokens)
    config = json.loads(config_path.read_text())
    config["acceptance_profile"] = profile
    tmp = config_path.with_suffix(".json.tmp")  # a crash never leaves a half-written config
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(config_path)
    print(f"[calibrate] acceptance length per budget on {args.num_prompts} {args.suite} prompts: {profile}; "
          f"written to {config_path}")
    return 0


def cmd_draft_vocab(args) -> int:
    """Restrict a drafter to the `--size` most frequent target ids of `--data`; save it to `--output`."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from . import assets
    from .draft_vocab import count_token_ids, coverage, rank_token_ids
    from .modeling import TreeSparkDrafter

    drafter_dir = Path(args.drafter) if args.drafter else assets.DEFAULT_DRAFTER_DIR
    if not (drafter_dir / "config.json").is_file():
        raise OSError(f"No TreeSpark drafter directory at {str(drafter_dir)!r} (config.json missing)")
    output = Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise OSError(f"--output {str(output)!r} exists and is not an empty directory: choose a new one")
    tokenizer = AutoTokenizer.from_pretrained(args.target or assets.default_target_path())
    counts = count_token_ids(args.data, tokenizer)
    drafter = TreeSparkDrafter.from_pretrained(drafter_dir, dtype="auto")  # keep the stored precision
    current = None if drafter.draft_vocab_ids is None else drafter.draft_vocab_ids.tolist()
    ids = rank_token_ids(counts, args.size, drafter.config.target_vocab_size, allowed=current)
    drafter.restrict_vocabulary(ids)
    drafter.save_pretrained(output)
    print(f"[draft-vocab] {len(counts)} distinct ids in {sum(counts.values())} tokens; the {args.size} most "
          f"frequent cover {coverage(counts, ids):.1%}. Saved the restricted drafter to {output}")
    return 0


def cmd_demo(args) -> int:
    from .demo import build_app, import_gradio, launch

    import_gradio()  # before loading models: say at once if the demo extra is missing
    host, port = demo_address(args.host, args.port)  # and whether it can serve where asked
    app = build_app(target_name=args.target, drafter_name=args.drafter, dtype=args.dtype)
    launch(app, host=host, port=port, share=args.share)
    return 0


def demo_address(host: str | None, port: int | None) -> tuple[str, int]:
    """`(host, port)` for the demo: the flags, else Gradio's `GRADIO_SERVER_NAME` / `GRADIO_SERVER_PORT`, else
    127.0.0.1:7860. Raises `ValueError` naming the flag or variable when the address cannot be served on."""
    host_from = "--host" if host is not None else "GRADIO_SERVER_NAME"
    host = host if host is not None else os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1"
    port_from = "--port" if port is not None else "GRADIO_SERVER_PORT"
    if port is None:
        raw = os.environ.get("GRADIO_SERVER_PORT") or "7860"
        try:
            port = int(raw)
        except ValueError:
            raise ValueError(f"GRADIO_SERVER_PORT={raw!r} is not a port number: set it to one in 1-65535") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{port_from} {port} is not a port number: choose one in 1-65535 (default 7860)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as err:
        raise ValueError(f"{host_from} {host!r} is not an address of this machine ({err}): use 127.0.0.1 (this "
                         "machine only) or 0.0.0.0 (the whole network)") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            raise ValueError(f"cannot serve on {host}:{port} ({host_from}, {port_from}): {err.strerror or err}. "
                             "Choose another --port, or stop what is using it") from None
    return host, port


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model name or path (default: offline SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", help="drafter name or path (default: the shipped drafter)")
    parser.add_argument("--host", help="address to serve on (default: $GRADIO_SERVER_NAME or 127.0.0.1; "
                                       "0.0.0.0: the whole network)")
    parser.add_argument("--port", type=int, help="port to serve on (default: $GRADIO_SERVER_PORT or 7860)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bf16 where the device computes it natively, else fp32")


def cmd_train(args) -> int:
    from .training.cli import run

    return run(args)


def cmd_export(args) -> int:
    """Write the drafter of a training checkpoint to a drafter directory."""
    from .training.export import export_checkpoint

    export_checkpoint(args.checkpoint, args.output, dtype=args.dtype)
    print(f"[export] {args.checkpoint} -> {args.output} ({args.dtype}); measure its acceptance profile for "
          f"tree_budget='auto' with: treespark calibrate --drafter {args.output}")
    return 0


def cmd_push(args) -> int:
    """Upload a trained drafter directory, with its model card, to a Hub repository."""
    from pathlib import Path

    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not (Path(args.drafter) / "config.json").is_file():
        raise OSError(f"--drafter {args.drafter!r}: no drafter directory there (config.json missing); give the "
                      "final/ directory of a training run")
    try:
        validate_repo_id(args.repo_id)
    except HFValidationError as err:
        raise ValueError(f"--repo-id {args.repo_id!r} is not a Hub repository id (ORG/NAME): {err}") from None
    from .hub import push_drafter_to_hub
    from .modeling import TreeSparkDrafter

    drafter = TreeSparkDrafter.from_pretrained(args.drafter, dtype="auto")  # upload the dtype it was saved in
    commit = push_drafter_to_hub(drafter, args.repo_id, private=args.private or None, token=args.token)
    print(f"[push] {args.drafter} uploaded to {getattr(commit, 'commit_url', None) or args.repo_id}")
    return 0


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="drafter directory, e.g. OUTPUT_DIR/final of a training run")
    parser.add_argument("--repo-id", required=True, help="Hub repository to create or update, ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hub token (default: the one `hf auth login` stored, or $HF_TOKEN)")


def temperature(text: str) -> float:
    """argparse type of `--temperature`: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="treespark", description="TreeSpark tree speculative decoding",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser,
                                                               formatter_class=DefaultsHelpFormatter))

    gen = sub.add_parser("generate", help="generate an answer with tree speculative decoding")
    gen.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--target", help="target model name or path (default: offline SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", help="drafter name or path (default: the shipped drafter)")
    gen.add_argument("--budget", type=int, help="tree budget N (non-root nodes verified per round)")
    gen.add_argument("--topk", type=int, help="children per frontier parent")
    gen.add_argument("--chain", action="store_true", help="chain mode (plain DSpark drafting)")
    gen.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                     help="auto: bf16 where the device computes it natively, else fp32")
    gen.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)
    gen.add_argument("--compare", action="store_true", help="also run plain decoding: speedup and exactness check")
    gen.set_defaults(func=cmd_generate)

    from .bench import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="acceptance length and speed of plain, prompt lookup, DSpark and TreeSpark")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    cal = sub.add_parser("calibrate", help="measure a drafter's acceptance length per tree budget (for 'auto')")
    cal.add_argument("--drafter", required=True, help="drafter directory; its config.json gets acceptance_profile")
    cal.add_argument("--target", help="target model name or path (default: offline SmolLM2-135M-Instruct)")
    cal.add_argument("--suite", default="sharegpt", help="prompt suite (mtbench, humaneval, sharegpt held-out)")
    cal.add_argument("--num-prompts", type=int, default=8)
    cal.add_argument("--max-new-tokens", type=int, default=96)
    cal.add_argument("--budgets", default="2,4,8,16,32,64")
    cal.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bf16 where the device computes it natively, else fp32")
    cal.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)
    cal.set_defaults(func=cmd_calibrate)

    voc = sub.add_parser("draft-vocab", help="restrict a drafter to a frequency-ranked draft vocabulary "
                                              "(cheaper rounds; no retraining)")
    voc.add_argument("--data", nargs="+", required=True,
                     help="JSONL files of the target's outputs: token ids (response_ids, ...) or text (response, ...)")
    voc.add_argument("--size", type=int, default=16384, help="tokens in the draft vocabulary")
    voc.add_argument("--drafter", help="drafter directory (default: the shipped drafter)")
    voc.add_argument("--target", help="the target's name or path, for its tokenizer (default: the offline default)")
    voc.add_argument("--output", required=True, help="new directory for the restricted drafter")
    voc.set_defaults(func=cmd_draft_vocab)

    demo = sub.add_parser("demo", help="the Gradio demo: watch rounds commit and inspect each drafted tree")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    from .training.cli import add_arguments as add_train_arguments

    train = sub.add_parser("train", help="train a drafter for a target (resumable; see --help)")
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)

    export = sub.add_parser("export", help="write the drafter of a training checkpoint to a drafter directory")
    export.add_argument("checkpoint", help="a checkpoint of a training run, OUTPUT_DIR/checkpoints/step-N")
    export.add_argument("--output", required=True, help="new directory for the drafter")
    from .training.export import EXPORT_DTYPES

    export.add_argument("--dtype", choices=EXPORT_DTYPES, default="bfloat16",
                        help="precision of the saved weights (the shipped drafter is bfloat16)")
    export.set_defaults(func=cmd_export)

    push = sub.add_parser("push", help="upload a trained drafter and its model card to the Hugging Face Hub")
    add_push_arguments(push)
    push.set_defaults(func=cmd_push)

    args = parser.parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        parser.error("--max-new-tokens must be at least 1")
    if getattr(args, "prompt", "x").strip() == "":
        parser.error("--prompt is empty")
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"treespark: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's usual status for SIGINT
        print("\ntreespark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
