"""Acceptance-length and throughput benchmark: `treespark bench` / `python -m hf_treespark.bench`.

For each suite (MT-Bench first turns, HumanEval, held-out ShareGPT) and each method (plain greedy
`generate`, transformers' prompt-lookup decoding, a DSpark drafter in chain mode, a DSpark-trained
drafter in tree mode, the TreeSpark drafter in chain and tree mode), greedy, batch 1:

- acceptance length: tokens committed per target forward after the prefill (SPEC section 3:
  accepted nodes + bonus per round; for prompt lookup, counted from the target's forward calls),
- acceptance rate by depth: fraction of rounds whose accepted path reached depth `d`,
- tokens/s and speedup over plain greedy, measured in the same run with the methods interleaved
  prompt by prompt,
- exactness: every speculative output is checked against plain greedy (strict in fp32, the
  near-tie rule in half precision); a violation fails the run after the results are written.

Writes `results.json`, `results.md`, `acceptance_length.png` and `acceptance_by_depth.png`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .cpu_gemm import model_is_packed
from .help_format import (  # noqa: F401  (batch_sizes_option: the --batch-size parser, imported from here too)
    CPU_PACK_CHOICES,
    CPU_PACK_HELP,
    DTYPE_CHOICES,
    batch_sizes,
    batch_sizes_option,
    cpu_pack_option,
    refuse_empty_values,
)
from .precision import resolve_dtype

SUITES = ("mtbench", "humaneval", "sharegpt")
SUITE_LABELS = {"mtbench": "MT-Bench", "humaneval": "HumanEval", "sharegpt": "ShareGPT (held-out)"}
PROMPT_LOOKUP_TOKENS = 10
LOOKUP_TOKENS = 7  # tokens per lookup branch for "TreeSpark + lookup" (the drafter's block size)


@dataclass(frozen=True)
class Method:
    """A decoding method: which drafter it uses (None: no drafter) and its generate kwargs."""

    name: str
    label: str
    drafter: str | None
    kwargs: dict = field(default_factory=dict)


METHODS = {
    m.name: m
    for m in (
        Method("plain", "plain greedy", None),
        Method("prompt_lookup", "prompt lookup", None, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
        Method("dspark", "DSpark (chain)", "dspark", {"tree_chain": True, "tree_lookup": 0, "tree_datastore": False}),
        Method("dspark_tree", "DSpark + Tree", "dspark_tree", {"tree_lookup": 0, "tree_datastore": False}),
        Method("treespark_chain", "TreeSpark drafter, chain", "treespark",
               {"tree_chain": True, "tree_lookup": 0, "tree_datastore": False}),
        Method("treespark", "TreeSpark", "treespark", {"tree_lookup": 0, "tree_datastore": False}),
        Method("treespark_lookup", "TreeSpark + lookup", "treespark",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": False}),
        Method("treespark_datastore", "TreeSpark + lookup + datastore", "treespark",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": True}),
        # another TreeSpark drafter (`--drafter baseline=PATH`, e.g. the one a new drafter replaces), side by side
        Method("baseline_chain", "baseline drafter, chain", "baseline",
               {"tree_chain": True, "tree_lookup": 0, "tree_datastore": False}),
        Method("baseline_datastore", "baseline drafter + lookup + datastore", "baseline",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": True}),
    )
}
ROLES = ("treespark", "dspark", "dspark_tree", "baseline")
# run by default (the baseline's methods join them when a baseline drafter is given)
DEFAULT_METHODS = tuple(m for m in METHODS if METHODS[m].drafter != "baseline")
# these share one tree budget
TREE_METHODS = ("dspark_tree", "treespark", "treespark_lookup", "treespark_datastore", "baseline_datastore")


class BenchmarkError(RuntimeError):
    """A speculative method's output differed from plain greedy decoding."""


