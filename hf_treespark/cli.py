"""The `treespark` command."""

from __future__ import annotations

import argparse
import functools
import math
import os
import socket
import sys
import time
from collections.abc import Callable

# Only light modules here: parsing the command line (`--help`, `--version`) imports no torch or transformers.
# Each command imports what it needs when it runs.
from .help_format import (
    CPU_PACK_CHOICES,
    CPU_PACK_HELP,
    DTYPE_CHOICES,
    DefaultsHelpFormatter,
    batch_sizes,
    cpu_pack_option,
    refuse_empty_values,
)
from .version import __version__


def _load_pair(args):
    from .loading import load_pair

    return load_pair(args.target, args.drafter, args.dtype, cpu_pack=cpu_pack_option(getattr(args, "cpu_pack", "auto")))


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from . import assets
    from .budget import ensure_latency
    from .exactness import check_greedy_equivalence
    from .precision import dtype_name

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
    from .bench import run_from_args

    return run_from_args(args)


def cmd_calibrate(args) -> int:
    """Measure what a round costs on this machine (the latency cache) and, for a drafter directory, the
    drafter's acceptance length per tree budget, stored in its config. Inputs and the directory's
    writability are checked before anything is measured; a profile that would not load is never written."""
    import json
    from pathlib import Path

    from . import budget
    from .configuration import TreeSparkConfig
    from .storage import unwritable_reason
    from .tree import TreePolicy

    try:
        budgets = tuple(sorted({int(n) for n in args.budgets.split(",")}))
    except ValueError:
        raise ValueError(f"--budgets {args.budgets!r}: expected comma-separated integers, e.g. 2,4,8") from None
    if not budgets or min(budgets) < 1:
        raise ValueError(f"--budgets {args.budgets!r}: budgets must be positive integers")
    batch_sizes = [b for b in args.batch_sizes or () if b > 1]  # one row: the latency measured anyway
    config_path = Path(args.drafter) / "config.json" if args.drafter else None
    if config_path is not None:
        if not config_path.is_file():
            raise OSError(f"No TreeSpark drafter directory at {args.drafter!r} (config.json missing)")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            drafter_config = TreeSparkConfig.from_dict(config)
        except (UnicodeDecodeError, ValueError, TypeError) as err:
            raise ValueError(f"{config_path} is not a valid drafter config ({err}): nothing was measured") from None
        pool = TreePolicy.from_config(drafter_config, budget=1).with_budget(10**9).num_candidates
        if max(budgets) > pool:
            raise ValueError(f"--budgets {args.budgets!r}: the drafter's trees hold at most {pool} candidates "
                             f"(tree_topk, tree_frontier, tree_depth), so budget {max(budgets)} is never used; "
                             f"choose budgets up to {pool}")
        problem = None if args.latency_only else unwritable_reason(config_path.parent)
        if problem is not None:
            raise OSError(f"cannot write the acceptance profile into {config_path.parent} ({problem}): copy the "
                          "drafter to a writable directory and calibrate that")
    target, tokenizer, drafter = _load_pair(args)
    policy = TreePolicy.from_config(drafter.config)
    _print_latency(budget.calibrate_latency(target, drafter, policy, refresh=args.force), target, drafter, policy)
    for size in batch_sizes:
        latency = budget.calibrate_latency(target, drafter, policy, refresh=args.force, batch=size)
        _print_batch_latency(size, latency, target, drafter, policy)
    if config_path is None or args.latency_only:
        return 0
    prompts = _calibration_prompts(args, tokenizer)
    profile = budget.calibrate_acceptance(target, drafter, prompts, budgets, args.max_new_tokens)
    config["acceptance_profile"] = profile
    if batch_sizes:  # batched rounds: at most N nodes, lookup and datastore branches among them
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        batch_budgets = [n for n in budgets if n <= 16]
        config["batch_acceptance_profile"] = budget.calibrate_batch_acceptance(
            target, drafter, prompts, batch_budgets or budgets[:1], batch=min(batch_sizes),
            max_new_tokens=args.max_new_tokens, pad_token_id=pad)
        print(f"[calibrate] acceptance length per row and round in batches of {min(batch_sizes)}: "
              f"{config['batch_acceptance_profile']}")
    TreeSparkConfig.from_dict(config)  # raises, before writing, if the directory would no longer load
    tmp = config_path.with_suffix(".json.tmp")  # a crash never leaves a half-written config
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(config_path)
    print(f"[calibrate] acceptance length per budget on {len(prompts)} {args.suite} prompts: {profile}; "
          f"written to {config_path}")
    drafter.config.acceptance_profile = profile
    if policy.auto:
        _print_latency(budget.calibrate_latency(target, drafter, policy), target, drafter, policy)
    return 0


