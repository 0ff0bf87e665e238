"""The comparison's report: its markdown tables, paired differences, plots, and where its files go.

`results.json` holds every number of a run (the config it ran under, one row per suite and method, the paired
per-prompt differences, any exactness violation); `results.md` and the two plots are read from it alone, so a
report can be redrawn without rerunning the models. The output directory is checked before any model is loaded,
and a run whose directory fails at the end writes to a temporary one instead: a finished run is never lost.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from .methods import COMMITTED_BINS, METHODS, committed_bin
from .suites import SUITE_LABELS

# (method, baseline) pairs whose per-prompt acceptance lengths are compared in the report
PAIRS = (("dspark_tree", "dspark"), ("treespark", "dspark_tree"), ("treespark", "treespark_chain"),
         ("treespark_lookup", "treespark"), ("treespark_datastore", "treespark_lookup"),
         ("treespark_chain", "baseline_chain"), ("treespark_datastore", "baseline_datastore"),
         ("treespark_datastore", "treespark_unguarded"), ("treespark_datastore", "treespark_priced"),
         ("treespark_datastore", "treespark_no_datastore"), ("treespark_datastore", "treespark_no_lookup"))


def paired_differences(report: dict) -> list[dict]:
    """For every pair in `PAIRS` run on a suite: the ratio of acceptance lengths, and the mean, standard
    deviation and standard error of the per-prompt differences (the same prompts, so the prompt-to-prompt
    spread that both methods share cancels)."""
    by_key = {(r["suite"], r["method"]): r for r in report["results"]}
    pairs = []
    for suite in dict.fromkeys(r["suite"] for r in report["results"]):
        for method, baseline in PAIRS:
            a, b = by_key.get((suite, method)), by_key.get((suite, baseline))
            if not a or not b or not a.get("prompt_acceptance") or not b["acceptance_length"]:
                continue
            if len(a["prompt_acceptance"]) != len(b.get("prompt_acceptance", [])):
                continue
            diffs = [x - y for x, y in zip(a["prompt_acceptance"], b["prompt_acceptance"], strict=True)]
            sd = statistics.stdev(diffs) if len(diffs) >= 2 else None
            pairs.append({"suite": suite, "method": method, "label": a["label"], "baseline": baseline,
                          "baseline_label": b["label"], "ratio": a["acceptance_length"] / b["acceptance_length"],
                          "mean": statistics.fmean(diffs), "sd": sd,
                          "se": sd / len(diffs) ** 0.5 if sd is not None else None})
    return pairs


def cell(value, spec: str = ".2f") -> str:
    """A number as a table cell: formatted with `spec`, or a dash where there is none."""
    return "–" if value is None else format(value, spec)


# the methods that can have such tokens
SHARE_COLUMNS = {"lookup_accepted": ("treespark_lookup", "treespark_datastore", "treespark_unguarded",
                                     "treespark_priced", "treespark_no_datastore"),
                 "datastore_accepted": ("treespark_datastore", "treespark_unguarded", "treespark_priced",
                                        "treespark_no_lookup")}


def _share(row: dict, key: str) -> str:
    """The share of a method's new tokens that only lookup (`lookup_accepted`) or only the datastore proposed."""
    if row["method"] not in SHARE_COLUMNS[key] or not row["new_tokens"]:
        return "–"
    return f"{100 * row.get(key, 0) / row['new_tokens']:.1f}%"


def _time_share(row: dict, phase: str) -> str:
    """The share of a drafter method's wall time spent in one round phase (`draft`: drafter passes, `datastore`:
    its lookups), from the phase timer the bench runs it with."""
    phases = row.get("phase_seconds") or {}
    if not phases or not row["seconds"]:
        return "–"
    return f"{100 * phases.get(phase, 0.0) / row['seconds']:.1f}%"


