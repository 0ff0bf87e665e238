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