def _calibration_prompts(args, tokenizer) -> list[dict]:
    """`--num-prompts` tokenised prompts of `--suite` within 512 tokens (ShareGPT: held-out records past those
    the benchmark draws from)."""
    from . import assets
    from .bench import select_prompts

    if args.suite == "sharegpt":
        texts = assets.sharegpt_prompts("heldout", limit=400)[200:]
    else:
        texts = select_prompts(args.suite, 4 * args.num_prompts)
    prompts = [inputs for inputs in (assets.chat_inputs(tokenizer, t) for t in texts)
               if inputs["input_ids"].shape[1] <= 512][: args.num_prompts]
    if not prompts:
        raise ValueError(f"--suite {args.suite!r} has no prompt within 512 tokens: nothing to calibrate on")
    return prompts


def _print_latency(latency, target, drafter, policy) -> None:
    """`treespark calibrate`'s report: the latency table and the budget "auto" takes from it."""
    from .budget import LATENCY_FILE, describe_latency, fallback_budget, profile_acceptance
    from .storage import cache_dir

    if latency is None:
        print(f"[calibrate] no trusted round latency for this machine: tree_budget='auto' uses its default, "
              f"{fallback_budget(target, policy, drafter)} (see the warning above; measure again on a quiet machine "
              "with --force)")
        return
    profile = getattr(drafter.config, "acceptance_profile", None)
    acceptance = profile_acceptance(profile, sorted(latency["draft"])) if profile else None
    print(f"[calibrate] round latency on this machine ({cache_dir() / LATENCY_FILE}):\n"
          + describe_latency(latency, acceptance))
    if acceptance is None:
        print("[calibrate] the drafter has no acceptance_profile yet: 'auto' will price budgets from its first "
              "round's tree scores")