@dataclass
class MethodResult:
    """Totals of one method on one suite."""

    suite: str
    method: str
    label: str
    prompts: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    committed_after_prefill: int = 0
    rounds_reaching_depth: list[int] = field(default_factory=list)
    rounds: int = 0
    lookup_accepted: int = 0  # accepted tokens that only a lookup branch had proposed
    datastore_accepted: int = 0  # accepted tokens that only the datastore had proposed
    exact: int = 0
    tokens_per_second: float | None = None
    speedup: float | None = None
    acceptance_length: float | None = None
    acceptance_by_depth: list[float] | None = None
    prompt_acceptance: list[float] = field(default_factory=list)  # each prompt's own acceptance length
    acceptance_sd: float | None = None  # standard deviation of `prompt_acceptance` (the prompt-to-prompt spread)

    def finish(self, plain_tps: float | None) -> None:
        self.tokens_per_second = self.new_tokens / self.seconds if self.seconds else None
        if plain_tps and self.tokens_per_second:
            self.speedup = self.tokens_per_second / plain_tps
        verify_forwards = self.target_forwards - self.prompts  # every prompt's prefill produces one token
        if self.method != "plain" and verify_forwards > 0:
            self.acceptance_length = self.committed_after_prefill / verify_forwards
        if self.rounds:
            self.acceptance_by_depth = [n / self.rounds for n in self.rounds_reaching_depth]
        if len(self.prompt_acceptance) >= 2:
            self.acceptance_sd = statistics.stdev(self.prompt_acceptance)