def markdown_table(report: dict) -> str:
    """The report as markdown: one row per suite and method, then the paired differences, acceptance by depth,
    rounds by kind, and where the tokens and the time come from."""
    cfg = report["config"]
    lines = [
        f"Target {cfg['target']}, {cfg['dtype']} on {cfg['device']} ({cfg['machine']}"
        f"{', packed oneDNN linears' if cfg.get('cpu_pack') else ''}), greedy, batch 1, "
        f"{cfg['num_prompts']} prompts per suite, {cfg['max_new_tokens']} new tokens; tree budget "
        f"{cfg['tree_budget']} (requested {cfg['requested_budget']}); torch {cfg['torch']}, "
        f"transformers {cfg['transformers']}.",
        "",
        "| suite | method | acceptance length | tokens/s | speedup vs plain | vs prompt lookup | exact "
        "| new tokens from lookup | new tokens from datastore | time in drafter passes | time in datastore lookups "
        "| SD over prompts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lookup_tps = {r["suite"]: r["tokens_per_second"] for r in report["results"] if r["method"] == "prompt_lookup"}
    for row in report["results"]:
        versus = lookup_tps.get(row["suite"])
        versus = row["tokens_per_second"] / versus if versus and row["tokens_per_second"] else None
        lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | {cell(row['acceptance_length'])} | "
                     f"{cell(row['tokens_per_second'], '.1f')} | {cell(row['speedup'])}x | "
                     f"{cell(versus)}{'x' if versus else ''} | {row['exact']}/{row['prompts']} | "
                     f"{_share(row, 'lookup_accepted')} | {_share(row, 'datastore_accepted')} | "
                     f"{_time_share(row, 'draft')} | {_time_share(row, 'datastore')} | "
                     f"{cell(row.get('acceptance_sd'))} |")
    pairs = paired_differences(report)
    if pairs:
        lines += ["", "Paired per-prompt differences in acceptance length (same prompts; SE = SD / sqrt(n)):", "",
                  "| suite | method | baseline | ratio | mean difference | SD of differences | SE |",
                  "|---|---|---|---|---|---|---|"]
        for pair in pairs:
            lines.append(f"| {SUITE_LABELS[pair['suite']]} | {pair['label']} | {pair['baseline_label']} | "
                         f"{pair['ratio']:.2f}x | {pair['mean']:+.3f} | {cell(pair['sd'], '.3f')} | "
                         f"{cell(pair['se'], '.3f')} |")
    depth_rows = [r for r in report["results"] if r["acceptance_by_depth"]]
    if depth_rows:
        depth = max(len(r["acceptance_by_depth"]) for r in depth_rows)
        lines += ["", "Acceptance rate by depth (fraction of rounds whose accepted path reached depth d):", "",
                  "| suite | method | " + " | ".join(f"d={d}" for d in range(1, depth + 1)) + " |",
                  "|---|---|" + "---|" * depth]
        for row in depth_rows:
            rates = " | ".join(f"{100 * x:.1f}%" for x in row["acceptance_by_depth"])
            lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | {rates} |")
    lines += _round_kinds_table(report)
    lines += _chain_rounds_table(report)
    lines += _sources_table(report)
    if report["config"]["skipped"]:
        lines += ["", f"Skipped (no drafter given): {', '.join(report['config']['skipped'])}."]
    return "\n".join(lines) + "\n"


def _round_kinds_table(report: dict) -> list[str]:
    """Each drafter method's rounds by kind (`engine.ROUND_KINDS`): how many, what each verified and committed, and
    what each cost against a plain step (plain decoding's seconds per new token on the same suite)."""
    rows = [r for r in report["results"] if r.get("round_kinds")]
    if not rows:
        return []
    plain = {r["suite"]: r["seconds"] / r["new_tokens"] for r in report["results"]
             if r["method"] == "plain" and r["new_tokens"]}
    lines = ["", "Rounds by kind (drafter: a drafter pass's tree with any lookup and datastore branches; lookup: a "
             "lookup-only branch; gated: the drafter gate closed; probe: the guard's root-only step). A round's cost "
             "is its wall time in the loop, in plain steps (plain decoding's seconds per new token on the suite):", "",
             "| suite | method | kind | share of rounds | nodes / round | accepted / node | tokens / round "
             "| ms / round | round / plain step | tokens per plain step | share of time | share of tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        kinds = row["round_kinds"]
        rounds, tokens, seconds = (sum(k[i] for k in kinds.values()) for i in (0, 3, 4))
        step = plain.get(row["suite"])
        for kind, (count, nodes, accepted, committed, spent) in kinds.items():
            cost = spent / count / step if step else None
            lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | {kind} | {100 * count / rounds:.0f}% | "
                         f"{nodes / count:.1f} | {cell(accepted / nodes if nodes else None)} | "
                         f"{committed / count:.2f} | {1000 * spent / count:.1f} | {cell(cost)} | "
                         f"{cell(committed / count / cost if cost else None)} | {100 * spent / seconds:.0f}% | "
                         f"{100 * committed / tokens:.0f}% |")
    return lines