def _print_batch_latency(size: int, latency, target, drafter, policy) -> None:
    """One line per measured batch size: a round's cost in plain steps of that batch, and the budget "auto" takes."""
    from .budget import BatchBudget

    if latency is None:
        print(f"[calibrate] batch {size}: no trusted round latency (see the warning above): 'auto' uses the default "
              "costs for batches")
        return
    step = latency["verify"][0]
    costs = ", ".join(f"N={n} {(latency['verify'][n] + latency['draft'][n]) / step:.2f}"
                      for n in sorted(latency["draft"]))
    chooser = BatchBudget(target, drafter, policy)
    choice = "from the first round's scores" if chooser.needs_scores else str(chooser(size) or "0 (plain steps)")
    print(f"[calibrate] batch {size}: plain step {step * 1e3:.1f} ms; a round costs {costs} plain steps; "
          f"auto budget {choice}")


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
    adds to it; every input is read before anything is written, and the file is replaced whole."""
    from pathlib import Path

    from .datastore import DATASTORE_FILE, Datastore, DatastoreError
    from .storage import unwritable_reason
    from .training.datastore_inputs import describe, load_tokenizer, read_outputs, store_vocab_size

    output = Path(args.output)
    vocab_size = store_vocab_size(args.vocab_size, output / "config.json")
    if output.exists() and not output.is_dir():
        raise OSError(f"--output {str(output)!r} is a file, not a directory")
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
    sequences, counts = read_outputs(args.data, vocab_size, functools.partial(load_tokenizer, args.target))
    old = existing.sequences() if existing is not None else []
    store = Datastore.build(old + sequences, vocab_size)
    path = store.save(output)
    built = time.perf_counter() - start
    start = time.perf_counter()
    Datastore.load(path, vocab_size)
    added = "" if existing is None else (f"; {store.num_tokens - existing.num_tokens:,} tokens added to the "
                                         f"{existing.num_tokens:,} already there")
    print(f"[datastore] {describe(counts)}: {store.num_tokens:,} tokens indexed in {built:.1f} s{added}; {path} is "
          f"{path.stat().st_size / 1e6:.1f} MB and loads in {1000 * (time.perf_counter() - start):.0f} ms"
          + ("" if (output / "config.json").is_file() else f" (copy {DATASTORE_FILE} into a drafter directory to "
                                                            "use it)"))
    return 0


def cmd_train_depth1(args) -> int:
    """`hf_treespark.training.depth1.run`."""
    from .training.depth1 import run

    return run(args)


def cmd_demo(args) -> int:
    from .demo import build_app, import_gradio, launch

    # Before loading models, say at once whether it can serve where asked (before gradio's import, which reads
    # GRADIO_SERVER_PORT itself and fails on a bad one with a traceback), and whether the demo extra is there.
    host, port = demo_address(args.host, args.port)
    import_gradio()
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
    from .hub import CARD_NAME, push_drafter_to_hub
    from .modeling import TreeSparkDrafter

    drafter = TreeSparkDrafter.from_pretrained(args.drafter, dtype="auto")  # upload the dtype it was saved in
    try:
        commit = push_drafter_to_hub(drafter, args.repo_id, private=args.private or None, token=args.token)
    except Exception as err:
        from .training.push import hub_failure, push_command

        if hub_failure(err) is None:
            raise
        raise RuntimeError(f"pushing {args.drafter} to the Hub repository {args.repo_id} failed ({hub_failure(err)}); "
                           f"retry with: {push_command(args.drafter, args.repo_id)}") from err
    card = (f"its own {CARD_NAME}" if (Path(args.drafter) / CARD_NAME).is_file()
            else f"a {CARD_NAME} made from its config (the directory had none)")
    where = getattr(commit, "commit_url", None) or args.repo_id
    print(f"[push] {args.drafter} uploaded to {where}, model card: {card}")
    return 0


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", help="drafter directory; its config.json gets acceptance_profile (default: the "
                                          "shipped drafter, latency only)")
    parser.add_argument("--target", help="target model name or path (default: offline SmolLM2-135M-Instruct)")
    parser.add_argument("--suite", default="sharegpt", help="prompt suite (mtbench, humaneval, sharegpt held-out)")
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    parser.add_argument("--budgets", default="2,4,8,16,32,64")
    parser.add_argument("--force", action="store_true",
                        help="measure this machine's round latency again (on a quiet machine), replacing the "
                             "cached one")
    parser.add_argument("--batch-sizes", metavar="B[,B...]", type=batch_sizes,
                        help="also measure rounds of these batch sizes (1-256), for 'auto' in batched generate "
                             "(e.g. 2,4,8,16), and (with --drafter) the acceptance per row in batches of the smallest")
    parser.add_argument("--latency-only", action="store_true",
                        help="only the round latency; leave the drafter's acceptance_profile as it is")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bf16 where the device computes it natively, else fp32")
    parser.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)


def add_datastore_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", nargs="+", required=True,
                        help="the target's outputs: .txt plain text; .jsonl or .jsonl.gz records with prompt_ids and "
                             "response_ids (what `treespark train --data` reads), or chats (messages or "
                             "conversations: their assistant turns are indexed)")
    parser.add_argument("--output", required=True,
                        help="drafter directory to add datastore.safetensors to (or a new directory for it alone)")
    parser.add_argument("--target", help="the target's name or path, for its tokenizer and chat template (text and "
                                         "chats; default: the offline default target)")
    parser.add_argument("--vocab-size", type=positive_int,
                        help="the target's vocabulary size (default: the --output drafter's target_vocab_size, else "
                             "the offline default target's)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--append", action="store_true", help="add to the datastore --output holds")
    again.add_argument("--force", action="store_true", help="replace the datastore --output holds")


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="drafter directory, e.g. OUTPUT_DIR/final of a training run")
    parser.add_argument("--repo-id", required=True, help="Hub repository to create or update, ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hub token (default: the one `hf auth login` stored, or $HF_TOKEN)")


def positive_int(text: str) -> int:
    """argparse type of counts: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def is_utf8(text: str) -> bool:
    """False for a command-line argument that held bytes that are not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def temperature(text: str) -> float:
    """argparse type of `--temperature`: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {text!r}")
    return value


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