def select_prompts(suite: str, count: int) -> list[str]:
    """`count` prompts spread evenly over the suite (MT-Bench and HumanEval are grouped by category)."""
    from . import assets

    if suite == "mtbench":
        pool = assets.mtbench_prompts()
    elif suite == "humaneval":
        pool = [f"Complete this Python function.\n\n```python\n{p}```" for p in assets.humaneval_prompts()]
    elif suite == "sharegpt":
        pool = assets.sharegpt_prompts("heldout", limit=max(4 * count, 64))
    else:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    if count >= len(pool):
        return pool
    return [pool[i * len(pool) // count] for i in range(count)]


class ForwardCounter:
    """Counts the target's forward calls (one per prefill, verify round, or plain decoding step)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

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


def run_benchmark(target, tokenizer, drafters: dict, suites=SUITES, methods=None, num_prompts: int = 10,
                  max_new_tokens: int = 128, budget: int | str = "auto", max_prompt_tokens: int = 512,
                  progress: bool = True) -> dict:
    """Run every method on every suite; returns the report (see `write_report`).

    drafters: `{"dspark": drafter, "dspark_tree": drafter, "treespark": drafter, "baseline": drafter}` (any
    of them); methods whose drafter is missing are skipped and listed under `skipped`. `methods` None:
    `DEFAULT_METHODS`, and the baseline's with a baseline drafter.
    Raises `BenchmarkError` (after building the report, attached as `.report`) on any output that
    is not plain greedy's.
    """
    from tqdm.auto import tqdm

    from . import assets
    from .exactness import check_greedy_equivalence

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
    warm = assets.chat_inputs(tokenizer, "Say hello.")
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
        encoded = (assets.chat_inputs(tokenizer, p) for p in select_prompts(suite, 4 * num_prompts))
        prompts = [inputs for inputs in encoded if inputs["input_ids"].shape[1] <= max_prompt_tokens][:num_prompts]
        rows = {m.name: MethodResult(suite, m.name, m.label, rounds_reaching_depth=[0] * depth) for m in runnable}
        for index, inputs in enumerate(tqdm(prompts, desc=f"bench {SUITE_LABELS[suite]}", disable=not progress)):
            prompt_len = inputs["input_ids"].shape[1]
            reference = None
            for method in runnable:
                drafter = drafters.get(method.drafter)
                counter = ForwardCounter(target)
                start = time.perf_counter()
                try:
                    sequences, rounds = _generate(target, inputs, method, drafter, max_new_tokens, fixed_budget)
                finally:
                    seconds = time.perf_counter() - start
                    counter.close()
                row = rows[method.name]
                new = sequences.shape[1] - prompt_len
                row.prompts += 1
                row.new_tokens += new
                row.seconds += seconds
                row.target_forwards += counter.count
                row.committed_after_prefill += new - 1
                if method.name != "plain" and counter.count > 1:
                    row.prompt_acceptance.append((new - 1) / (counter.count - 1))
                if rounds is not None:
                    row.rounds += len(rounds)
                    row.lookup_accepted += sum(r.lookup_accepted for r in rounds)
                    row.datastore_accepted += sum(r.datastore_accepted for r in rounds)
                    for r in rounds:
                        for d in range(min(r.num_accepted, depth)):
                            row.rounds_reaching_depth[d] += 1
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


# (method, baseline) pairs whose per-prompt acceptance lengths are compared in the report
PAIRS = (("dspark_tree", "dspark"), ("treespark", "dspark_tree"), ("treespark", "treespark_chain"),
         ("treespark_lookup", "treespark"), ("treespark_datastore", "treespark_lookup"),
         ("treespark_chain", "baseline_chain"), ("treespark_datastore", "baseline_datastore"))


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


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


SHARE_COLUMNS = {"lookup_accepted": ("treespark_lookup", "treespark_datastore"),
                 "datastore_accepted": ("treespark_datastore",)}  # the methods that can have such tokens


def _share(row: dict, key: str) -> str:
    """The share of a method's new tokens that only lookup (`lookup_accepted`) or only the datastore proposed."""
    if row["method"] not in SHARE_COLUMNS[key] or not row["new_tokens"]:
        return "–"
    return f"{100 * row.get(key, 0) / row['new_tokens']:.1f}%"


def markdown_table(report: dict) -> str:
    """The report as markdown: one row per suite and method, then acceptance by depth."""
    cfg = report["config"]
    lines = [
        f"Target {cfg['target']}, {cfg['dtype']} on {cfg['device']} ({cfg['machine']}"
        f"{', packed oneDNN linears' if cfg.get('cpu_pack') else ''}), greedy, batch 1, "
        f"{cfg['num_prompts']} prompts per suite, {cfg['max_new_tokens']} new tokens; tree budget "
        f"{cfg['tree_budget']} (requested {cfg['requested_budget']}); torch {cfg['torch']}, "
        f"transformers {cfg['transformers']}.",
        "",
        "| suite | method | acceptance length | tokens/s | speedup vs plain | exact | new tokens from lookup "
        "| new tokens from datastore | SD over prompts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | {_fmt(row['acceptance_length'])} | "
                     f"{_fmt(row['tokens_per_second'], '.1f')} | {_fmt(row['speedup'])}x | "
                     f"{row['exact']}/{row['prompts']} | {_share(row, 'lookup_accepted')} | "
                     f"{_share(row, 'datastore_accepted')} | {_fmt(row.get('acceptance_sd'))} |")
    pairs = paired_differences(report)
    if pairs:
        lines += ["", "Paired per-prompt differences in acceptance length (same prompts; SE = SD / sqrt(n)):", "",
                  "| suite | method | baseline | ratio | mean difference | SD of differences | SE |",
                  "|---|---|---|---|---|---|---|"]
        for pair in pairs:
            lines.append(f"| {SUITE_LABELS[pair['suite']]} | {pair['label']} | {pair['baseline_label']} | "
                         f"{pair['ratio']:.2f}x | {pair['mean']:+.3f} | {_fmt(pair['sd'], '.3f')} | "
                         f"{_fmt(pair['se'], '.3f')} |")
    depth_rows = [r for r in report["results"] if r["acceptance_by_depth"]]
    if depth_rows:
        depth = max(len(r["acceptance_by_depth"]) for r in depth_rows)
        lines += ["", "Acceptance rate by depth (fraction of rounds whose accepted path reached depth d):", "",
                  "| suite | method | " + " | ".join(f"d={d}" for d in range(1, depth + 1)) + " |",
                  "|---|---|" + "---|" * depth]
        for row in depth_rows:
            rates = " | ".join(f"{100 * x:.1f}%" for x in row["acceptance_by_depth"])
            lines.append(f"| {SUITE_LABELS[row['suite']]} | {row['label']} | {rates} |")
    if report["config"]["skipped"]:
        lines += ["", f"Skipped (no drafter given): {', '.join(report['config']['skipped'])}."]
    return "\n".join(lines) + "\n"


# matplotlib's "tab10" colours: one per method, the same in every plot.
PLOT_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf")


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


PROFILE_BUDGETS = (4, 8, 16)
PROFILE_PHASES = ("draft", "tree", "datastore", "verify", "walk", "commit")


def _timed_generate(target, inputs: dict, **kwargs):
    start = time.perf_counter()
    out = target.generate(**inputs, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def profile_rounds(target, drafter, prompts: list[dict], budgets=PROFILE_BUDGETS, max_new_tokens: int = 64,
                   progress: bool = True) -> dict:
    """What a round costs, phase by phase, against one plain decoding step, measured in one run.

    For each prompt (interleaved): plain greedy `generate` for 1 and for `max_new_tokens` tokens, whose
    difference per token is the plain step; then TreeSpark `generate` at each budget (`"auto"` is
    resolved first) with an `engine.PhaseTimer`. Returns `{"plain_step_ms", "budgets": [...]}` with, per
    budget, milliseconds per round of each phase (`other` = the rest of the loop), the round's cost in
    plain steps, the acceptance length and the speedup they imply (acceptance / round cost).
    """
    from tqdm.auto import tqdm

    from .engine import PhaseTimer

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
                                        tree_budget=n, tree_timer=timers[label], return_dict_in_generate=True)
            committed[label] += sum(len(r.committed) for r in result.rounds)
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
    return {"plain_step_ms": plain_ms, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "budgets": rows}


def profile_table(profile: dict) -> str:
    """The round-cost table in markdown."""
    head = ("| budget | " + " | ".join(f"{p} ms" for p in (*PROFILE_PHASES, "other"))
            + " | round ms | round / plain step | acceptance length | implied speedup |")
    lines = [f"Plain decoding step: {profile['plain_step_ms']:.1f} ms ({profile['prompts']} prompts, "
             f"{profile['max_new_tokens']} new tokens).", "", head, "|" + "---|" * (head.count("|") - 1)]
    for row in profile["budgets"]:
        label = f"auto (N={row['N']})" if row["budget"] == "auto" else f"N={row['N']}"
        cells = [f"{row['ms'][p]:.1f}" for p in (*PROFILE_PHASES, "other")]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {row['round_ms']:.1f} | "
                     f"{row['round_in_plain_steps']:.2f} | {row['acceptance_length']:.2f} | "
                     f"{row['implied_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


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


def batch_inputs(tokenizer, prompts: list[str]) -> dict:
    """A left-padded batch of chat-formatted prompts (`input_ids`, `attention_mask`), as a batched pipeline makes."""
    from . import assets
    from .batch import left_padded

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
                        max_prompt_tokens: int = 512, progress: bool = True) -> dict:
    """Tokens per second of all rows, TreeSpark (the drafter's defaults) against plain batched `generate`, greedy,
    for each suite and batch size `B`: the suite's first `B x (num_prompts // B)` prompts (at least one batch) in
    left-padded batches of `B`, the two methods interleaved batch by batch (which runs first alternates, so a drift
    of the machine's speed falls on both); every TreeSpark batch is checked
    against plain (strict in float32, the near-tie rule in half precision). Raises `BenchmarkError` (with the
    report) after an inexact batch."""
    from tqdm.auto import tqdm

    from . import assets
    from .exactness import check_greedy_equivalence
    from .precision import dtype_name

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, failures = [], []
    for suite in suites:
        candidates = [p for p in select_prompts(suite, 4 * num_prompts)
                      if assets.chat_inputs(tokenizer, p)["input_ids"].shape[1] <= max_prompt_tokens][:num_prompts]
        for size in batch_sizes:
            count = max(1, len(candidates) // size) * size
            prompts = [candidates[i % len(candidates)] for i in range(count)]
            batches = [batch_inputs(tokenizer, prompts[i:i + size]) for i in range(0, count, size)]
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
                     f"{_fmt(row['acceptance_length'])} | "
                     f"{', '.join(str(b) if b else '0 (plain)' for b in row['budgets'])} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, from {', '.join(SUITES)}")
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
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bf16 where the device computes it natively, else fp32")
    parser.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)
    parser.add_argument("--output-dir", default="bench_results")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the comparison: what each phase of a TreeSpark round costs, in ms and in "
                             "plain decoding steps, for the chosen auto budget and N = 4, 8, 16 (profile.md/json)")
    parser.add_argument("--batch-size", metavar="B[,B...]", type=batch_sizes,
                        help="instead of the comparison: tokens/s of all rows, TreeSpark against plain batched "
                             "generate, for these batch sizes (1-256, e.g. 1,2,4,8,16; batch.md/json); suites as "
                             "--suites")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check: 1 prompt per suite, 8 new tokens, budget 8 unless given")


