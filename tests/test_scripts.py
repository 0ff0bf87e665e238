"""The repository's scripts refuse bad input with one line on stderr and a non-zero exit, before any model loads.

Each case runs the script as a user would (`python scripts/X.py ...` from the repository root) and reads its exit
code and stderr. Most refusals come from the command line alone and take a fraction of a second; the cases that read
a file's contents import the package first (a few seconds) and still stop before a model is loaded. No case here is
ever given input that would run a script to its end, except `replay_trees.py analyse`, which loads no model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TREE = {"tokens": [5, 6, 7, 8], "parents": [-1, 0, 1, 0], "depths": [0, 1, 2, 1], "scores": [0.0, -0.1, -0.5, -1.0],
        "lookup": [False] * 4, "retrieved": [False] * 4}
TREES = "".join(json.dumps({"suite": "mtbench", "rounds": [{"tree": TREE, "path": path}]}) + "\n"
                for path in ([1, 2], [3]))  # two prompts: each half of the replay has one
LATENCY = {"cpu|fp32|treespark": {"verify": {"0": 0.05, "2": 0.055, "4": 0.06}, "draft": {"2": 0.01, "4": 0.01}}}
REFERENCE = json.dumps({"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}) + "\n"


def run_script(tmp_path: Path, script: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_TREESPARK_CACHE": str(tmp_path / "cache")}  # never the user's latency cache
    return subprocess.run([sys.executable, f"scripts/{script}", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_refused(done: subprocess.CompletedProcess, *fragments: str) -> None:
    """A non-zero exit whose last stderr line names every fragment, and no traceback."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, done.stderr


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def drafter_like(tmp_path: Path) -> Path:
    """A directory that passes the command-line check of a drafter directory (its config names a TreeSpark
    drafter), but holds no weights: whatever else a case gets wrong is refused first, and nothing can load."""
    write(tmp_path / "drafter" / "config.json", json.dumps({"model_type": "treespark"}))
    return tmp_path / "drafter"


def test_the_scripts_argument_types_are_the_packages_and_load_without_torch():
    """`scripts/script_args.py` hands the scripts `hf_treespark/arg_types.py`'s types, read without `import
    hf_treespark` (torch and transformers): a script refuses a bad option before anything heavy loads."""
    check = ("import sys; sys.path.insert(0, 'scripts'); import script_args; "
             "assert 'torch' not in sys.modules and 'hf_treespark' not in sys.modules, sorted(sys.modules); "
             "from pathlib import Path; "
             "assert Path(script_args.at_least.__code__.co_filename).resolve() "
             "== Path('hf_treespark/arg_types.py').resolve()")
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("case", ["missing", "no config", "garbage config", "other model", "budget 0",
                                  "budget word", "lookup -1", "missing table"])
def test_ship_drafter_refuses_bad_arguments_before_loading_anything(tmp_path, case):
    drafter = drafter_like(tmp_path)
    args, expected = {
        "missing": ([tmp_path / "nothing"], ["argument drafter", "no such directory"]),
        "no config": ([tmp_path], ["argument drafter", "config.json"]),
        "garbage config": ([write(tmp_path / "d" / "config.json", "{oops").parent], ["config.json", "not JSON"]),
        "other model": ([write(tmp_path / "llama" / "config.json", '{"model_type": "llama"}').parent],
                        ["'llama'", "not a TreeSpark drafter"]),
        "budget 0": ([drafter, "--budget", "0"], ["--budget", "'auto' or a whole number >= 1"]),
        "budget word": ([drafter, "--budget", "many"], ["--budget", "'many'"]),
        "lookup -1": ([drafter, "--lookup", "-1"], ["--lookup", ">= 0"]),
        "missing table": ([drafter, "--table", tmp_path / "table.md"], ["--table", "no such file"]),
    }[case]
    assert_refused(run_script(tmp_path, "ship_drafter.py", *args), *expected)


