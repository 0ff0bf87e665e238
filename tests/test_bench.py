"""The benchmark in smoke mode on the real offline target and the shipped drafter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_treespark.bench import batch as bench_batch
from hf_treespark.bench import methods as bench_methods
from hf_treespark.bench import report as bench_report
from hf_treespark.bench import run as bench
from hf_treespark.bench import suites as bench_suites
from hf_treespark.cli import commands as cli
from hf_treespark.drafter.modeling import TreeSparkDrafter
from hf_treespark.hub import assets

pytestmark = pytest.mark.slow
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_smoke_run_covers_every_suite_and_method_and_checks_exactness(tmp_path):
    shipped = str(assets.DEFAULT_DRAFTER_DIR)
    out = tmp_path / "bench"
    rc = bench.main(["--smoke", "--dtype", "fp32", "--output-dir", str(out), "--drafter", f"dspark={shipped}",
                     "--drafter", f"dspark_tree={shipped}", "--drafter", f"baseline={shipped}"])
    assert rc == 0
    report = json.loads((out / "results.json").read_text())
    assert report["config"]["dtype"] == "float32" and report["config"]["tree_budget"] == 8
    rows = {(r["suite"], r["method"]): r for r in report["results"]}
    methods = bench_methods.DEFAULT_METHODS + ("baseline_chain", "baseline_datastore")  # all but the opt-in A/Bs
    assert set(bench_methods.METHODS) - set(methods) == {"treespark_unguarded", "treespark_priced",
                                                         "treespark_no_datastore", "treespark_no_lookup"}
    assert set(rows) == {(s, m) for s in bench_suites.SUITES for m in methods}
    for (suite, method), row in rows.items():
        assert row["prompts"] == 1 and row["exact"] == 1, (suite, method)
        assert 0 < row["new_tokens"] <= 8 and row["tokens_per_second"] > 0
        if method == "plain":
            assert row["acceptance_length"] is None and row["speedup"] == pytest.approx(1.0)
            assert row["target_forwards"] == row["new_tokens"]  # one forward per token
            continue
        assert row["acceptance_length"] >= 1.0
        # one prompt: its own acceptance length is the row's, and there is no spread yet
        assert row["prompt_acceptance"] == [pytest.approx(row["acceptance_length"])]
        assert row["acceptance_sd"] is None
        if bench_methods.METHODS[method].drafter is not None:
            # one target forward per round after the prefill, and the by-depth rates are monotone
            assert row["target_forwards"] - row["prompts"] == row["rounds"]
            rates = row["acceptance_by_depth"]
            assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    table = (out / "results.md").read_text()
    assert ("| suite | method | acceptance length | tokens/s | speedup vs plain | vs prompt lookup | exact | "
            "new tokens from lookup | new tokens from datastore | time in drafter passes | time in datastore lookups |"
            ) in table
    lookup_row = next(line for line in table.splitlines() if line.startswith("| HumanEval | prompt lookup |"))
    assert "| 1.00x |" in lookup_row  # each method against prompt lookup on its suite
    for (suite, method), row in rows.items():  # each drafter method's time in drafter passes and datastore lookups
        timed = bench_methods.METHODS[method].drafter is not None
        assert bool(row["phase_seconds"]) == timed, (suite, method)
        if timed:
            assert 0 < row["phase_seconds"]["verify"] < row["seconds"]
        if method == "treespark_datastore":  # the round pricer may leave the datastore out of every round
            assert row["phase_seconds"].get("datastore", 1.0) > 0
        if timed:  # every round by kind: counts, nodes and tokens add up to the row's
            kinds = row["round_kinds"]
            assert set(kinds) <= {"drafter", "lookup", "gated", "probe"}, (suite, method)
            if not bench_methods.METHODS[method].kwargs.get("tree_lookup"):  # with lookup, every round may be priced
                assert "drafter" in kinds, (suite, method)  # as the best lookup branch alone
            assert sum(k[0] for k in kinds.values()) == row["rounds"]
            assert sum(k[3] for k in kinds.values()) == row["new_tokens"] - 1  # the prefill commits the first
            assert 0 < sum(k[4] for k in kinds.values()) < row["seconds"]
        else:
            assert not row["round_kinds"]
        assert_shares_add_up(row, timed)
    assert "| suite | method | kind | share of rounds | nodes / round | accepted / node | tokens / round |" in table
    assert any(f"| HumanEval | TreeSpark + lookup + datastore | {kind} |" in table  # priced: maybe lookup rounds only
               for kind in ("drafter", "lookup"))
    # every pair of bench_report.PAIRS whose methods ran did so on every suite, so each appears in the paired table
    ran = [p for p in bench_report.PAIRS if set(p) <= set(methods)]
    assert len(ran) == len(bench_report.PAIRS) - 4  # not the four opt-in A/Bs
    assert len(report["paired_differences"]) == len(ran) * len(bench_suites.SUITES)
    assert "Paired per-prompt differences" in table
    shares = assert_sources_table_adds_up(table, rows)
    assert set(shares) == {(s, METHOD_LABELS[m]) for s, m in rows if bench_methods.METHODS[m].drafter is not None}
    assert table.count("| HumanEval |") >= len(methods)
    for name in ("acceptance_length.png", "acceptance_by_depth.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


METHOD_LABELS = {name: method.label for name, method in bench_methods.METHODS.items()}


def assert_shares_add_up(row: dict, timed: bool) -> None:
    """A drafter method's `token_shares` add up to every token its rounds committed (the new tokens but the
    prefill's), and its `time_shares` to its decoding time; a method without a drafter has neither."""
    if not timed:
        assert row["token_shares"] is None and row["time_shares"] is None
        return
    assert row["round_tokens"] == row["new_tokens"] - row["prompts"]
    assert row["round_tokens"] == row["accepted_nodes"] + row["bonus_tokens"]
    # one a round, but where the call's last round was cut short (by `max_new_tokens`) inside its accepted path
    assert row["rounds"] - row["prompts"] <= row["bonus_tokens"] <= row["rounds"]
    tokens = row["token_shares"]
    assert set(tokens) == {"bonus", "lookup", "datastore", "drafter"} and min(tokens.values()) >= 0
    assert sum(tokens.values()) == pytest.approx(1.0)
    assert tokens["lookup"] == pytest.approx(row["lookup_accepted"] / row["round_tokens"])
    assert tokens["datastore"] == pytest.approx(row["datastore_accepted"] / row["round_tokens"])
    times = row["time_shares"]
    assert times["drafter"] > 0 and times["verify"] > 0 and times["rest"] > 0
    assert times["sources"] == {name: pytest.approx(spent / row["seconds"]) for name, spent
                                in row["phase_seconds"].items() if name not in bench_methods.LOOP_PHASES}
    if "datastore" in times["sources"]:
        assert bench_methods.METHODS[row["method"]].kwargs.get("tree_datastore")
    assert times["drafter"] + sum(times["sources"].values()) + times["verify"] + times["rest"] == pytest.approx(1.0)


