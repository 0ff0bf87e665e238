"""The `treespark` command: one function per subcommand that runs it (its options: `cli_args`), and `commands()`,
the table of subcommands that the parser is built from."""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from ..help_format import DefaultsHelpFormatter, cpu_pack_option, refuse_empty_values, resolve_device
from ..version import __version__

# Only light modules here: parsing the command line (`--help`, `--version`) imports no torch or transformers.
# Each command imports what it needs when it runs.
from . import args as cli_args
from .calibrate import parse_budgets, print_batch_latency, print_latency, read_drafter_config, write_config


def _load_pair(args):
    """`(target, tokenizer, drafter)` as `--target`, `--drafter`, `--device`, `--dtype` and `--cpu-pack` say; a
    device this machine lacks is refused first (`resolve_device`)."""
    from ..hub.loading import load_pair

    return load_pair(args.target, args.drafter, args.dtype, device=resolve_device(args.device),
                     cpu_pack=cpu_pack_option(getattr(args, "cpu_pack", "auto")))


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from ..calibration.measure import ensure_latency
    from ..core.exactness import check_greedy_equivalence
    from ..hub import assets
    from ..precision import dtype_name

    target, tokenizer, drafter = _load_pair(args)
    if args.budget is None and not args.chain:
        ensure_latency(target, drafter)
    inputs = assets.chat_inputs(tokenizer, args.prompt, device=target.device)
    knobs = {"tree_chain": args.chain}
    if args.budget is not None:
        knobs["tree_budget"] = args.budget
    if args.topk is not None:
        knobs["tree_topk"] = args.topk
    sample = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    if args.compare:  # the first calls of a process pay one-time costs (packed weights, lazy set-up): not timed
        target.generate(**inputs, max_new_tokens=4, **sample)
        target.generate(**inputs, assistant_model=drafter, max_new_tokens=4, **sample, **knobs)
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
    from ..bench.run import run_from_args

    return run_from_args(args)


def cmd_calibrate(args) -> int:
    """Measure what a round costs on this machine (the latency cache) and, for a drafter directory, the
    drafter's acceptance length per tree budget, stored in its config. Inputs and the directory's
    writability are checked before anything is measured; a profile that would not load is never written."""
    from ..calibration import measure
    from ..core.tree import TreePolicy

    budgets = parse_budgets(args.budgets)
    batch_sizes = [b for b in args.batch_sizes or () if b > 1]  # one row: the latency measured anyway
    config_path, config = (read_drafter_config(args.drafter, budgets, args.budgets, args.latency_only)
                           if args.drafter else (None, None))
    target, tokenizer, drafter = _load_pair(args)
    policy = TreePolicy.from_config(drafter.config)
    print_latency(measure.calibrate_latency(target, drafter, policy, refresh=args.force), target, drafter, policy)
    for size in batch_sizes:
        latency = measure.calibrate_latency(target, drafter, policy, refresh=args.force, batch=size)
        print_batch_latency(size, latency, target, drafter, policy)
    if config_path is None or args.latency_only:
        return 0
    prompts = [{name: tensor.to(target.device) for name, tensor in inputs.items()}
               for inputs in _calibration_prompts(args, tokenizer)]
    profile = measure.calibrate_acceptance(target, drafter, prompts, budgets, args.max_new_tokens)
    config["acceptance_profile"] = profile
    if batch_sizes:  # batched rounds: at most N nodes, lookup and datastore branches among them
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        batch_budgets = [n for n in budgets if n <= 16]
        config["batch_acceptance_profile"] = measure.calibrate_batch_acceptance(
            target, drafter, prompts, batch_budgets or budgets[:1], batch=min(batch_sizes),
            max_new_tokens=args.max_new_tokens, pad_token_id=pad)
        print(f"[calibrate] acceptance length per row and round in batches of {min(batch_sizes)}: "
              f"{config['batch_acceptance_profile']}")
    write_config(config_path, config)
    print(f"[calibrate] acceptance length per budget on {len(prompts)} {args.suite} prompts: {profile}; "
          f"written to {config_path}")
    drafter.config.acceptance_profile = profile
    if policy.auto:
        print_latency(measure.calibrate_latency(target, drafter, policy), target, drafter, policy)
    return 0


def _calibration_prompts(args, tokenizer) -> list[dict]:
    """`--num-prompts` tokenised prompts of `--suite` within 512 tokens (ShareGPT: held-out records past those
    the benchmark draws from)."""
    from ..bench.suites import select_prompts
    from ..hub import assets

    if args.suite == "sharegpt":
        texts = assets.sharegpt_prompts("heldout", limit=400)[200:]
    else:
        texts = select_prompts(args.suite, 4 * args.num_prompts)
    prompts = [inputs for inputs in (assets.chat_inputs(tokenizer, t) for t in texts)
               if inputs["input_ids"].shape[1] <= 512][: args.num_prompts]
    if not prompts:
        raise ValueError(f"--suite {args.suite!r} has no prompt within 512 tokens: nothing to calibrate on")
    return prompts