def test_ship_drafter_names_a_drafter_directory_whose_weights_do_not_load(tmp_path):
    from conftest import make_drafter, make_target

    drafter = tmp_path / "drafter"
    make_drafter(make_target()).config.save_pretrained(drafter)
    write(drafter / "model.safetensors", b"not safetensors")
    done = run_script(tmp_path, "ship_drafter.py", drafter)
    assert_refused(done, f"{drafter} does not load as a TreeSpark drafter")


@pytest.mark.parametrize("case", ["missing", "empty", "no rounds", "not json", "no rounds field", "no parents",
                                  "path outside", "plain-ms 0", "threshold nan"])
def test_replay_analyse_refuses_a_missing_damaged_or_empty_file(tmp_path, case):
    trees = tmp_path / "trees.jsonl"
    tree = {k: v for k, v in TREE.items() if k != "parents"}
    contents, options, expected = {
        "missing": (None, [], ["argument trees", "no such file"]),
        "empty": ("", [], [str(trees), "holds no rounds", "record"]),
        "no rounds": ('{"suite": "mtbench", "rounds": []}\n', [], [str(trees), "holds no rounds"]),
        "not json": ("hello\n", [], [f"{trees}:1:", "not a JSON line"]),
        "no rounds field": ('{"suite": "mtbench"}\n', [], [f"{trees}:1:", "'rounds'"]),
        "no parents": (json.dumps({"suite": "x", "rounds": [{"tree": tree, "path": []}]}), [], [f"{trees}:1:",
                                                                                              "'parents'"]),
        "path outside": (json.dumps({"suite": "x", "rounds": [{"tree": TREE, "path": [9]}]}), [],
                         [f"{trees}:1:", "path"]),
        "plain-ms 0": (TREES, ["--plain-ms", "0"], ["--plain-ms", "> 0"]),
        "threshold nan": (TREES, ["--thresholds", "0.1", "nan"], ["--thresholds", "'nan'"]),
    }[case]
    if contents is not None:
        write(trees, contents)
    assert_refused(run_script(tmp_path, "replay_trees.py", "analyse", trees, *options), *expected)