def assert_sources_table_adds_up(table: str, rows: dict) -> dict:
    """The "where the tokens and the time come from" table of `results.md`: each row's token shares add up to 100%
    and its time shares too, within the rounding of their cells. Returns {(suite, label): cells}."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(bench_report.SOURCES_TITLE))
    head = [c.strip() for c in lines[start + 2].strip("|").split("|")]
    assert head[:8] == ["suite", "method", "round tokens", "bonus", "lookup only", "datastore only", "drafter",
                        "time: drafter pass + tree"]
    timed = {name for row in rows.values() for name in (row["time_shares"] or {}).get("sources", {})}
    assert head[8:] == [f"time: {name}" for name in sorted(timed, key=lambda n: n != "datastore")] + [
        "time: verify", "time: rest"]  # a column per source phase any row timed
    shares = {}
    for line in lines[start + 4:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        suite = next(s for s in bench_suites.ALL_SUITES if bench_suites.SUITE_LABELS[s] == cells[0])
        method = next(m for m, label in METHOD_LABELS.items() if label == cells[1])
        assert int(cells[2]) == rows[(suite, method)]["round_tokens"]
        percent = [float(c.rstrip("%")) if c != "–" else 0.0 for c in cells[3:]]
        assert sum(percent[:4]) == pytest.approx(100, abs=0.21)  # four cells, each within 0.05 of its share
        assert sum(percent[4:]) == pytest.approx(100, abs=0.05 * len(percent[4:]) + 0.01)
        shares[(suite, cells[1])] = cells
    return shares


def test_paired_differences_cancel_the_spread_the_methods_share():
    def row(method, per_prompt):
        return {"suite": "mtbench", "method": method, "label": bench_methods.METHODS[method].label,
                "prompt_acceptance": per_prompt,
                "acceptance_length": sum(per_prompt) / len(per_prompt) if per_prompt else None}

    # prompts differ a lot (1.2 ... 3.0), the tree gains 0.2 on every prompt but one (0.4)
    chain = [1.2, 2.0, 3.0, 1.5]
    tree = [1.4, 2.2, 3.2, 1.9]
    report = {"results": [row("dspark", chain), row("dspark_tree", tree), row("plain", [])]}
    (pair,) = bench_report.paired_differences(report)
    assert (pair["method"], pair["baseline"]) == ("dspark_tree", "dspark")
    assert pair["mean"] == pytest.approx(0.25)
    assert pair["sd"] == pytest.approx(0.1)  # stdev of [0.2, 0.2, 0.2, 0.4]
    assert pair["se"] == pytest.approx(0.05)
    assert pair["ratio"] == pytest.approx(sum(tree) / sum(chain))
    # a baseline measured on other prompts (another count) is not paired
    report["results"][0]["prompt_acceptance"] = chain[:3]
    assert bench_report.paired_differences(report) == []


def test_a_wrong_output_fails_the_run_after_writing_the_results(tmp_path, monkeypatch):
    real = bench._generate

    def corrupted(target, inputs, method, drafter, max_new_tokens, budget):
        sequences, rounds = real(target, inputs, method, drafter, max_new_tokens, budget)
        if method.name == "treespark":
            sequences = sequences.clone()
            sequences[0, -1] = (sequences[0, -1] + 1) % target.config.vocab_size
        return sequences, rounds

    monkeypatch.setattr(bench, "_generate", corrupted)
    out = tmp_path / "bench"
    rc = bench.main(["--smoke", "--suites", "mtbench", "--methods", "plain,treespark", "--dtype", "fp32",
                     "--output-dir", str(out)])
    assert rc == 1
    report = json.loads((out / "results.json").read_text())
    assert len(report["violations"]) == 1 and report["violations"][0].startswith("treespark on mtbench")
    row = next(r for r in report["results"] if r["method"] == "treespark")
    assert row["exact"] == 0


def test_the_priced_defaults_run_when_named_with_the_round_pricer_on(tmp_path, monkeypatch):
    assert "treespark_priced" not in bench_methods.DEFAULT_METHODS
    assert "treespark_priced" in bench_methods.TREE_METHODS  # the defaults' tree budget
    real = bench._generate
    gates = {}

    def spy(target, inputs, method, drafter, max_new_tokens, budget):
        gates.setdefault(method.name, set()).add(method.kwargs.get("tree_gate", "auto"))
        return real(target, inputs, method, drafter, max_new_tokens, budget)

    monkeypatch.setattr(bench, "_generate", spy)
    out = tmp_path / "bench"
    rc = bench.main(["--smoke", "--suites", "mtbench", "--methods", "plain,treespark_datastore,treespark_priced",
                     "--dtype", "fp32", "--output-dir", str(out)])
    assert rc == 0
    # every call of the method (its warm-up's too) passes tree_gate="price"; the defaults leave it "auto"
    assert gates == {"plain": {"auto"}, "treespark_datastore": {"auto"}, "treespark_priced": {"price"}}
    priced = bench_methods.METHODS["treespark_priced"]
    assert priced.kwargs == {**bench_methods.METHODS["treespark_datastore"].kwargs, "tree_gate": "price"}
    report = json.loads((out / "results.json").read_text())
    rows = {(r["suite"], r["method"]): r for r in report["results"]}
    assert set(rows) == {("mtbench", m) for m in ("plain", "treespark_datastore", "treespark_priced")}
    row = rows[("mtbench", "treespark_priced")]
    assert row["label"] == "TreeSpark + lookup + datastore, priced rounds" and row["exact"] == 1
    assert_shares_add_up(row, timed=True)
    defaults = rows[("mtbench", "treespark_datastore")]
    if "drafter" in defaults["round_kinds"]:  # the defaults' drafter rounds ask the datastore
        assert defaults["time_shares"]["sources"]["datastore"] > 0
    (pair,) = report["paired_differences"]  # the A/B of round pricing
    assert (pair["method"], pair["baseline"]) == ("treespark_datastore", "treespark_priced")
    table = (out / "results.md").read_text()
    assert set(assert_sources_table_adds_up(table, rows)) == {
        ("mtbench", METHOD_LABELS[m]) for m in ("treespark_datastore", "treespark_priced")}


def test_bad_arguments_are_refused_by_name(capsys):
    assert cli.main(["bench", "--suites", "mtbench,nosuch"]) == 2
    assert "unknown suite 'nosuch'" in capsys.readouterr().err
    assert cli.main(["bench", "--drafter", "foo"]) == 2
    assert "ROLE=PATH" in capsys.readouterr().err


def test_calibrate_writes_an_acceptance_profile_the_drafter_loads(tmp_path):
    drafter_dir = tmp_path / "drafter"
    shutil.copytree(assets.DEFAULT_DRAFTER_DIR, drafter_dir)
    rc = cli.main(["calibrate", "--drafter", str(drafter_dir), "--num-prompts", "1", "--max-new-tokens", "8",
                   "--budgets", "2,8", "--suite", "mtbench"])
    assert rc == 0
    drafter = TreeSparkDrafter.from_pretrained(drafter_dir, dtype=torch.float32)
    profile = drafter.config.acceptance_profile
    assert set(profile) == {"2", "8"} and all(t >= 1.0 for t in profile.values())


def test_profile_reports_every_phase_in_plain_steps(tmp_path, capsys, monkeypatch, recwarn):
    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path / "cache"))
    rc = bench.main(["--profile", "--smoke", "--suites", "mtbench", "--dtype", "fp32", "--output-dir", str(tmp_path)])
    assert rc == 0
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert [row["budget"] for row in profile["budgets"]] == ["auto", "4", "8", "16"]
    assert profile["plain_step_ms"] > 0
    for row in profile["budgets"]:
        assert row["rounds"] > 0 and all(row["ms"][p] > 0 for p in ("draft", "tree", "verify", "walk", "commit"))
        assert sum(row["ms"].values()) == pytest.approx(row["round_ms"])
        assert row["round_in_plain_steps"] == pytest.approx(row["round_ms"] / profile["plain_step_ms"])
    # first use measured this machine once: stored, or (on a busy machine) said why not
    assert (tmp_path / "cache" / "round_latency.json").is_file() or any(
        "not stored" in str(w.message) for w in recwarn)
    assert "round / plain step" in capsys.readouterr().out


def test_profile_of_batches_counts_rounds_and_acceptance_per_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path / "cache"))
    rc = bench.main(["--profile", "--batch-size", "2", "--num-prompts", "2", "--max-new-tokens", "8", "--suites",
                     "mtbench", "--dtype", "fp32", "--output-dir", str(tmp_path)])
    assert rc == 0
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["rows"] == 2 and profile["prompts"] == 2
    for row in profile["budgets"]:
        assert row["rounds"] > 0 and row["ms"]["verify"] > 0
        assert 1.0 <= row["acceptance_length"] <= 1 + row["N"]  # per row, per round
    assert "batches of 2 rows" in (tmp_path / "profile.md").read_text()
    assert cli.main(["bench", "--profile", "--batch-size", "1,2", "--output-dir", str(tmp_path / "two")]) == 2
    assert "--profile profiles one batch size" in capsys.readouterr().err


def test_each_method_keeps_one_colour_whichever_methods_a_plot_shows():
    every = bench_report.method_colours(bench_methods.METHODS)
    assert len(set(every.values())) == len(bench_methods.METHODS)  # no two methods share a colour
    tree_only = bench_report.method_colours(["treespark", "dspark_tree"])  # the by-depth plot has no plain greedy
    assert tree_only == {"treespark": every["treespark"], "dspark_tree": every["dspark_tree"]}
    assert bench_report.method_colours(["mine", "treespark"])["treespark"] == every["treespark"]


def test_both_plots_draw_a_method_in_the_same_colour(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    rows = [{"suite": "mtbench", "method": m, "label": bench_methods.METHODS[m].label, "acceptance_length": 1.0 + i / 4,
             "acceptance_by_depth": [] if m in ("plain", "prompt_lookup") else [0.6, 0.3, 0.1]}
            for i, m in enumerate(bench_methods.METHODS)]
    report = {"results": rows, "config": {"dtype": "fp32", "tree_budget": 8}}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figures to inspect their artists
    bench_report.plot_report(report, tmp_path)
    bars, depth = figures
    bar_colours = {c.get_label(): to_hex(c.patches[0].get_facecolor()) for c in bars.axes[0].containers}
    line_colours = {line.get_label(): to_hex(line.get_color()) for line in depth.axes[0].get_lines()}
    assert set(line_colours) == {r["label"] for r in rows if r["acceptance_by_depth"]}  # no plain, no lookup
    assert all(line_colours[label] == bar_colours[label] for label in line_colours)


def test_batch_rows_are_compared_at_one_width_so_padding_alone_is_no_divergence():
    from conftest import make_target

    from hf_treespark.core.exactness import check_greedy_equivalence

    target = make_target("llama", dtype=torch.bfloat16)
    pad = 0
    prompt = torch.tensor([[5, 9, 14]])
    plain = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=6,
                            pad_token_id=pad, eos_token_id=None)
    # the same row in a batch made two tokens wider by another row: only padding differs
    wider = torch.cat([plain, torch.full((1, 2), pad)], dim=1)
    assert not check_greedy_equivalence(target, plain, wider).ok  # as the tensors stand, a "divergence"
    reference, candidate = bench_batch.same_width(plain, wider, pad)
    assert reference.shape == candidate.shape
    assert check_greedy_equivalence(target, reference, candidate).ok
    # a row that goes on where the other one's batch has padding is still checked at that token (bf16: the
    # near-tie rule; the target's choice there is no near-tie against the padding token)
    went_on = plain.clone()
    ended = plain.clone()
    ended[0, -2:] = pad
    reference, candidate = bench_batch.same_width(ended[:, :-1], went_on, pad)
    report = check_greedy_equivalence(target, reference, candidate)
    assert report.position == plain.shape[1] - 2 and not report.ok
