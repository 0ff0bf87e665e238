"""`treespark calibrate`'s checks and reports: its inputs checked before anything is measured, the acceptance
profile written whole, and the latency tables it prints (the command itself is `cli.cmd_calibrate`)."""

from __future__ import annotations

import json
from pathlib import Path


def parse_budgets(text: str) -> tuple[int, ...]:
    """`--budgets 2,4,8` as sorted distinct positive integers; `ValueError` naming the option otherwise."""
    try:
        budgets = tuple(sorted({int(n) for n in text.split(",")}))
    except ValueError:
        raise ValueError(f"--budgets {text!r}: expected comma-separated integers, e.g. 2,4,8") from None
    if not budgets or min(budgets) < 1:
        raise ValueError(f"--budgets {text!r}: budgets must be positive integers")
    return budgets


def read_drafter_config(drafter: str, budgets: tuple[int, ...], budgets_text: str,
                        latency_only: bool) -> tuple[Path, dict]:
    """`(config_path, config)` of the drafter directory `drafter`, checked before anything is measured: a
    TreeSpark config, trees that can hold the largest budget, and (unless `latency_only`) a directory the profile
    can be written into. Raises `OSError` or `ValueError` naming the problem and what to do."""
    from ..core.tree import TreePolicy
    from ..drafter.configuration import TreeSparkConfig
    from ..storage import unwritable_reason

    config_path = Path(drafter) / "config.json"
    if not config_path.is_file():
        raise OSError(f"No TreeSpark drafter directory at {drafter!r} (config.json missing)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        drafter_config = TreeSparkConfig.from_dict(config)
    except (UnicodeDecodeError, ValueError, TypeError) as err:
        raise ValueError(f"{config_path} is not a valid drafter config ({err}): nothing was measured") from None
    pool = TreePolicy.from_config(drafter_config, budget=1).with_budget(10**9).num_candidates
    if max(budgets) > pool:
        raise ValueError(f"--budgets {budgets_text!r}: the drafter's trees hold at most {pool} candidates "
                         f"(tree_topk, tree_frontier, tree_depth), so budget {max(budgets)} is never used; "
                         f"choose budgets up to {pool}")
    problem = None if latency_only else unwritable_reason(config_path.parent)
    if problem is not None:
        raise OSError(f"cannot write the acceptance profile into {config_path.parent} ({problem}): copy the "
                      "drafter to a writable directory and calibrate that")
    return config_path, config


def write_config(config_path: Path, config: dict) -> None:
    """Replace `config_path` by `config`, only if it still loads as a drafter config, and never half-written."""
    from ..drafter.configuration import TreeSparkConfig

    TreeSparkConfig.from_dict(config)  # raises, before writing, if the directory would no longer load
    tmp = config_path.with_suffix(".json.tmp")  # a crash never leaves a half-written config
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(config_path)


def print_latency(latency, target, drafter, policy) -> None:
    """`treespark calibrate`'s report: the latency table and the budget "auto" takes from it."""
    from ..calibration.latency import LATENCY_FILE
    from ..calibration.measure import describe_latency
    from ..decoding.budget import fallback_budget, profile_acceptance
    from ..storage import cache_dir

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


def print_batch_latency(size: int, latency, target, drafter, policy) -> None:
    """One line per measured batch size: a round's cost in plain steps of that batch, and the budget "auto" takes."""
    from ..decoding.budget import BatchBudget

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