def cmd_draft_vocab(args) -> int:
    """Restrict a drafter to the `--size` most frequent target ids of `--data`; save it to `--output`."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from ..drafter.draft_vocab import count_token_ids, coverage, rank_token_ids
    from ..drafter.modeling import TreeSparkDrafter
    from ..hub import assets

    drafter_dir = Path(args.drafter) if args.drafter else assets.DEFAULT_DRAFTER_DIR
    if not (drafter_dir / "config.json").is_file():
        raise OSError(f"No TreeSpark drafter directory at {str(drafter_dir)!r} (config.json missing)")
    output = Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise OSError(f"--output {str(output)!r} exists and is not an empty directory: choose a new one")
    for path in map(Path, args.data):
        if not path.is_file():
            raise OSError(f"--data {str(path)!r}: no such file")
    drafter = TreeSparkDrafter.from_pretrained(drafter_dir, dtype="auto")  # keep the stored precision
    current = None if drafter.draft_vocab_ids is None else drafter.draft_vocab_ids.tolist()
    limit = drafter.config.target_vocab_size if current is None else len(current)
    if not 0 < args.size <= limit:  # before reading the data
        raise ValueError(f"--size {args.size} must lie in [1, {limit}] (the drafter's vocabulary)")
    tokenizer = AutoTokenizer.from_pretrained(args.target or assets.default_target_path())
    counts = count_token_ids(args.data, tokenizer, vocab_size=drafter.config.target_vocab_size)
    ids = rank_token_ids(counts, args.size, drafter.config.target_vocab_size, allowed=current)
    drafter.restrict_vocabulary(ids)
    drafter.save_pretrained(output)
    print(f"[draft-vocab] {len(counts)} distinct ids in {sum(counts.values())} tokens; the {args.size} most "
          f"frequent cover {coverage(counts, ids):.1%}. Saved the restricted drafter to {output}")
    return 0


def cmd_datastore(args) -> int:
    """Index the target's outputs in `--data` (text, chat JSONL, id JSONL: `training.datastore_inputs`) as
    `--output`/datastore.safetensors. A store already there is kept unless `--force` replaces it or `--append`
    adds to it; every input is read before anything is written, and the file is replaced whole. A file given twice,
    or already in the store, is skipped and said so; a tokenizer other than the drafter's target's is refused,
    naming both; a refused build leaves no folder it created. Returns 0; raises `OSError` or `ValueError`."""
    from pathlib import Path

    from ..training.datastore_inputs import removing_created_folders

    output = Path(args.output)
    if output.exists() and not output.is_dir():
        raise OSError(f"--output {str(output)!r} is a file, not a directory")
    with removing_created_folders(output):
        return _build_datastore(args, output)


def _build_datastore(args, output) -> int:
    """`cmd_datastore` in `output`, an existing directory or one to create."""
    from ..sources.datastore import DATASTORE_FILE, Datastore, DatastoreError
    from ..storage import unwritable_reason
    from ..training.datastore_inputs import check_tokenizer, describe, drafter_target, load_tokenizer, read_outputs

    drafter = drafter_target(args.vocab_size, output / "config.json")
    vocab_size = args.vocab_size if args.vocab_size is not None else drafter.vocab_size
    existing, path = None, output / DATASTORE_FILE
    if path.exists() and not args.force:
        try:
            existing = Datastore.load(path, vocab_size)
        except DatastoreError as err:
            raise ValueError(f"{err}; or give --force to replace it" if args.append else
                             f"--output {str(output)!r} already holds a datastore ({path}, unreadable: {err}): "
                             "give --force to replace it") from None
        if not args.append:
            raise OSError(f"--output {str(output)!r} already holds a datastore ({path}, {existing.num_tokens:,} "
                          "tokens): give --append to add these outputs to it, or --force to replace it")
    problem = unwritable_reason(output)
    if problem is not None:
        raise OSError(f"--output {str(output)!r} cannot be written ({problem})")
    start = time.perf_counter()
    read = read_outputs(args.data, vocab_size, functools.partial(load_tokenizer, args.target),
                        indexed=existing.sources if existing is not None else (),
                        check_tokenizer=functools.partial(check_tokenizer, drafter=drafter, store=existing))
    if read.skipped:
        print(f"[datastore] skipped {len(read.skipped)} file{'s' * (len(read.skipped) != 1)} already indexed: "
              + "; ".join(read.skipped))
    if existing is not None and not read.sources:
        print(f"[datastore] nothing new to index: {path} is unchanged ({existing.num_tokens:,} tokens)")
        return 0
    old = existing.sequences() if existing is not None else []
    made_with = read.tokenizer or (existing.tokenizer if existing is not None else None)
    store = Datastore.build(old + read.sequences, vocab_size, tokenizer=made_with,
                            sources=(existing.sources if existing is not None else []) + read.sources)
    path = store.save(output)
    built = time.perf_counter() - start
    start = time.perf_counter()
    Datastore.load(path, vocab_size)
    added = "" if existing is None else (f"; {store.num_tokens - existing.num_tokens:,} tokens added to the "
                                         f"{existing.num_tokens:,} already there")
    print(f"[datastore] {describe(read.counts)}: {store.num_tokens:,} tokens indexed in {built:.1f} s{added}; {path} "
          f"is {path.stat().st_size / 1e6:.1f} MB and loads in {1000 * (time.perf_counter() - start):.0f} ms"
          + ("" if (output / "config.json").is_file() else f" (copy {DATASTORE_FILE} into a drafter directory to "
                                                            "use it)"))
    return 0


def cmd_demo(args) -> int:
    from ..demo.page import build_app, import_gradio, launch

    # Before loading models, say at once whether it can serve where asked (before gradio's import, which reads
    # GRADIO_SERVER_PORT itself and fails on a bad one with a traceback), and whether the demo extra is there.
    host, port = demo_address(args.host, args.port)
    device = resolve_device(args.device)
    import_gradio()
    app = build_app(target_name=args.target, drafter_name=args.drafter, dtype=args.dtype, device=device)
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


def cmd_train(args) -> int:
    from ..training.cli import run

    return run(args)


def cmd_train_depth1(args) -> int:
    """`hf_treespark.training.depth1.run`."""
    from ..training.depth1 import run

    return run(args)


def cmd_distil(args) -> int:
    """`hf_treespark.training.distill.run`."""
    from ..training.distill import run

    return run(args)


def cmd_answers(args) -> int:
    """`hf_treespark.training.answers_cli.run`."""
    from ..training.answers_cli import run

    return run(args)


def cmd_export(args) -> int:
    """Write the drafter of a training checkpoint to a drafter directory, or a drafter as a DSpark checkpoint."""
    from ..training.export import export_checkpoint, export_dspark_command

    if args.format == "dspark":
        return export_dspark_command(args)
    dspark_only = [option for option, value in (("--target", args.target), ("--mask-token-id", args.mask_token_id),
                                                ("--without-depth-heads", args.without_depth_heads)) if value]
    if dspark_only or args.checkpoint is None:
        raise ValueError(f"{', '.join(dspark_only)} applies to --format dspark only" if dspark_only else
                         "give the training checkpoint to export (OUTPUT_DIR/checkpoints/step-N)")
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
    from ..drafter.modeling import TreeSparkDrafter
    from ..hub.card import check_base_model, written_here
    from ..hub.sharing import CARD_NAME, push_drafter_to_hub

    try:
        check_base_model(args.base_model)
    except ValueError as err:
        raise ValueError(f"--base-model: {err}") from None
    drafter = TreeSparkDrafter.from_pretrained(args.drafter, dtype="auto")  # upload the dtype it was saved in
    try:
        commit = push_drafter_to_hub(drafter, args.repo_id, private=args.private or None, token=args.token,
                                     base_model=args.base_model)
    except Exception as err:
        from ..training.push import hub_failure, push_command

        if hub_failure(err) is None:
            raise
        raise RuntimeError(f"pushing {args.drafter} to the Hub repository {args.repo_id} failed ({hub_failure(err)}); "
                           f"retry with: {push_command(args.drafter, args.repo_id, args.base_model)}") from err
    own = Path(args.drafter) / CARD_NAME
    card = (f"a {CARD_NAME} made from the drafter (the directory had none)" if not own.is_file()
            else f"its own {CARD_NAME}, " + ("every figure read from the drafter again"
                                              if written_here(own.read_text("utf-8")) else "as written"))
    where = getattr(commit, "commit_url", None) or args.repo_id
    print(f"[push] {args.drafter} uploaded to {where}, model card: {card}")
    return 0


def _route_generate() -> None:
    """The commands decode with `target.generate(assistant_model=drafter)`: routed here whatever
    `HF_TREESPARK_NO_PATCH` says (the variable is for programs that import the package)."""
    from ..decoding.integration import install

    install()


def _one_line_warnings() -> None:
    """The package's own warnings (the latency cache, the model cache) print as one line each, without the
    source line Python adds: `treespark: warning: ...`."""
    import warnings

    default = warnings.formatwarning
    if getattr(default, "one_line", False):
        return

    def one_line(message, category, filename, lineno, line=None):
        text = str(message)
        if text.startswith("hf_treespark: "):
            return f"treespark: warning: {text.removeprefix('hf_treespark: ')}\n"
        return default(message, category, filename, lineno, line)

    one_line.one_line = True
    warnings.formatwarning = one_line


class Command(NamedTuple):
    """One subcommand: its name, its line in `treespark --help`, the function that adds its options, the one that
    runs it, and whether an empty option value is refused at parsing (`refuse_empty_values`)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    refuse_empty: bool = True


