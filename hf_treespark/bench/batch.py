"""The batch bench (`treespark bench --batch-size`): tokens per second of all rows, TreeSpark against plain batched
`generate`, per batch size.

A batch of B rows shares each target forward, so what a tree buys at batch 1 is not what it buys at B rows: this
measures it directly, the way a batched pipeline calls `generate` (left-padded chat prompts, greedy), the two
methods interleaved batch by batch. Every row is checked against plain decoding at one width, so padding alone is
never read as a divergence. Writes `batch.json` and `batch.md`.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from ..core.cpu_gemm import model_is_packed
from .methods import BenchmarkError
from .report import cell
from .suites import SUITE_LABELS, select_prompts, suite_max_prompt_tokens


def batch_inputs(tokenizer, prompts: list[str]) -> dict:
    """A left-padded batch of chat-formatted prompts (`input_ids`, `attention_mask`), as a batched pipeline makes."""
    from ..decoding.session import left_padded
    from ..hub import assets

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return left_padded([assets.chat_inputs(tokenizer, p)["input_ids"][0] for p in prompts], pad)


def same_width(first: torch.Tensor, second: torch.Tensor, pad: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches of sequences right-padded with `pad` to the longer one's width.

    A batch is as wide as its longest row, so a row that diverges (at a near-tie, in half precision) and runs
    longer on one side widens that side's whole batch: its other rows, the same tokens then more padding, must
    not read as a divergence. Where one row goes on past the other's end (`pad` = EOS here), the comparison
    meets the real divergence: the token against the padding that ended the row."""
    width = max(first.shape[1], second.shape[1])
    if pad is None or first.shape[1] == second.shape[1]:
        return first, second
    return tuple(torch.nn.functional.pad(seq, (0, width - seq.shape[1]), value=pad) for seq in (first, second))


