"""The round profile (`treespark bench --profile`): what each phase of a TreeSpark round costs, in milliseconds and
in plain decoding steps.

Speed is acceptance length over a round's cost in plain steps; the comparison measures the first, this measures the
second, phase by phase (draft, tree, datastore, verify, walk, commit, the rest of the loop), for the "auto" budget
and N = 4, 8, 16, against plain greedy on the same prompts in the same run, at batch size 1 or (`--batch-size B`)
on left-padded batches of `B` rows against plain batched `generate`. It is where a slower machine or a costlier
phase shows before it shows as a lost speedup. Writes `profile.json` and `profile.md`.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from ..core.cpu_gemm import model_is_packed
from .suites import suite_inputs

PROFILE_BUDGETS = (4, 8, 16)
PROFILE_PHASES = ("draft", "tree", "datastore", "verify", "walk", "commit")


def _timed_generate(target, inputs: dict, **kwargs):
    start = time.perf_counter()
    out = target.generate(**inputs, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def batched(prompts: list[dict], rows: int, pad_token_id: int) -> list[dict]:
    """Batch-1 inputs as left-padded batches of `rows` (the last may be smaller)."""
    from ..decoding.session import left_padded

    return [left_padded([p["input_ids"][0] for p in prompts[i:i + rows]], pad_token_id)
            for i in range(0, len(prompts), rows)]


def profile_rounds(target, drafter, prompts: list[dict], budgets=PROFILE_BUDGETS, max_new_tokens: int = 64,
                   progress: bool = True) -> dict:
    """What a round costs, phase by phase, against one plain decoding step, measured in one run.

    `prompts` may be batches (`batched`): a round and a plain step then serve every row.

    For each prompt (interleaved): plain greedy `generate` for 1 and for `max_new_tokens` tokens, whose
    difference per token is the plain step; then TreeSpark `generate` at each budget (`"auto"` is
    resolved first) with an `engine.PhaseTimer`. Returns `{"plain_step_ms", "budgets": [...]}` with, per
    budget, milliseconds per round of each phase (`other` = the rest of the loop), the round's cost in
    plain steps, the acceptance length and the speedup they imply (acceptance / round cost).
    """
    from tqdm.auto import tqdm

    from ..decoding.engine import PhaseTimer

    auto = target.generate(**prompts[0], assistant_model=drafter, do_sample=False, max_new_tokens=4,
                           tree_budget="auto", return_dict_in_generate=True).tree_budget
    budgets = [("auto", auto)] + [(str(n), n) for n in budgets]
    timers = {label: PhaseTimer() for label, _ in budgets}
    committed = dict.fromkeys(timers, 0)
    plain_seconds = plain_steps = 0.0
    for inputs in tqdm(prompts, desc="profiling rounds", disable=not progress):
        _, first = _timed_generate(target, inputs, max_new_tokens=1)
        out, full = _timed_generate(target, inputs, max_new_tokens=max_new_tokens)
        steps = out.shape[1] - inputs["input_ids"].shape[1] - 1
        if steps > 0:
            plain_seconds += full - first
            plain_steps += steps
        for label, n in budgets:
            result, _ = _timed_generate(target, inputs, assistant_model=drafter, max_new_tokens=max_new_tokens,
                                        tree_budget=n, tree_timer=timers[label], tree_guard=False,
                                        return_dict_in_generate=True)
            per_row = result.rounds if inputs["input_ids"].shape[0] > 1 else [result.rounds]  # a batch: per row
            committed[label] += sum(len(r.committed) for row in per_row for r in row) / len(per_row)
    plain_ms = 1000 * plain_seconds / max(plain_steps, 1)
    rows = []
    for label, n in budgets:
        timer = timers[label]
        per_round = {phase: 1000 * timer.seconds[phase] / max(timer.rounds, 1) for phase in PROFILE_PHASES}
        round_ms = 1000 * timer.seconds["round"] / max(timer.rounds, 1)
        per_round["other"] = round_ms - sum(per_round.values())
        acceptance = committed[label] / max(timer.rounds, 1)
        rows.append({"budget": label, "N": n, "rounds": timer.rounds, "ms": per_round, "round_ms": round_ms,
                     "round_in_plain_steps": round_ms / plain_ms, "acceptance_length": acceptance,
                     "implied_speedup": acceptance * plain_ms / round_ms})
    return {"plain_step_ms": plain_ms, "prompts": sum(p["input_ids"].shape[0] for p in prompts),
            "rows": prompts[0]["input_ids"].shape[0], "max_new_tokens": max_new_tokens, "budgets": rows}


def profile_table(profile: dict) -> str:
    """The round-cost table in markdown."""
    head = ("| budget | " + " | ".join(f"{p} ms" for p in (*PROFILE_PHASES, "other"))
            + " | round ms | round / plain step | acceptance length | implied speedup |")
    batch = f"batches of {profile['rows']} rows, " if profile.get("rows", 1) > 1 else ""
    lines = [f"Plain decoding step: {profile['plain_step_ms']:.1f} ms ({profile['prompts']} prompts, {batch}"
             f"{profile['max_new_tokens']} new tokens; acceptance length per row).", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for row in profile["budgets"]:
        label = f"auto (N={row['N']})" if row["budget"] == "auto" else f"N={row['N']}"
        cells = [f"{row['ms'][p]:.1f}" for p in (*PROFILE_PHASES, "other")]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {row['round_ms']:.1f} | "
                     f"{row['round_in_plain_steps']:.2f} | {row['acceptance_length']:.2f} | "
                     f"{row['implied_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"



def run_profile(args, target, tokenizer, drafters: dict, suites: list[str]) -> int:
    """`treespark bench --profile`: profile the TreeSpark drafter's rounds on `--num-prompts` prompts of each suite,
    write `profile.json` and `profile.md` into `--output-dir`, print the table."""
    from ..calibration.measure import ensure_latency
    from ..precision import dtype_name

    if "treespark" not in drafters:
        raise ValueError("--profile needs the TreeSpark drafter (--drafter treespark=PATH with --target)")
    drafter = drafters["treespark"]
    ensure_latency(target, drafter)
    prompts = [{name: tensor.to(target.device) for name, tensor in inputs.items()}
               for suite in suites for inputs in suite_inputs(tokenizer, suite, args.num_prompts)]
    rows = args.batch_size[0] if args.batch_size else 1
    if rows > 1:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        prompts = batched(prompts, rows, pad)
    profile = profile_rounds(target, drafter, prompts, max_new_tokens=args.max_new_tokens)
    profile["config"] = {"dtype": dtype_name(target.dtype), "machine": f"{platform.machine()}, "
                         f"{torch.get_num_threads()} torch threads", "suites": suites,
                         "cpu_pack": model_is_packed(target),
                         "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(profile, indent=1))
    packing = "packed oneDNN linears" if profile["config"]["cpu_pack"] else "default linear kernels"
    table = (f"Round cost on {profile['config']['machine']}, {profile['config']['dtype']}, {packing}, "
             f"suites {', '.join(suites)}:\n\n" + profile_table(profile))
    (out / "profile.md").write_text(table)
    print(table)
    print(f"wrote {out / 'profile.json'}, {out / 'profile.md'}")
    return 0