CHAIN_TITLE = "A lookup-only round against a prompt-lookup round that commits as much"


def _chain_rounds_table(report: dict) -> list[str]:
    """Each drafter method's lookup-only rounds against prompt lookup's rounds that verified a chain, grouped by the
    tokens a round committed (`methods.COMMITTED_BINS`): rounds, chain tokens verified and milliseconds per round,
    and the ratio of the two costs; the "all" row weighs each group's cost ratio by prompt lookup's rounds in it
    (its mix of accepted lengths)."""
    lookup = {r["suite"]: r["chain_rounds"] for r in report["results"]
              if r["method"] == "prompt_lookup" and r.get("chain_rounds")}
    rows = [r for r in report["results"] if r["method"] != "prompt_lookup" and r.get("chain_rounds")
            and r["suite"] in lookup]
    if not rows:
        return []
    lines = ["", f"{CHAIN_TITLE}: rounds that verify one lookup chain and no drafter pass, by the tokens they "
             "committed (accepted + 1); prompt lookup's rounds that had candidates, timed from one target forward to "
             "the next (its candidate search included); the cost ratio of the two at the same accepted length:", "",
             "| suite | method | tokens committed | rounds | chain tokens / round | ms / round | prompt lookup: rounds "
             "| chain tokens / round | ms / round | cost, ours / prompt lookup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = {label: i for i, label in enumerate(committed_bin(low) for low, _ in COMMITTED_BINS)}
    for row in rows:
        theirs, weighted, weight = lookup[row["suite"]], 0.0, 0
        for label in sorted(row["chain_rounds"], key=order.get):
            count, nodes, spent = row["chain_rounds"][label]
            other = theirs.get(label)
            ratio = None
            if other:
                ratio = (spent / count) / (other[2] / other[0])
                weighted, weight = weighted + other[0] * ratio, weight + other[0]
            lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | {label} | {count} | {nodes / count:.1f} "
                         f"| {1000 * spent / count:.1f} | {other[0] if other else 0} | "
                         f"{cell(other[1] / other[0] if other else None, '.1f')} | "
                         f"{cell(1000 * other[2] / other[0] if other else None, '.1f')} | {cell(ratio)} |")
        lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | all | – | – | – | {weight} | – | – | "
                     f"{cell(weighted / weight if weight else None)} |")
    return lines


SOURCES_TITLE = "Where the tokens and the time come from"


def _percent(share: float | None) -> str:
    """A fraction as a percentage cell, or a dash where there is none."""
    return "–" if share is None else f"{100 * share:.1f}%"