def run_from_args(args: argparse.Namespace) -> int:
    from . import assets
    from .loading import load_drafter, load_target

    dtype = resolve_dtype(args.dtype)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    baseline = any(item.partition("=")[0] == "baseline" for item in args.drafter)
    default = DEFAULT_METHODS + (("baseline_chain", "baseline_datastore") if baseline else ())
    methods = [m.strip() for m in (args.methods if args.methods is not None else ",".join(default)).split(",")
               if m.strip()]
    for name, values, known in (("suite", suites, SUITES), ("method", methods, METHODS)):
        if not values:  # `--suites ,`: never a way to ask for the default
            raise ValueError(f"--{name}s {getattr(args, name + 's')!r}: no {name} named; choose from "
                             f"{', '.join(known)} (comma-separated)")
        for value in values:
            if value not in known:
                raise ValueError(f"unknown {name} {value!r}; choose from {', '.join(known)}")
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
    target, tokenizer = load_target(args.target, dtype, cpu_pack=pack)
    drafters, loaded = {}, {}
    for role in ROLES:
        path = paths.get(role)
        if path is None and role == "treespark" and not args.target:
            path = ""  # the shipped default drafter
        if path is None:
            continue
        if path not in loaded:
            loaded[path] = load_drafter(path, dtype, cpu_pack=pack)
        drafters[role] = loaded[path]

    if args.profile:
        return _run_profile(args, target, tokenizer, drafters, suites)
    from .budget import ensure_latency

    if args.batch_size:
        return _run_batches(args, target, tokenizer, drafters, suites, budget)

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


