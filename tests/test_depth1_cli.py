"""`treespark train-depth1` end to end on a tiny target and drafter saved to disk: positions keyed to their data,
option values refused at parsing, damaged or empty inputs named, and runs killed or interrupted that resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark.cli import commands as cli
from hf_treespark.training import cli as training_cli
from hf_treespark.training.data import load_references

REPO = Path(__file__).resolve().parents[1]


def write_references(path: Path, count: int, seed: int, response: int = 20) -> Path:
    """`count` references of repeated 4-token motifs (the head can learn them), as `prompt_ids`/`response_ids`."""
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(count):
        prompt = torch.randint(4, 128, (4 + i % 3,), generator=gen).tolist()
        motif = torch.randint(4, 128, (4,), generator=gen).tolist()
        lines.append(json.dumps({"id": f"s{seed}-{i}", "prompt_ids": prompt,
                                 "response_ids": (motif * response)[:response]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A saved tiny Llama target and drafter, two training files of other data and a development file."""
    root = tmp_path_factory.mktemp("depth1")
    target = make_target("llama")
    target.save_pretrained(root / "target")
    make_drafter(target).save_pretrained(root / "drafter")
    return {"target": root / "target", "drafter": root / "drafter", "a": write_references(root / "a.jsonl", 6, 1),
            "b": write_references(root / "b.jsonl", 5, 2), "dev": write_references(root / "dev.jsonl", 2, 3)}


def argv(files, out: Path, data: str = "a", *extra: str) -> list[str]:
    return ["train-depth1", "--target", str(files["target"]), "--drafter", str(files["drafter"]),
            "--data", str(files[data]), "--dev-data", str(files["dev"]), "--width", "16", "--batch-size", "16",
            "--epochs", "2", "--eval-every", "5", "--output-dir", str(out), *extra]