def _sources_table(report: dict) -> list[str]:
    """Each drafter method's `token_shares` (of the tokens its rounds committed) and `time_shares` (of its decoding
    time), one column per branch source's phase that any row timed; rows without them (plain, prompt lookup, a report
    from before they were recorded) are left out."""
    rows = [r for r in report["results"] if r.get("token_shares") or r.get("time_shares")]
    if not rows:
        return []
    sources = list(dict.fromkeys(name for r in rows for name in (r.get("time_shares") or {}).get("sources", {})))
    sources.sort(key=lambda name: name != "datastore")  # the datastore first, then registered sources as they came
    lines = ["", f"{SOURCES_TITLE}: each drafter method's tokens committed by its rounds, split into the bonus token "
             "that ends each round (the target's own; a plain step's after a hand-off), accepted nodes only lookup "
             "proposed, only the datastore, and the other accepted nodes (the drafter's; a registered source's too); "
             "its decoding time, split into the drafter pass and tree (draft + tree phases, lookup's search "
             "included), each branch source's proposals, the target's verify forward, and the rest (walk, commit, "
             "prefill, the loop):", "",
             "| suite | method | round tokens | bonus | lookup only | datastore only | drafter | time: drafter pass "
             "+ tree | " + "".join(f"time: {name} | " for name in sources) + "time: verify | time: rest |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(sources) + "---|---|"]
    for row in rows:
        tokens = row.get("token_shares") or {}
        times = row.get("time_shares") or {}
        cells = [str(row.get("round_tokens", "–"))]
        cells += [_percent(tokens.get(key)) for key in ("bonus", "lookup", "datastore", "drafter")]
        cells.append(_percent(times.get("drafter")))
        cells += [_percent(times.get("sources", {}).get(name)) for name in sources]
        cells += [_percent(times.get("verify")), _percent(times.get("rest"))]
        lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | " + " | ".join(cells) + " |")
    return lines


# matplotlib's "tab10" colours, then four of "tab20b": one per method, the same in every plot.
PLOT_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39")


def method_colours(methods) -> dict[str, str]:
    """A colour per method name, fixed by the method's place in `METHODS` (others follow in the given order),
    so a method keeps its colour whichever methods a plot shows."""
    order = list(METHODS) + [m for m in dict.fromkeys(methods) if m not in METHODS]
    return {m: PLOT_COLOURS[order.index(m) % len(PLOT_COLOURS)] for m in dict.fromkeys(methods)}


def plot_report(report: dict, out_dir: Path) -> list[Path]:
    """`acceptance_length.png` (per suite per method) and `acceptance_by_depth.png` (like the paper's Fig. 2)."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("The benchmark plots need matplotlib: pip install 'hf_treespark[bench]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["acceptance_length"] is not None]
    suites = list(dict.fromkeys(r["suite"] for r in report["results"]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    labels = {r["method"]: r["label"] for r in rows}
    colours = method_colours(methods)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [next((r["acceptance_length"] for r in rows if r["suite"] == s and r["method"] == method), 0)
                  for s in suites]
        xs = [k + (i - (len(methods) - 1) / 2) * width for k in range(len(suites))]
        bars = ax.bar(xs, values, width, label=labels[method], color=colours[method])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(suites)), [SUITE_LABELS[s] for s in suites])
    ax.set_ylabel("mean acceptance length (tokens / target forward)")
    ax.set_title(f"Acceptance length ({report['config']['dtype']}, tree budget {report['config']['tree_budget']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "acceptance_length.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    depth_rows = [r for r in rows if r["acceptance_by_depth"]]
    fig, axes = plt.subplots(1, len(suites), figsize=(4 * len(suites), 3.6), sharey=True, squeeze=False)
    for ax, suite in zip(axes[0], suites, strict=True):
        for row in (r for r in depth_rows if r["suite"] == suite):
            rates = row["acceptance_by_depth"]
            ax.plot(range(1, len(rates) + 1), [100 * x for x in rates], marker="o", label=row["label"],
                    color=colours[row["method"]])
        ax.set_title(SUITE_LABELS[suite])
        ax.set_xlabel("depth")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("rounds reaching depth (%)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "acceptance_by_depth.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_report(report: dict, out_dir: str | Path) -> list[Path]:
    """Write `results.json`, `results.md` and the plots into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown_table(report))
    return [out / "results.json", out / "results.md", *plot_report(report, out)]


def check_output_dir(out_dir: str | Path) -> Path:
    """Create `out_dir` if needed and check that a file can be written there.

    Called before any model is loaded: a benchmark runs for minutes to hours, and finding out only at the end
    that `--output-dir` is a file or read-only would waste the run.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--output-dir {out} is an existing file: give a directory (it is created if "
                                 "missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise OSError(f"--output-dir {out} cannot be written to ({err}): give a directory you can write to") from None
    return out


def save_report(report: dict, out_dir: str | Path) -> list[Path]:
    """`write_report` into `out_dir`, or, if that fails at the end of a run, into a new temporary directory.

    A finished run's results are never lost: the fallback location is printed to stderr.
    """
    try:
        return write_report(report, out_dir)
    except OSError as err:
        fallback = Path(tempfile.mkdtemp(prefix="treespark-bench-"))
        print(f"treespark bench: could not write the results to {out_dir} ({err}); writing them to {fallback} "
              "instead", file=sys.stderr)
        return write_report(report, fallback)