def commands() -> tuple[Command, ...]:
    """The subcommands, in `treespark --help`'s order. Built when a command line is parsed, so each function is the
    one this module holds then (a test may replace one)."""
    return (
        Command("generate", "generate an answer with tree speculative decoding", cli_args.add_generate_arguments,
                cmd_generate),
        Command("bench", "acceptance length and speed of plain, prompt lookup, DSpark and TreeSpark",
                cli_args.add_bench_arguments, cmd_bench),
        Command("calibrate", "measure what a round costs here and a drafter's acceptance length per tree budget "
                             "(for 'auto')", cli_args.add_calibrate_arguments, cmd_calibrate),
        Command("draft-vocab", "restrict a drafter to a frequency-ranked draft vocabulary (cheaper rounds; no "
                               "retraining)", cli_args.add_draft_vocab_arguments, cmd_draft_vocab),
        Command("datastore", "index the target's outputs as a drafter's datastore (retrieved branches in every "
                             "round's tree)", cli_args.add_datastore_arguments, cmd_datastore),
        Command("demo", "the Gradio demo: watch rounds commit and inspect each drafted tree",
                cli_args.add_demo_arguments, cmd_demo),
        # train and train-depth1: their options and checks are the training modules'
        Command("train", "train a drafter for a target (resumable; see --help)", cli_args.add_train_arguments,
                cmd_train, refuse_empty=False),
        Command("train-depth1", "grow a drafter by a depth-1 head and train the head alone (fast; resumable; see "
                                "--help)", cli_args.add_train_depth1_arguments, cmd_train_depth1, refuse_empty=False),
        Command("distil", "train a drafter's depth-1 head on positions distilled from any text, labelled by the "
                          "target's own argmax (resumable; see --help)", cli_args.add_distil_arguments, cmd_distil),
        Command("answers", "the target's own answers to an endless prompt supply, continuously batched, as "
                           "training data (resumable; see --help)", cli_args.add_answers_arguments, cmd_answers),
        Command("export", "write the drafter of a training checkpoint to a drafter directory, or a drafter as a DSpark "
                "checkpoint for vLLM/SGLang (--format dspark)",
                cli_args.add_export_arguments, cmd_export),
        Command("push", "upload a trained drafter and its model card to the Hugging Face Hub",
                cli_args.add_push_arguments, cmd_push),
    )


