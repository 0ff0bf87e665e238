"""Ctrl-C during `treespark train` / `examples/train_drafter.py`: one line naming the checkpoint a rerun resumes from,
exit status 130, no traceback; the same command then resumes there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import test_train_cli

from hf_treespark.cli.commands import main
from hf_treespark.training import cli as train_cli

tiny_files = test_train_cli.tiny_files  # the fixture: a saved tiny target and its references

REPO = Path(__file__).resolve().parents[1]
# A drafter small enough for many steps a second, float32 steps (see test_train_cli.TINY)
TINY = ["--mixed-precision", "no", "--draft-layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
        "--intermediate-size", "64", "--markov-rank", "16", "--mask-token-id", "3", "--anchors", "8", "--lr", "2e-3",
        "--batch-size", "1", "--no-feature-cache"]


def test_ctrl_c_during_training_names_the_checkpoint_a_rerun_resumes_from(tiny_files, tmp_path):
    target, refs = tiny_files
    out = tmp_path / "run"
    command = [sys.executable, "examples/train_drafter.py", "--target", str(target), "--data", str(refs), *TINY,
               "--max-steps", "120", "--save-every", "2", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")])}
    # SIGINT's default disposition, as a terminal gives it (a background job inherits it ignored)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while proc.poll() is None and not any((out / "checkpoints").glob("step-*")):
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, (stdout[-1000:], stderr[-2000:])
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"train_drafter\.py: interrupted; rerun the same command to resume from its last "
                         r"checkpoint, (\S+/step-(\d+))", last)
    assert found and Path(found.group(1)).is_dir(), last
    step = int(found.group(2))
    assert 0 < step < 120 and not (out / "final").exists()

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"trained {120 - step} steps (to step 120 of 120)" in again.stdout


def test_treespark_train_interrupted_before_a_checkpoint_says_it_starts_again(tmp_path, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "_train", interrupted)
    assert main(["train", "--data", "x.jsonl", "--output-dir", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == ("treespark train: interrupted before its first checkpoint; rerun the same "
                                       "command to start again\n")