def _run_batches(args, target, tokenizer, drafters: dict, suites: list[str], budget) -> int:
    from .budget import ensure_batch_latency, ensure_latency

    sizes = list(args.batch_size)  # parsed and bounded by `help_format.batch_sizes`
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


def _run_profile(args, target, tokenizer, drafters: dict, suites: list[str]) -> int:
    from . import assets
    from .budget import ensure_latency
    from .precision import dtype_name

    if "treespark" not in drafters:
        raise ValueError("--profile needs the TreeSpark drafter (--drafter treespark=PATH with --target)")
    drafter = drafters["treespark"]
    ensure_latency(target, drafter)
    prompts = []
    for suite in suites:
        encoded = (assets.chat_inputs(tokenizer, p) for p in select_prompts(suite, 4 * args.num_prompts))
        prompts += [inputs for inputs in encoded if inputs["input_ids"].shape[1] <= 512][: args.num_prompts]
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


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_treespark.bench`: the same as `treespark bench`, with its one-line errors."""
    from .help_format import DefaultsHelpFormatter, run_script

    parser = argparse.ArgumentParser(prog="treespark bench", description=__doc__.split("\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    return run_script(parser, lambda args: refuse_empty_values(parser, args) or run_from_args(args), argv)


if __name__ == "__main__":
    sys.exit(main())