def parse(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by the parser `commands()` makes; bad values end in `parser.error` (one line, status 2)."""
    # A subcommand's options are added only when it is the one run (or shown with --help): those of bench, train,
    # train-depth1, distil and export come from modules that import torch, and `treespark --help` stays instant.
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="treespark", description="TreeSpark tree speculative decoding",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser,
                                                               formatter_class=DefaultsHelpFormatter))
    table = {command.name: command for command in commands()}
    for command in table.values():
        command_parser = sub.add_parser(command.name, help=command.help)
        if command.name == chosen:
            command.add_arguments(command_parser)
        command_parser.set_defaults(func=command.run)
    args = parser.parse_args(argv)
    if table[args.command].refuse_empty:
        refuse_empty_values(sub.choices[args.command], args)
    if getattr(args, "max_new_tokens", 1) < 1:
        parser.error("--max-new-tokens must be at least 1")
    if getattr(args, "prompt", "x").strip() == "":
        parser.error("--prompt is empty")
    if not cli_args.is_utf8(getattr(args, "prompt", "")):
        parser.error("--prompt is not valid UTF-8 text (the shell passed bytes that are not): give it as UTF-8")
    return args


def main(argv: list[str] | None = None, before_command: Callable[[], object] | None = None) -> int:
    """Parse the command line and run the command; `before_command()` runs in between (the console entry
    point, `hf_treespark_cli`, finishes `import hf_treespark` there)."""
    args = parse(sys.argv[1:] if argv is None else list(argv))
    _one_line_warnings()
    try:
        if before_command is not None:
            before_command()
        _route_generate()
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"treespark: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's usual status for SIGINT
        print("\ntreespark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
