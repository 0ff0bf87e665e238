"""Acceptance-length and throughput benchmark: `treespark bench` / `python -m hf_treespark.bench.run`.

For each suite (by default MT-Bench first turns, HumanEval, held-out ShareGPT; also `copy`, `multiturn` and
`math`, see `bench_suites`) and each method (plain greedy
`generate`, transformers' prompt-lookup decoding, a DSpark drafter in chain mode, a DSpark-trained
drafter in tree mode, the TreeSpark drafter in chain and tree mode), greedy, batch 1:

- acceptance length: tokens committed per target forward after the prefill (
  accepted nodes + bonus per round; for prompt lookup, counted from the target's forward calls),
- acceptance rate by depth: fraction of rounds whose accepted path reached depth `d`,
- tokens/s and speedup over plain greedy, measured in the same run with the methods interleaved
  prompt by prompt,
- exactness: every speculative output is checked against plain greedy (strict in fp32, the
  near-tie rule in half precision); a violation fails the run after the results are written.

Writes `results.json`, `results.md`, `acceptance_length.png` and `acceptance_by_depth.png`.

This module is the run and its command line; the parts it runs live beside it: the methods (`bench_methods`), the
suites (`bench_suites`), the report's tables, plots and files (`bench_report`), the batch bench (`bench_batch`,
`--batch-size`) and the round profile (`bench_profile`, `--profile`). Their names stay importable from here.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import asdict, replace

import torch

from ..arg_types import batch_sizes
from ..core.cpu_gemm import model_is_packed
from ..decoding.engine import PhaseTimer
from ..help_format import (
    CPU_PACK_CHOICES,
    CPU_PACK_HELP,
    add_device_option,
    add_dtype_option,
    cpu_pack_option,
    refuse_empty_values,
    resolve_device,
)
from ..precision import resolve_dtype
from .batch import run_batches
from .methods import (
    DEFAULT_METHODS,
    METHODS,
    PROMPT_LOOKUP_TOKENS,
    ROLES,
    TREE_METHODS,
    BenchmarkError,
    Method,
    MethodResult,
)
from .profile import run_profile
from .report import (
    check_output_dir,
    markdown_table,
    paired_differences,
    save_report,
)
from .suites import (
    ALL_SUITES,
    SUITE_LABELS,
    SUITES,
    TARGET_SUITES,
    suite_max_prompt_tokens,
    suite_prompts,
)


class ForwardCounter:
    """Counts the target's forward calls (one per prefill, verify round, or plain decoding step), and logs when each
    began, the tokens it was given and the cache length before it (`chain_rounds`)."""

    def __init__(self, model, log: bool = False):
        self.count = 0
        self.logging = log  # only where `chain_rounds` is read: nothing more on the timed path of the other methods
        self.log: list[tuple[float, int, int]] = []  # (perf_counter at the call, input tokens, cache length)
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.count += 1
        if not self.logging:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")  # the first input token's position: the cache length before it
        if positions is not None:
            cached = int(positions.reshape(-1)[0])
        else:
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            cached = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        self.log.append((time.perf_counter(), ids.shape[-1] if ids is not None else 0, cached))

    def chain_rounds(self, end: float, length: int) -> list[tuple[int, int, float]]:
        """Assisted decoding's rounds after the prefill (transformers' prompt lookup), from the log of one batch-1
        call that ended at `end` with `length` tokens: `(committed, candidates verified, seconds)` per round. A
        round's input is the last committed token and its candidates; it commits what its cache grows by before the
        next round (the final sequence holds one token more than the cache: the last round's bonus); its time runs
        from its forward to the next round's (its acceptance and the next round's candidate search included)."""
        rounds = []
        for i, (began, tokens, cached) in enumerate(self.log[1:], start=1):
            following = self.log[i + 1] if i + 1 < len(self.log) else (end, 0, length - 1)
            rounds.append((following[2] - cached, tokens - 1, following[0] - began))
        return rounds

    def close(self) -> None:
        self._handle.remove()


def _generate(target, inputs: dict, method: Method, drafter, max_new_tokens: int, budget):
    """One greedy generate call of `method`: `(sequences [1, T], rounds or None)`."""
    kwargs = dict(method.kwargs)
    if drafter is not None:
        kwargs["assistant_model"] = drafter
        kwargs["return_dict_in_generate"] = True
        if method.name in TREE_METHODS and budget is not None:
            kwargs["tree_budget"] = budget
    out = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
    if drafter is None:
        return out, None
    return out.sequences, out.rounds


def _grown_datastores(drafters: dict, prompts) -> dict:
    """For a suite whose prompts continue conversations (`multiturn`), per drafter role that carries a datastore:
    the store as a process that grows it with its own outputs holds it when the later turns come, that is a copy
    that also indexes the target's earlier answers in those conversations (`SuitePrompt.earlier_outputs`, as
    `generate` adds an output), whatever the drafter's `datastore_grow_tokens`. The copy shares the drafter's index
    and grows no further during the suite, so every method and prompt sees the same store; the drafter's own store
    is left as it is. Empty for a suite without earlier outputs."""
    earlier = [ids for prompt in prompts for ids in prompt.earlier_outputs]
    stores = {role: getattr(drafter, "datastore", None) for role, drafter in drafters.items()}
    return {role: store.frozen_copy(earlier) for role, store in stores.items() if earlier and store is not None}


def _with_datastore(method: Method, grown: dict) -> Method:
    """`method` reading its drafter's grown datastore (`_grown_datastores`) where it reads the drafter's own."""
    if method.kwargs.get("tree_datastore") is True and method.drafter in grown:
        return replace(method, kwargs={**method.kwargs, "tree_datastore": grown[method.drafter]})
    return method


def run_benchmark(target, tokenizer, drafters: dict, suites=SUITES, methods=None, num_prompts: int = 10,
                  max_new_tokens: int = 128, budget: int | str = "auto", max_prompt_tokens: int | None = None,
                  progress: bool = True) -> dict:
    """Run every method on every suite; returns the report (see `write_report`).

    `max_prompt_tokens` None: each suite's own limit (`bench_suites.SUITE_MAX_PROMPT_TOKENS`, else 512). On a
    suite whose prompts continue the target's own conversations (`multiturn`), the datastore methods read their
    drafter's datastore grown with the target's earlier answers (`_grown_datastores`).

    drafters: `{"dspark": drafter, "dspark_tree": drafter, "treespark": drafter, "baseline": drafter}` (any
    of them); methods whose drafter is missing are skipped and listed under `skipped`. `methods` None:
    `DEFAULT_METHODS`, and the baseline's with a baseline drafter.
    Raises `BenchmarkError` (after building the report, attached as `.report`) on any output that
    is not plain greedy's.
    """
    from tqdm.auto import tqdm

    from ..core.exactness import check_greedy_equivalence
    from ..hub import assets

    dtype = next(target.parameters()).dtype
    if methods is None:
        methods = DEFAULT_METHODS + (("baseline_chain", "baseline_datastore") if "baseline" in drafters else ())
    runnable = [METHODS[m] for m in methods if METHODS[m].drafter is None or METHODS[m].drafter in drafters]
    skipped = [m for m in methods if METHODS[m] not in runnable]
    if "plain" not in [m.name for m in runnable]:
        runnable.insert(0, METHODS["plain"])  # the reference for speedup and exactness
    depth = max((d.config.block_size for d in drafters.values()), default=0)

    # One tree budget for both tree methods (same capacity and policy); "auto" is resolved once,
    # on this device, with the TreeSpark drafter's acceptance statistics (or DSpark + Tree's).
    warm = assets.chat_inputs(tokenizer, "Say hello.", device=target.device)
    fixed_budget = None if budget == "auto" else budget
    chooser = next((drafters[m] for m in ("treespark", "dspark_tree") if m in drafters), None)
    if budget == "auto" and chooser is not None and any(m.name in TREE_METHODS for m in runnable):
        out = target.generate(**warm, assistant_model=chooser, do_sample=False, max_new_tokens=16,
                              tree_budget="auto", return_dict_in_generate=True)
        fixed_budget = out.tree_budget
    for method in runnable:  # warm-up: first-call costs stay out of the timings
        _generate(target, warm, method, drafters.get(method.drafter), 8, fixed_budget)

    results, violations = {}, []
    for suite in suites:
        prompts = suite_prompts(tokenizer, suite, num_prompts, max_prompt_tokens, target=target, progress=progress)
        grown = _grown_datastores(drafters, prompts)
        suite_methods = [_with_datastore(m, grown) for m in runnable]
        rows = {m.name: MethodResult(suite, m.name, m.label, rounds_reaching_depth=[0] * depth) for m in runnable}
        for index, prompt in enumerate(tqdm(prompts, desc=f"bench {SUITE_LABELS[suite]}", disable=not progress)):
            inputs = {name: tensor.to(target.device) for name, tensor in prompt.inputs.items()}
            prompt_len = inputs["input_ids"].shape[1]
            reference = None
            for method in suite_methods:
                drafter = drafters.get(method.drafter)
                timer = PhaseTimer() if drafter is not None else None  # each source's share of the time
                timed = method if timer is None else replace(method, kwargs={**method.kwargs, "tree_timer": timer})
                counter = ForwardCounter(target, log=method.name == "prompt_lookup")
                start = time.perf_counter()
                try:
                    sequences, rounds = _generate(target, inputs, timed, drafter, max_new_tokens, fixed_budget)
                finally:
                    seconds = time.perf_counter() - start
                    counter.close()
                row = rows[method.name]
                row.add(sequences.shape[1] - prompt_len, seconds, counter.count, rounds,
                        None if timer is None else dict(timer.seconds))
                if method.name == "prompt_lookup":  # its rounds that verified a chain, against lookup-only rounds
                    for committed, nodes, spent in counter.chain_rounds(start + seconds, sequences.shape[1]):
                        if nodes > 0:
                            row.add_chain_round(committed, nodes, spent)
                if method.name == "plain":
                    reference = sequences
                    row.exact += 1
                    continue
                report = check_greedy_equivalence(target, reference, sequences)
                row.exact += int(report.ok)
                if not report.ok:
                    violations.append(f"{method.name} on {suite} prompt {index}: {report}")
        plain_tps = rows["plain"].new_tokens / rows["plain"].seconds if rows["plain"].seconds else None
        for row in rows.values():
            row.finish(plain_tps)
        results[suite] = rows

    report = {
        "config": {
            "dtype": str(dtype).replace("torch.", ""),
            "device": str(next(target.parameters()).device),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
            "cpu_pack": model_is_packed(target),
            "target": getattr(target.config, "_name_or_path", "") or target.config.model_type,
            "num_prompts": num_prompts,
            "max_prompt_tokens": {s: max_prompt_tokens or suite_max_prompt_tokens(s) for s in suites},
            "max_new_tokens": max_new_tokens,
            "tree_budget": fixed_budget if fixed_budget is not None else "drafter default",
            "requested_budget": budget,
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
            "methods": [m.name for m in runnable],
            "skipped": skipped,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "results": [asdict(row) for rows in results.values() for row in rows.values()],
        "violations": violations,
    }
    report["paired_differences"] = paired_differences(report)
    if violations:
        err = BenchmarkError("outputs differ from plain greedy decoding:\n  " + "\n  ".join(violations))
        err.report = report
        raise err
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `treespark bench` and `python -m hf_treespark.bench.run`."""
    parser.add_argument("--suites", default=",".join(SUITES),
                        help=f"comma-separated, from {', '.join(ALL_SUITES)} (copy: long texts to summarise, rewrite "
                             "or correct; multiturn: MT-Bench second turns after the target's own first answers; "
                             "math: CHAMP problems)")
    parser.add_argument("--methods", help=f"comma-separated, from {', '.join(METHODS)} (default: "
                                          f"{','.join(DEFAULT_METHODS)}, and the baseline's with a baseline drafter)")
    parser.add_argument("--num-prompts", type=int, default=10, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", action="append", default=[], metavar="ROLE=PATH",
                        help="drafter per role (treespark, dspark, dspark_tree, baseline: another TreeSpark drafter "
                             "to compare with, side by side); treespark defaults to the shipped drafter; a method "
                             "whose drafter is missing is skipped")
    parser.add_argument("--budget", default="auto", help="tree budget for both tree methods, or 'auto'")
    parser.add_argument("--target", help="target model name or path (default: offline SmolLM2-135M-Instruct)")
    add_device_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)
    parser.add_argument("--output-dir", default="bench_results")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the comparison: what each phase of a TreeSpark round costs, in ms and in "
                             "plain decoding steps, for the chosen auto budget and N = 4, 8, 16 (profile.md/json); "
                             "with --batch-size B (one size), on batches of B rows")
    parser.add_argument("--batch-size", metavar="B[,B...]", type=batch_sizes,
                        help="instead of the comparison: tokens/s of all rows, TreeSpark against plain batched "
                             "generate, for these batch sizes (1-256, e.g. 1,2,4,8,16; batch.md/json); suites as "
                             "--suites")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check: 1 prompt per suite, 8 new tokens, budget 8 unless given")