def run_batch_benchmark(target, tokenizer, drafter, suites=("mtbench", "humaneval"), batch_sizes=(1, 2, 4, 8, 16),
                        num_prompts: int = 16, max_new_tokens: int = 128, budget: int | str = "auto",
                        max_prompt_tokens: int | None = None, progress: bool = True) -> dict:
    """Tokens per second of all rows, TreeSpark (the drafter's defaults) against plain batched `generate`, greedy,
    for each suite and batch size `B`: the suite's first `B x (num_prompts // B)` prompts (at least one batch) in
    left-padded batches of `B`, the two methods interleaved batch by batch (which runs first alternates, so a drift
    of the machine's speed falls on both); every TreeSpark batch is checked
    against plain (strict in float32, the near-tie rule in half precision). `max_prompt_tokens`: the longest prompt
    (None: each suite's own, `bench_suites.suite_max_prompt_tokens`). Raises `BenchmarkError` (with the report) after
    an inexact batch."""
    from tqdm.auto import tqdm

    from ..core.exactness import check_greedy_equivalence
    from ..hub import assets
    from ..precision import dtype_name

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, failures = [], []
    for suite in suites:
        limit = max_prompt_tokens if max_prompt_tokens is not None else suite_max_prompt_tokens(suite)
        candidates = [p for p in select_prompts(suite, 4 * num_prompts)
                      if assets.chat_inputs(tokenizer, p)["input_ids"].shape[1] <= limit][:num_prompts]
        for size in batch_sizes:
            count = max(1, len(candidates) // size) * size
            prompts = [candidates[i % len(candidates)] for i in range(count)]
            batches = [batch_inputs(tokenizer, prompts[i:i + size]) for i in range(0, count, size)]
            batches = [{name: tensor.to(target.device) for name, tensor in batch.items()} for batch in batches]
            kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": pad}
            target.generate(**batches[0], **{**kwargs, "max_new_tokens": 2})  # warm-up of this shape
            target.generate(**batches[0], **{**kwargs, "max_new_tokens": 2}, assistant_model=drafter)
            seconds = {"plain": 0.0, "treespark": 0.0}
            tokens, committed, rounds, budgets = 0, 0, 0, []
            for number, inputs in enumerate(tqdm(batches, desc=f"{suite} B={size}", disable=not progress)):
                for method in ("plain", "treespark") if number % 2 == 0 else ("treespark", "plain"):  # alternating
                    start = time.perf_counter()
                    if method == "plain":
                        plain = target.generate(**inputs, **kwargs)
                    else:
                        out = target.generate(**inputs, **kwargs, assistant_model=drafter, tree_budget=budget,
                                              return_dict_in_generate=True)
                    seconds[method] += time.perf_counter() - start
                width = inputs["input_ids"].shape[1]
                tokens += int((plain[:, width:] != pad).sum()) if pad is not None else plain[:, width:].numel()
                per_row = out.rounds if size > 1 else [out.rounds]
                committed += sum(r.acceptance_length for row in per_row for r in row)
                rounds += sum(len(row) for row in per_row)
                budgets.append(out.tree_budget)
                reference, candidate = same_width(plain, out.sequences, pad)
                for i in range(size):
                    start = int((inputs["attention_mask"][i] == 0).sum())  # the row without its left padding
                    report = check_greedy_equivalence(target, reference[i:i + 1, start:], candidate[i:i + 1, start:])
                    if not report.ok:
                        failures.append(f"{suite} B={size} row {i}: {report}")
            rows.append({"suite": suite, "batch_size": size, "prompts": count, "new_tokens": tokens,
                         "plain_tps": tokens / seconds["plain"], "treespark_tps": tokens / seconds["treespark"],
                         "speedup": seconds["plain"] / seconds["treespark"],
                         "acceptance_length": committed / rounds if rounds else None,  # None: plain decoding
                         "budgets": sorted(set(budgets))})
    report = {"rows": rows, "config": {"dtype": dtype_name(target.dtype), "max_new_tokens": max_new_tokens,
                                       "num_prompts": num_prompts, "budget": budget,
                                       "cpu_pack": model_is_packed(target),
                                       "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
                                       "torch": torch.__version__,
                                       "transformers": __import__("transformers").__version__}}
    if failures:
        err = BenchmarkError("outputs differ from plain batched greedy decoding: " + "; ".join(failures[:3]))
        err.report = report
        raise err
    return report


def batch_table(report: dict) -> str:
    """The batch benchmark as a markdown table."""
    cfg = report["config"]
    lines = [f"Greedy, {cfg['max_new_tokens']} new tokens, {cfg['dtype']}, {cfg['machine']}; tokens per second of all "
             "rows, TreeSpark (defaults) against plain batched `generate`, one run:", "",
             "| suite | B | prompts | plain tok/s | TreeSpark tok/s | speedup | tokens per round (per row) | budget |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {SUITE_LABELS.get(row['suite'], row['suite'])} | {row['batch_size']} | {row['prompts']} | "
                     f"{row['plain_tps']:.1f} | {row['treespark_tps']:.1f} | {row['speedup']:.2f}x | "
                     f"{cell(row['acceptance_length'])} | "
                     f"{', '.join(str(b) if b else '0 (plain)' for b in row['budgets'])} |")
    return "\n".join(lines)


def run_batches(args, target, tokenizer, drafters: dict, suites: list[str], budget) -> int:
    """`treespark bench --batch-size`: run `run_batch_benchmark` for the TreeSpark drafter, write `batch.json` and
    `batch.md` into `--output-dir`, print the table; 1 after an inexact batch (its results written first)."""
    from ..calibration.measure import ensure_batch_latency, ensure_latency

    sizes = list(args.batch_size)  # parsed and bounded by `arg_types.batch_sizes`
    if "treespark" not in drafters:
        raise ValueError("--batch-size needs the TreeSpark drafter (--drafter treespark=PATH with --target)")
    drafter = drafters["treespark"]
    ensure_latency(target, drafter)
    ensure_batch_latency(target, drafter, sizes)
    try:
        report, failed = run_batch_benchmark(target, tokenizer, drafter, suites, sizes, args.num_prompts,
                                             args.max_new_tokens, budget), None
    except BenchmarkError as err:
        report, failed = err.report, err
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(report, indent=1))
    table = batch_table(report)
    (out / "batch.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'batch.json'}, {out / 'batch.md'}")
    if failed is not None:
        print(f"treespark bench: FAILED: {failed}", file=sys.stderr)
        return 1
    return 0