def positions_of(path: Path) -> int:
    return sum(len(r.input_ids) - 1 - r.prompt_len for r in load_references(path, max_length=384))


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_rerun_on_other_data_is_refused_and_nothing_of_the_first_run_changes(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(argv(files, out, "a")) == 0
    assert f"{positions_of(files['a'])} positions from 6 references" in capsys.readouterr().out
    before = snapshot(out)
    assert cli.main(argv(files, out, "b")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "other data" in err and "a.jsonl" in err and "b.jsonl" in err and "--output-dir" in err
    assert str(out / "positions") in err and str(out / "checkpoint.pt") in err  # what to delete to train on b here
    assert snapshot(out) == before

    # a head trained on the old data is refused as well, once its positions are gone
    for shard in (out / "positions").iterdir():
        shard.unlink()
    (out / "positions").rmdir()
    assert cli.main(argv(files, out, "b")) == 2
    err = capsys.readouterr().err
    assert str(out / "checkpoint.pt") in err and "other data" in err
    (out / "checkpoint.pt").unlink()
    assert cli.main(argv(files, out, "b")) == 0  # as told: the new data is extracted and trained on
    assert f"{positions_of(files['b'])} positions from 5 references" in capsys.readouterr().out


def test_positions_and_a_head_of_an_earlier_version_resume_with_a_warning(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(argv(files, out, "a", "--epochs", "1")) == 0
    capsys.readouterr()
    progress = out / "positions" / "progress.json"
    state = json.loads(progress.read_text())
    assert "data" in state  # what the positions were extracted from
    del state["data"]
    progress.write_text(json.dumps(state))
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    del checkpoint["data"]
    step = checkpoint["step"]
    torch.save(checkpoint, out / "checkpoint.pt")
    assert cli.main(argv(files, out, "a", "--epochs", "2")) == 0
    captured = capsys.readouterr()
    assert "cannot be checked" in captured.out + captured.err
    assert f"resumed at step {step}" in captured.out


@pytest.mark.parametrize("option, value, message", [
    ("--batch-size", "0", "argument --batch-size: must be a whole number >= 1, got '0'"),
    ("--epochs", "0", "argument --epochs: must be a finite number > 0, got '0'"),
    ("--width", "-3", "argument --width: must be a whole number >= 1, got '-3'"),
    ("--max-length", "1", "argument --max-length: must be a whole number >= 2, got '1'"),
    ("--eval-every", "0", "argument --eval-every: must be a whole number >= 1, got '0'"),
    ("--lr", "nan", "argument --lr: must be a finite number > 0, got 'nan'"),
    ("--max-sequences", "0", "argument --max-sequences: must be a whole number >= 1, got '0'"),
])
def test_option_values_that_cannot_train_are_refused_at_parsing(files, tmp_path, capsys, option, value, message):
    # a target that does not exist: the refusal comes before anything loads
    with pytest.raises(SystemExit) as stop:
        cli.main(["train-depth1", "--target", str(tmp_path / "nowhere"), "--data", str(files["a"]),
                  "--output-dir", str(tmp_path / "run"), option, value])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_fewer_positions_than_the_batch_size_train_on_all_of_them(files, tmp_path, capsys):
    out = tmp_path / "run"
    command = argv(files, out, "b")
    command[command.index("--batch-size") + 1] = "256"
    assert cli.main(command) == 0
    printed = capsys.readouterr().out
    n = positions_of(files["b"])
    assert n < 256 and f"fewer than --batch-size 256: each step takes all {n}" in printed
    assert (out / "final" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-2]["step"] == 2 and rows[-2]["positions_seen"] == 2 * n  # --epochs 2


@pytest.fixture
def no_target(monkeypatch):
    """Fail the test if the target's weights are loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")
    monkeypatch.setattr(training_cli, "load_target", refuse)


def test_an_empty_data_file_is_named_before_the_target_loads(files, tmp_path, capsys, no_target):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    command = argv(files, tmp_path / "run")
    command[command.index("--data") + 1] = str(empty)
    assert cli.main(command) == 2
    err = capsys.readouterr().err.strip()
    assert f"{empty} holds no usable reference sequences" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_damaged_progress_file_is_named_before_the_target_loads(files, tmp_path, capsys, no_target):
    out = tmp_path / "run"
    (out / "positions").mkdir(parents=True)
    (out / "positions" / "progress.json").write_text('{"signature": "abc", "references_do')
    assert cli.main(argv(files, out)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{out / 'positions' / 'progress.json'} is damaged" in err and f"delete {out / 'positions'}" in err


# Signals: a run in a subprocess, with shards of 20 positions and a checkpoint every 5 steps (module constants
# set before `main`), killed or interrupted during extraction and during training, then run again.
# SIGINT is restored to Python's own handler: a shell that starts a job in the background (`cmd &`, as a CI runner
# may) leaves SIGINT ignored in its children, and an ignored Ctrl-C is not what this test is about.
RUNNER = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
          " from hf_treespark.training import depth1; depth1.SHARD_POSITIONS = 20; depth1.SAVE_EVERY = 5;"
          " from hf_treespark.cli.commands import main; sys.exit(main(sys.argv[1:]))")


def test_a_run_killed_or_interrupted_anywhere_resumes_and_loses_nothing(files, tmp_path):
    from hf_treespark.training.depth1 import PositionShards

    data = write_references(tmp_path / "many.jsonl", 160, 4)
    out = tmp_path / "run"
    command = [sys.executable, "-c", RUNNER, *argv(files, out, "a", "--epochs", "3", "--batch-size", "8",
                                                   "--eval-every", "100")]
    command[command.index("--data") + 1] = str(data)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    progress, checkpoint = out / "positions" / "progress.json", out / "checkpoint.pt"

    def stop(sig: int, ready) -> subprocess.CompletedProcess:
        """Start the command, send `sig` once `ready()`, and return what it printed."""
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while proc.poll() is None and not ready():
                time.sleep(0.01)
            proc.send_signal(sig)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)

    def done() -> int:
        try:
            return json.loads(progress.read_text())["references_done"]
        except (OSError, ValueError):
            return 0

    killed = stop(signal.SIGKILL, lambda: done() > 0)
    assert killed.returncode == -9 and 0 < done() < 160, killed.stderr[-2000:]
    at = done()
    interrupted = stop(signal.SIGINT, lambda: done() > at)
    assert f"resuming extraction at reference {at + 1} of 160" in interrupted.stdout
    assert interrupted.returncode == 130 and 0 < done() < 160, interrupted.stderr[-2000:]
    assert interrupted.stderr.strip().splitlines()[-1] == ("treespark train-depth1: interrupted; rerun the same "
                                                           "command to resume")
    assert "Traceback" not in interrupted.stderr

    def steps() -> int:
        try:
            return torch.load(checkpoint, weights_only=True)["step"]
        except Exception:
            return 0

    killed = stop(signal.SIGKILL, lambda: steps() > 0)
    assert killed.returncode == -9 and "resuming extraction at reference" in killed.stdout, killed.stderr[-2000:]
    step = steps()
    interrupted = stop(signal.SIGINT, lambda: steps() > step)
    assert f"resumed at step {step}" in interrupted.stdout
    assert interrupted.returncode == 130, interrupted.stderr[-2000:]
    step = steps()
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"resumed at step {step}" in finished.stdout and (out / "final" / "model.safetensors").is_file()

    # every position once, in order: the tokens and labels of an uninterrupted extraction
    refs = load_references(data, max_length=384)
    signature = json.loads(progress.read_text())["signature"]
    stored = PositionShards(out / "positions", signature).load()
    tokens = [t for r in refs for t in r.input_ids[r.prompt_len:-1]]
    labels = [t for r in refs for t in r.input_ids[r.prompt_len + 1:]]
    assert stored["token"].tolist() == tokens and stored["label"].tolist() == labels


def test_help_says_which_labels_train_depth1_uses_and_where_text_goes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train-depth1", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Labels: the next token of each response, that is the target's own greedy choice there" in text
    assert "`treespark distil` labels each position with the target's own argmax" in text