def run_from_args(args: argparse.Namespace) -> int:
    """Check the options, the output directory, then load the models and run the comparison (or the profile, or
    the batch bench); 1 after an inexact output, its results written first."""
    from ..hub import assets
    from ..hub.loading import load_drafter, load_target

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    baseline = any(item.partition("=")[0] == "baseline" for item in args.drafter)
    default = DEFAULT_METHODS + (("baseline_chain", "baseline_datastore") if baseline else ())
    methods = [m.strip() for m in (args.methods if args.methods is not None else ",".join(default)).split(",")
               if m.strip()]
    for name, values, known in (("suite", suites, ALL_SUITES), ("method", methods, METHODS)):
        if not values:  # `--suites ,`: never a way to ask for the default
            raise ValueError(f"--{name}s {getattr(args, name + 's')!r}: no {name} named; choose from "
                             f"{', '.join(known)} (comma-separated)")
        for value in values:
            if value not in known:
                raise ValueError(f"unknown {name} {value!r}; choose from {', '.join(known)}")
    needs_target = [s for s in suites if s in TARGET_SUITES]
    if needs_target and (args.batch_size or args.profile):
        raise ValueError(f"--suites {','.join(needs_target)}: its prompts hold the target's own earlier answers, which "
                         f"{'--batch-size' if args.batch_size else '--profile'} does not make; run it without")
    if args.profile and args.batch_size and len(args.batch_size) != 1:
        raise ValueError(f"--profile profiles one batch size; got --batch-size {','.join(map(str, args.batch_size))}")
    if args.budget != "auto" and not (args.budget.isdigit() and int(args.budget) > 0):
        raise ValueError(f"--budget {args.budget!r}: expected a positive integer or 'auto'")
    budget = args.budget if args.budget == "auto" else int(args.budget)
    if args.smoke:
        args.num_prompts, args.max_new_tokens = 1, 8
        budget = 8 if args.budget == "auto" else budget
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts and --max-new-tokens must be at least 1")

    paths = {}
    for item in args.drafter:
        role, sep, path = item.partition("=")
        if not sep or role not in ROLES:
            raise ValueError(f"--drafter {item!r}: expected ROLE=PATH with ROLE one of {', '.join(ROLES)}")
        paths[role] = path
    check_output_dir(args.output_dir)
    pack = cpu_pack_option(args.cpu_pack)
    target, tokenizer = load_target(args.target, dtype, device=device, cpu_pack=pack)
    drafters, loaded = {}, {}
    for role in ROLES:
        path = paths.get(role)
        if path is None and role == "treespark" and not args.target:
            path = ""  # the shipped default drafter
        if path is None:
            continue
        if path not in loaded:
            loaded[path] = load_drafter(path, dtype, device=device, cpu_pack=pack)
        drafters[role] = loaded[path]

    if args.profile:
        return run_profile(args, target, tokenizer, drafters, suites)
    from ..calibration.measure import ensure_latency

    if args.batch_size:
        return run_batches(args, target, tokenizer, drafters, suites, budget)

    for drafter in loaded.values():  # first use on this machine: "auto" budget and gate from its numbers
        ensure_latency(target, drafter)
    try:
        report = run_benchmark(target, tokenizer, drafters, suites, methods, args.num_prompts, args.max_new_tokens,
                               budget)
        failed = None
    except BenchmarkError as err:
        report, failed = err.report, err
    report["config"]["drafters"] = {role: paths.get(role) or "shipped default" for role in drafters}
    report["config"]["target"] = args.target or assets.DEFAULT_TARGET_NAME
    written = save_report(report, args.output_dir)
    print(markdown_table(report))
    print("wrote " + ", ".join(str(p) for p in written))
    if failed is not None:
        print(f"treespark bench: FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_treespark.bench.run`: the same as `treespark bench`, with its one-line errors; `generate` is
    routed whatever `HF_TREESPARK_NO_PATCH` says (`cli.commands._route_generate`)."""
    from ..decoding.integration import install
    from ..help_format import DefaultsHelpFormatter, run_script

    install()

    parser = argparse.ArgumentParser(prog="treespark bench", description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    return run_script(parser, lambda args: refuse_empty_values(parser, args) or run_from_args(args), argv)


if __name__ == "__main__":
    sys.exit(main())