def main(argv: list[str] | None = None, before_command: Callable[[], object] | None = None) -> int:
    """Parse the command line and run the command; `before_command()` runs in between (the console entry
    point, `hf_treespark_cli`, finishes `import hf_treespark` there)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The options of bench, train and export come from their modules, which import torch: they are added only
    # for the command being run (or shown with --help), so that `treespark --help` stays instant.
    command = next((arg for arg in argv if not arg.startswith("-")), None)
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

    bench = sub.add_parser("bench", help="acceptance length and speed of plain, prompt lookup, DSpark and TreeSpark")
    if command == "bench":
        from .bench import add_arguments as add_bench_arguments

        add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    cal = sub.add_parser("calibrate", help="measure what a round costs here and a drafter's acceptance length per "
                                           "tree budget (for 'auto')")
    add_calibrate_arguments(cal)
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

    store = sub.add_parser("datastore", help="index the target's outputs as a drafter's datastore (retrieved "
                                             "branches in every round's tree)")
    add_datastore_arguments(store)
    store.set_defaults(func=cmd_datastore)

    demo = sub.add_parser("demo", help="the Gradio demo: watch rounds commit and inspect each drafted tree")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="train a drafter for a target (resumable; see --help)")
    if command == "train":
        from .training.cli import add_arguments as add_train_arguments

        add_train_arguments(train)
    train.set_defaults(func=cmd_train)

    depth1 = sub.add_parser("train-depth1", help="grow a drafter by a depth-1 head and train the head alone "
                                                 "(fast; resumable; see --help)")
    if command == "train-depth1":
        from .training.depth1 import add_arguments as add_depth1_arguments

        add_depth1_arguments(depth1)
    depth1.set_defaults(func=cmd_train_depth1)

    export = sub.add_parser("export", help="write the drafter of a training checkpoint to a drafter directory")
    export.add_argument("checkpoint", help="a checkpoint of a training run, OUTPUT_DIR/checkpoints/step-N")
    export.add_argument("--output", required=True, help="new directory for the drafter")
    if command == "export":
        from .training.export import EXPORT_DTYPES

        export.add_argument("--dtype", choices=EXPORT_DTYPES, default="bfloat16",
                            help="precision of the saved weights (the shipped drafter is bfloat16)")
    export.set_defaults(func=cmd_export)

    push = sub.add_parser("push", help="upload a trained drafter and its model card to the Hugging Face Hub")
    add_push_arguments(push)
    push.set_defaults(func=cmd_push)

    args = parser.parse_args(argv)
    if args.command not in ("train", "train-depth1"):  # their options and checks are the training modules'
        refuse_empty_values(sub.choices[args.command], args)
    if getattr(args, "max_new_tokens", 1) < 1:
        parser.error("--max-new-tokens must be at least 1")
    if getattr(args, "prompt", "x").strip() == "":
        parser.error("--prompt is empty")
    if not is_utf8(getattr(args, "prompt", "")):
        parser.error("--prompt is not valid UTF-8 text (the shell passed bytes that are not): give it as UTF-8")
    _one_line_warnings()
    try:
        if before_command is not None:
            before_command()
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"treespark: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's usual status for SIGINT
        print("\ntreespark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