def test_replay_analyse_needs_a_usable_latency_cache_and_replays_with_one(tmp_path):
    trees = write(tmp_path / "trees.jsonl", TREES)
    assert_refused(run_script(tmp_path, "replay_trees.py", "analyse", trees), "latency cache", "treespark calibrate")
    write(tmp_path / "cache" / "round_latency.json", json.dumps(LATENCY))
    assert_refused(run_script(tmp_path, "replay_trees.py", "analyse", trees, "--latency-key", "gpu"),
                   "--latency-key 'gpu'", "cpu|fp32|treespark")
    done = run_script(tmp_path, "replay_trees.py", "analyse", trees, "--min-count", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 rounds, 2 with a drafter pass")
    assert "| current, budget 2 | half 0 |" in done.stdout and "| current, budget 2 | half 1 |" in done.stdout


@pytest.mark.parametrize("case", ["budget 0", "missing folder", "folder"])
def test_replay_record_refuses_bad_arguments_before_loading_the_target(tmp_path, case):
    args, expected = {
        "budget 0": (["--budget", "0", "--output", tmp_path / "no" / "trees.jsonl"], ["--budget", ">= 1"]),
        "missing folder": (["--output", tmp_path / "no" / "trees.jsonl"], ["--output", "no such directory"]),
        "folder": (["--output", tmp_path], ["--output", "is a directory"]),
    }[case]
    assert_refused(run_script(tmp_path, "replay_trees.py", "record", *args), *expected)


@pytest.mark.parametrize("case", ["missing store", "missing heldout", "positions 1", "num-heldout 0"])
def test_calibrate_datastore_refuses_bad_arguments_before_reading(tmp_path, case):
    ref = write(tmp_path / "ref.jsonl", REFERENCE)
    args, expected = {
        "missing store": (["--store", ref, tmp_path / "x.jsonl", "--heldout", ref], ["--store", "no such file"]),
        "missing heldout": (["--store", ref, "--heldout", tmp_path / "x.jsonl"], ["--heldout", "no such file"]),
        "positions 1": (["--store", ref, "--heldout", ref, "--positions", "1"], ["--positions", ">= 2"]),
        "num-heldout 0": (["--store", ref, "--heldout", ref, "--num-heldout", "0"], ["--num-heldout", ">= 1"]),
    }[case]
    assert_refused(run_script(tmp_path, "calibrate_datastore.py", *args), *expected)


@pytest.mark.parametrize("case", ["garbage", "empty"])
def test_calibrate_datastore_names_a_garbage_or_empty_reference_file(tmp_path, case):
    ref = write(tmp_path / "ref.jsonl", REFERENCE)
    heldout = write(tmp_path / "heldout.jsonl", {"garbage": "hello\n", "empty": ""}[case])
    expected = {"garbage": [f"{heldout}:1:", "not a JSON line"], "empty": [str(heldout), "no reference sequences"]}
    assert_refused(run_script(tmp_path, "calibrate_datastore.py", "--store", ref, "--heldout", heldout),
                   *expected[case])


@pytest.mark.parametrize("case", ["missing baseline", "garbage drafter", "num-prompts 0", "max-new-tokens 0"])
def test_compare_drafters_refuses_bad_arguments_before_loading(tmp_path, case):
    missing = tmp_path / "nothing"
    args, expected = {
        "missing baseline": (["--baseline", missing], ["--baseline", "no such directory"]),
        "garbage drafter": (["--drafter", write(tmp_path / "d" / "config.json", "x").parent, "--baseline", missing],
                            ["--drafter", "not JSON"]),
        "num-prompts 0": (["--num-prompts", "0", "--baseline", missing], ["--num-prompts", ">= 1"]),
        "max-new-tokens 0": (["--max-new-tokens", "0", "--baseline", missing], ["--max-new-tokens", ">= 1"]),
    }[case]
    assert_refused(run_script(tmp_path, "compare_drafters.py", *args), *expected)


def test_compare_drafters_names_an_unknown_suite_before_loading(tmp_path):
    done = run_script(tmp_path, "compare_drafters.py", "--baseline", drafter_like(tmp_path), "--suites",
                      "mtbench,nope")
    assert_refused(done, "--suites", "'nope'", "mtbench, humaneval, sharegpt")


@pytest.mark.parametrize("case", ["missing", "incomplete"])
def test_diagnose_drafter_refuses_a_data_folder_without_its_files(tmp_path, case):
    data = {"missing": tmp_path / "nothing", "incomplete": tmp_path}[case]
    expected = {"missing": ["--data", "no such directory"], "incomplete": ["--data", "sharegpt_smollm2_regen.jsonl"]}
    assert_refused(run_script(tmp_path, "diagnose_drafter.py", "--data", data), *expected[case])


def test_diagnose_drafter_names_a_garbage_data_file_before_loading_the_target(tmp_path):
    bad = write(tmp_path / "sharegpt_smollm2_regen.jsonl", "hello\n")
    write(tmp_path / "sharegpt_smollm2_regen_part2.jsonl", REFERENCE)
    assert_refused(run_script(tmp_path, "diagnose_drafter.py", "--data", tmp_path), f"{bad}:1:", "not a JSON line")


@pytest.mark.parametrize("case", ["missing run", "run without positions", "seconds 0", "seconds nan"])
def test_depth1_probe_refuses_a_run_without_positions_before_loading(tmp_path, case):
    run = tmp_path / "run"
    run.mkdir()
    args, expected = {
        "missing run": (["--run", tmp_path / "nothing"], ["--run", "no such directory"]),
        "run without positions": (["--run", run], ["--run", "positions", "treespark train-depth1"]),
        "seconds 0": (["--seconds", "0", "--run", tmp_path / "nothing"], ["--seconds", "> 0"]),
        "seconds nan": (["--seconds", "nan", "--run", tmp_path / "nothing"], ["--seconds", "'nan'"]),
    }[case]
    assert_refused(run_script(tmp_path, "depth1_probe.py", *args), *expected)
    assert not (tmp_path / "nothing").exists() and not (run / "positions").exists()  # nothing created


@pytest.mark.parametrize("case", ["missing metrics", "output is a folder", "unknown format"])
def test_plot_runs_refuses_bad_arguments_before_plotting(tmp_path, case):
    metrics = write(tmp_path / "metrics.jsonl", json.dumps({"anchors_seen": 0, "dev_acceptance_length": 1.0,
                                                             "dev_depth_rates": [0.1]}) + "\n")
    args, expected = {
        "missing metrics": ([tmp_path / "x.png", f"a={tmp_path / 'nothing.jsonl'}"], ["nothing.jsonl", "no such file"]),
        "output is a folder": ([tmp_path, f"a={metrics}"], ["out_png", "is a directory"]),
        "unknown format": ([tmp_path / "x.xyz", f"a={metrics}"], ["out_png", "'xyz'", "png"]),
    }[case]
    assert_refused(run_script(tmp_path, "plot_runs.py", *args), *expected)


def test_plot_runs_names_a_metrics_file_with_wrong_fields(tmp_path):
    metrics = write(tmp_path / "metrics.jsonl", json.dumps({"anchors_seen": 0, "dev_acceptance_length": 1.0}) + "\n")
    done = run_script(tmp_path, "plot_runs.py", tmp_path / "x.png", f"a={metrics}")
    assert_refused(done, str(metrics), "'dev_depth_rates'")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("case", ["missing data", "steps 0", "cache is a file", "output is a file"])
def test_train_throughput_refuses_bad_arguments_before_loading(tmp_path, case):
    afile = write(tmp_path / "a_file", "x")
    args, expected = {
        "missing data": (["--data", tmp_path / "nothing.jsonl"], ["--data", "no such file"]),
        "steps 0": (["--steps", "0", "--data", tmp_path / "nothing.jsonl"], ["--steps", ">= 1"]),
        "cache is a file": (["--feature-cache", afile, "--data", tmp_path / "nothing.jsonl"],
                            ["--feature-cache", "is a file"]),
        "output is a file": (["--output-dir", afile, "--data", tmp_path / "nothing.jsonl"],
                             ["--output-dir", "is a file"]),
    }[case]
    assert_refused(run_script(tmp_path, "train_throughput.py", *args), *expected)


@pytest.mark.parametrize("case", ["garbage data", "too few sequences", "dtype"])
def test_train_throughput_checks_its_data_and_precision_before_loading_the_target(tmp_path, case):
    data = write(tmp_path / "ref.jsonl", REFERENCE)
    args, expected = {
        "garbage data": (["--data", write(tmp_path / "bad.jsonl", "hello\n")], ["bad.jsonl:1:", "not a JSON line"]),
        "too few sequences": (["--data", data], ["1 reference sequence", "--warmup", "--steps"]),
        "dtype": (["--data", data, "--dtype", "fp64"], ["--dtype", "'fp64'"]),
    }[case]
    assert_refused(run_script(tmp_path, "train_throughput.py", *args, "--output-dir", tmp_path / "out"), *expected)


@pytest.mark.parametrize("case", ["dtype", "repeated dtype", "no dtype", "prompts 0", "tokens 0", "mode"])
def test_compiled_plain_refuses_bad_arguments_before_loading(tmp_path, case):
    args, expected = {
        "dtype": (["--dtypes", "bf16,fp64"], ["--dtypes", "'bf16,fp64'"]),
        "repeated dtype": (["--dtypes", "fp32,fp32"], ["--dtypes", "each once"]),
        "no dtype": (["--dtypes", ","], ["--dtypes", "','"]),
        "prompts 0": (["--num-prompts", "0"], ["--num-prompts", ">= 1"]),
        "tokens 0": (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
        "mode": (["--compile-mode", "fast"], ["--compile-mode", "'fast'"]),
    }[case]
    assert_refused(run_script(tmp_path, "compiled_plain.py", *args), *expected)


@pytest.mark.parametrize("case", ["steps 0", "lr", "no own responses", "no dev positions"])
def test_distil_compare_sources_refuses_bad_arguments_before_loading(tmp_path, case):
    own, dev = write(tmp_path / "own.jsonl", REFERENCE), tmp_path / "dev"
    dev.mkdir()
    args, expected = {
        "steps 0": (["100", "0", "1e-3", own, dev], ["steps", ">= 1"]),
        "lr": (["100", "10", "5", own, dev], ["lr", "between 0 and 1"]),
        "no own responses": (["100", "10", "1e-3", tmp_path / "none.jsonl", dev], ["none.jsonl", "no such file"]),
        "no dev positions": (["100", "10", "1e-3", own, tmp_path / "nodev"], ["nodev", "no such file"]),
    }[case]
    assert_refused(run_script(tmp_path, "distil_compare_sources.py", *args), *expected)


def checkout_rows(label: str, spec_s: float) -> str:
    """Rows of `compare_checkouts.py run` for one checkout: two prompts, plain 10 tokens in 1 s, speculative 10 in
    `spec_s` s."""
    return "".join(json.dumps({"label": label, "suite": "copy", "prompt": i, "plain_s": 1.0, "plain_n": 10,
                               "spec_s": spec_s, "spec_n": 10, "plain": [1] * 10, "spec": [1] * 10}) + "\n"
                   for i in range(2))


def test_compare_checkouts_reports_each_checkout_and_their_ratio(tmp_path):
    results = write(tmp_path / "results.jsonl", checkout_rows("old", 0.5) + checkout_rows("new", 0.4))
    done = run_script(tmp_path, "compare_checkouts.py", "report", results)
    assert done.returncode == 0, done.stderr
    assert "| copy | old | 2 | 10.0 | 20.0 | 2.00x |" in done.stdout
    assert "| copy | new | 2 | 10.0 | 25.0 | 2.50x |" in done.stdout
    assert "| copy | 1.250 | 1.250 (0.000) |" in done.stdout


@pytest.mark.parametrize("case", ["missing", "garbage", "other rows", "unknown suite"])
def test_compare_checkouts_refuses_bad_input_before_loading(tmp_path, case):
    other = write(tmp_path / "other.jsonl", json.dumps({"label": "old", "suite": "copy"}) + "\n")
    garbage = write(tmp_path / "garbage.jsonl", "hello\n")
    prompts = write(tmp_path / "prompts.json", "{}")
    args, expected = {
        "missing": (["report", tmp_path / "nothing.jsonl"], ["results", "no such file"]),
        "garbage": (["report", garbage], [f"{garbage}:1:", "not a JSON object"]),
        "other rows": (["report", other], [f"{other}:1:", "missing prompt"]),
        "unknown suite": (["run", prompts, "nope", "old", tmp_path / "r.jsonl"], ["suite", "'nope'"]),
    }[case]
    assert_refused(run_script(tmp_path, "compare_checkouts.py", *args), *expected)


@pytest.mark.parametrize("start, stop", [(5, 3), (4, 4)])
def test_depth2_probe_refuses_a_start_not_below_its_stop_before_loading(tmp_path, start, stop):
    """`extract --start 5 --stop 3` used to exit 0 having extracted nothing."""
    data = write(tmp_path / "refs.jsonl", REFERENCE)  # never the shared data, even where the range is not refused
    done = run_script(tmp_path, "depth2_probe.py", "extract", tmp_path / "out", "--start", start, "--stop", stop,
                      "--data", data)
    assert done.returncode == 2, done.stderr
    assert_refused(done, f"--start {start}", f"--stop {stop}", "below")
    assert not (tmp_path / "out").exists()  # nothing created, nothing loaded
