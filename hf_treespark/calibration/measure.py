"""Measuring on this machine: what a round costs (`calibrate_latency`, and `ensure_latency` on first use) and what
the drafter accepts at each budget (`calibrate_acceptance`, `calibrate_batch_acceptance`): what `treespark
calibrate`, the benchmark and the demo run. Decoding never measures: it reads the cached costs through the cost
table (`budget.use_cost_table`).
"""

from __future__ import annotations

import sys
import time

from ..core.tree import TreePolicy
from ..decoding.budget import CANDIDATE_BUDGETS, batch_budgets, choose_budget, fallback_budget, measured_batch
from .latency import has_latency, latency_path, round_latency, untrusted_in_process, untrusted_recently


def calibrate_latency(target, drafter, policy: TreePolicy | None = None, refresh: bool = False,
                      batch: int = 1) -> dict | None:
    """Measure (once; cached) what a round costs on this device for every candidate budget, for `batch` rows at
    once; None when the measurement could not be trusted (see `latency.round_latency`)."""
    policy = policy or TreePolicy.from_config(drafter.config)
    return round_latency(target, drafter, policy, batch_budgets(policy, batch), refresh=refresh, batch=batch,
                         fallback=fallback_budget(target, policy, drafter))


def ensure_latency(target, drafter, quiet: bool = False) -> None:
    """First use on a machine (the CLI, the benchmark, the demo): measure what a round costs here, once, so
    that `tree_budget="auto"` and the drafter gate decide from this device's numbers. Prints what it does
    unless `quiet`. Measures at most once per process, whatever comes of it."""
    policy = TreePolicy.from_config(drafter.config)
    if not (policy.auto or policy.lookup) or has_latency(target, drafter, policy):
        return
    if untrusted_in_process(target, drafter, policy):
        return  # measured in this process already, and not trusted: "auto" keeps its default
    recent = untrusted_recently(target, drafter, policy)
    if recent is not None:
        if not quiet:
            print(f"[treespark] this machine's round latency, measured {recent[1] / 60:.0f} min ago, was not trusted "
                  f"({recent[0]}): tree_budget='auto' uses its default ({fallback_budget(target, policy, drafter)}) "
                  "for now; `treespark calibrate --force` measures again", file=sys.stderr, flush=True)
        return
    if not quiet:
        print("[treespark] first use on this machine: measuring what a round costs for each tree budget "
              f"(once; cached in {latency_path()})...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    calibrate_latency(target, drafter, policy)
    if not quiet:
        print(f"[treespark] measured in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def ensure_batch_latency(target, drafter, sizes, quiet: bool = False) -> None:
    """`ensure_latency` for batches (`treespark bench --batch-size`): the round costs of each measured batch size
    that prices `sizes` rows (`measured_batch`), measured once where this machine has none, so that the batched
    "auto" and the batch's drafter gate decide from this device's numbers, not `DEFAULT_CPU_BATCH_ROUND_COST`
    (measured on another CPU, in float32). About ten seconds per size on a 2-core CPU. An untrusted measurement
    is handled as `round_latency` handles it (the default stays; not measured again for a while)."""
    policy = TreePolicy.from_config(drafter.config)
    if not (policy.auto or policy.lookup):
        return
    for size in sorted({measured_batch(b) for b in sizes if b > 1}):
        budgets = batch_budgets(policy, size)
        if round_latency(target, drafter, policy, budgets, measure=False, batch=size) is not None:
            continue
        if untrusted_in_process(target, drafter, policy, size) or untrusted_recently(target, drafter, policy, size):
            continue
        if not quiet:
            print(f"[treespark] measuring what a round of {size} rows costs on this machine, for each tree budget "
                  f"(once; cached in {latency_path()})...", file=sys.stderr, flush=True)
        round_latency(target, drafter, policy, budgets, batch=size, fallback=fallback_budget(target, policy, drafter))


def describe_latency(latency: dict, acceptance: dict[int, float] | None = None) -> str:
    """The latency table as text: per budget the verify and draft milliseconds, the round in plain steps and,
    given the acceptance per budget, the expected tokens per second (the best one marked)."""
    step = latency["verify"][0]
    rate = choose_budget(acceptance, latency)[1] if acceptance else {}
    best = max(rate, key=lambda n: (rate[n], -n)) if rate else None
    lines = [f"plain step {step * 1e3:.1f} ms",
             "budget  verify ms  draft ms  round/plain step" + ("  acceptance  tokens/s" if rate else "")]
    for n in sorted(latency["draft"]):
        row = (f"{n:>6}  {latency['verify'][n] * 1e3:>9.1f}  {latency['draft'][n] * 1e3:>8.1f}  "
               f"{(latency['verify'][n] + latency['draft'][n]) / step:>16.2f}")
        if n in rate:
            row += f"  {acceptance[n]:>10.2f}  {rate[n]:>8.1f}" + ("  <- auto" if n == best else "")
        lines.append(row)
    return "\n".join(lines)


def calibrate_acceptance(target, drafter, prompts: list[dict], budgets=CANDIDATE_BUDGETS,
                         max_new_tokens: int = 64, progress: bool = True) -> dict[str, float]:
    """Measure the drafter's mean acceptance length at each budget (greedy) on `prompts`.

    `prompts`: tokenised inputs (`input_ids`, `attention_mask`). The result is what
    `config.acceptance_profile` holds: `{"N": tau}`. Lookup branches are off here (`tree_lookup=0`): `tau(N)`
    prices a drafter round of budget `N`, and with lookup on, lookup-only rounds and the drafter gate (whose
    threshold depends on `N`) would mix rounds of other costs into it (measured: not even monotone in `N`). So is the
    per-call guard (`tree_guard=False`): its probes are plain steps, and at a budget whose rounds are slow on this
    machine it hands the call to plain decoding, so `tau(N)` would fall with `N` for the cost of `N`, which the budget
    choice already prices (docs/design-notes.md, "Calibrating acceptance").
    """
    from tqdm.auto import tqdm

    profile = {}
    for n in tqdm(budgets, desc="calibrating acceptance", disable=not progress):
        committed = rounds = 0
        for inputs in prompts:
            out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens,
                                  do_sample=False, tree_budget=n, tree_lookup=0, tree_guard=False,
                                  return_dict_in_generate=True)
            committed += sum(r.acceptance_length for r in out.rounds)
            rounds += len(out.rounds)
        profile[str(n)] = committed / max(1, rounds)
    return profile


def calibrate_batch_acceptance(target, drafter, prompts: list[dict], budgets=(2, 4, 8), batch: int = 4,
                               max_new_tokens: int = 64, pad_token_id: int = 0,
                               progress: bool = True) -> dict[str, float]:
    """The drafter's mean acceptance length per row and round at each budget in batched decoding (greedy, `batch`
    rows, the package's defaults: lookup and datastore branches within the `N` nodes, the batch's drafter gate):
    what `config.batch_acceptance_profile` holds, `{"N": tau}`. `prompts`: tokenised inputs (`input_ids` `[1, T]`),
    left-padded here into batches of `batch`."""
    from tqdm.auto import tqdm

    from ..decoding.session import left_padded

    batches = [left_padded([p["input_ids"][0] for p in prompts[start:start + batch]], pad_token_id)
               for start in range(0, len(prompts), batch)]
    profile = {}
    for n in tqdm(budgets, desc="calibrating batched acceptance", disable=not progress):
        committed = rounds = 0
        for inputs in batches:
            out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                  tree_budget=n, pad_token_id=pad_token_id, return_dict_in_generate=True)
            per_row = out.rounds if inputs["input_ids"].shape[0] > 1 else [out.rounds]
            committed += sum(r.acceptance_length for row in per_row for r in row)
            rounds += sum(len(row) for row in per_row)
        profile[str(n)] = committed / max(1, rounds)
    return profile
