"""`treespark bench` output handling, without running a benchmark: outputs checked first, results never lost."""

from __future__ import annotations

import importlib

import pytest

from hf_treespark.bench import report as bench_report
from hf_treespark.cli import commands as cli


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the benchmark gets as far as loading a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the output directory was checked")

    for name in ("hf_treespark.cli.commands", "hf_treespark.hub.loading"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for loader in ("load_target", "load_drafter"):
            if hasattr(module, loader):
                monkeypatch.setattr(module, loader, refuse)


def test_an_output_dir_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, no_model_loading):
    taken = tmp_path / "results.txt"
    taken.write_text("keep me")
    assert cli.main(["bench", "--smoke", "--output-dir", str(taken)]) == 2
    assert f"--output-dir {taken} is an existing file: give a directory" in capsys.readouterr().err
    assert taken.read_text() == "keep me"


def test_an_output_dir_under_a_file_is_refused_before_any_work(tmp_path, capsys, no_model_loading):
    (tmp_path / "file").write_text("")
    assert cli.main(["bench", "--smoke", "--output-dir", str(tmp_path / "file" / "bench")]) == 2
    assert "cannot be written to" in capsys.readouterr().err


def test_results_go_to_a_fallback_directory_when_the_output_dir_fails_at_the_end(tmp_path, capsys, monkeypatch):
    written = []

    def write_report(report, out_dir):
        if str(out_dir) == str(tmp_path / "gone"):
            raise PermissionError(13, "Permission denied", str(out_dir))
        written.append(out_dir)
        return [out_dir / "results.json"]

    monkeypatch.setattr(bench_report, "write_report", write_report)  # what save_report calls
    paths = bench_report.save_report({"results": []}, tmp_path / "gone")
    assert len(written) == 1 and written[0].name.startswith("treespark-bench-")
    assert paths == [written[0] / "results.json"]
    err = capsys.readouterr().err
    assert f"could not write the results to {tmp_path / 'gone'}" in err and f"writing them to {written[0]}" in err
    written[0].rmdir()


def test_the_priced_defaults_are_named_not_run_by_default(tmp_path, capsys, no_model_loading):
    from hf_treespark.bench import methods as bench_methods

    assert "treespark_priced" in bench_methods.OPT_IN_METHODS
    assert "treespark_priced" not in bench_methods.DEFAULT_METHODS
    taken = tmp_path / "results.txt"
    taken.write_text("")
    # the name passes the method check: the run gets as far as the output directory
    assert cli.main(["bench", "--methods", "plain,treespark_priced", "--output-dir", str(taken)]) == 2
    err = capsys.readouterr().err
    assert "is an existing file" in err and "unknown method" not in err
    assert cli.main(["bench", "--methods", "plain,treespark_nosuch", "--output-dir", str(taken)]) == 2
    assert "unknown method 'treespark_nosuch'" in capsys.readouterr().err


def test_token_and_time_shares_add_up_and_name_every_source():
    from dataclasses import asdict

    from hf_treespark.bench.methods import MethodResult
    from hf_treespark.decoding.generation_output import RoundRecord

    def record(kind, accepted, committed, lookup=0, datastore=0):
        return RoundRecord(tree_size=8, num_accepted=accepted, accepted_path=list(range(accepted)),
                           committed=list(range(committed)), lookup_accepted=lookup, datastore_accepted=datastore,
                           kind=kind, seconds=0.01)

    rounds = [record("drafter", 3, 4, lookup=1, datastore=1),  # 1 lookup, 1 datastore, 1 drafter node, the bonus
              record("lookup", 5, 6, lookup=5),
              record("drafter", 2, 2),  # cut by a stop inside its accepted path: no bonus
              RoundRecord.plain_step(7)]  # after a hand-off: the target's own token
    phases = {"draft": 0.10, "tree": 0.05, "datastore": 0.02, "echo": 0.03, "verify": 0.40, "walk": 0.05,
              "commit": 0.05, "round": 0.75}
    row = MethodResult("mtbench", "treespark_datastore", "TreeSpark + lookup + datastore",
                       rounds_reaching_depth=[0] * 4)
    row.add(14, 1.0, 5, rounds, phases)
    row.finish(plain_tps=10.0)
    assert row.round_tokens == 13 and row.bonus_tokens == 3 and row.accepted_nodes == 10
    assert row.token_shares == pytest.approx({"bonus": 3 / 13, "lookup": 6 / 13, "datastore": 1 / 13,
                                              "drafter": 3 / 13})
    times = dict(row.time_shares)
    assert times.pop("sources") == pytest.approx({"datastore": 0.02, "echo": 0.03})  # not walk, commit, round
    assert times == pytest.approx({"drafter": 0.15, "verify": 0.40, "rest": 0.40})
    plain = MethodResult("mtbench", "plain", "plain greedy")
    plain.add(14, 1.4, 14, None)
    plain.finish(None)
    assert plain.token_shares is None and plain.time_shares is None

    lines = bench_report._sources_table({"results": [asdict(plain), asdict(row)]})
    assert lines[1].startswith(bench_report.SOURCES_TITLE)
    assert lines[3] == ("| suite | method | round tokens | bonus | lookup only | datastore only | drafter "
                        "| time: drafter pass + tree | time: datastore | time: echo | time: verify | time: rest |")
    assert lines[5:] == ["| MT-Bench | TreeSpark + lookup + datastore | 13 | 23.1% | 46.2% | 7.7% | 23.1% | 15.0% "
                         "| 2.0% | 3.0% | 40.0% | 40.0% |"]
    # a report from before the shares were recorded has no such table
    old = {key: value for key, value in asdict(row).items() if key not in ("token_shares", "time_shares")}
    assert bench_report._sources_table({"results": [old]}) == []
