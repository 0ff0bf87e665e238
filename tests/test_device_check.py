"""`scripts/device_check.sh`: its dry run checks and lists every step without a GPU; without CUDA it refuses to run.
Then what the package assumes about a GPU machine: which precision "auto" picks there (`precision.py`), and when a
round's measured cost is kept (`latency.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_treespark import precision
from hf_treespark.calibration import latency

REPO = Path(__file__).resolve().parents[1]
STEPS = ("exactness-fp32", "exactness-half", "bench", "bench-profile", "train-smoke")


def device_check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TREESPARK_TEST_DEVICE"}
    env["HF_TREESPARK_CACHE"] = str(tmp_path / "cache")  # never the user's latency cache
    return subprocess.run(["bash", "scripts/device_check.sh", "--venv", sys.prefix, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_dry_run_checks_and_lists_every_step_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    done = device_check(tmp_path, "--dry-run", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ") and line.split()]
    assert [step for step in listed if step in STEPS] == list(STEPS)
    for command in ("TREESPARK_TEST_DEVICE=cuda", "tests/test_device_exactness.py -k fp32", r"-k bf16\ or\ fp16",
                    "treespark bench --device cuda --num-prompts 5", "treespark bench --device cuda --profile",
                    "examples/train_drafter.py --target default", f"--output-dir {out}/train_smoke"):
        assert command in done.stdout, command
    # every step runnable: none is listed as skipped, and both bench steps time the GPU
    assert "skip" not in done.stdout.lower()
    benches = [line for line in done.stdout.splitlines() if line.split()[:1] in (["bench"], ["bench-profile"])]
    assert len(benches) == 2 and all("--device cuda" in line for line in benches), benches
    assert "fp32, 2 half precision exactness tests" in done.stdout  # pytest found the tests each step selects
    assert done.stdout.strip().splitlines()[-1].endswith("nothing run")
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_refuses_with_a_message_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    done = device_check(tmp_path, "--output-dir", str(out))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "no CUDA device here" in last and "--dry-run" in last, done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("case", ["unknown option", "no directory", "output is a file", "no venv"])
def test_bad_options_are_refused_in_one_line_before_anything_runs(tmp_path, case):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    args, expected = {
        "unknown option": (["--dry-run", "--gpu"], "unknown option '--gpu'"),
        "no directory": (["--dry-run", "--output-dir"], "--output-dir needs a directory"),
        "output is a file": (["--dry-run", "--output-dir", str(afile)], f"--output-dir {afile} is a file"),
        "no venv": (["--dry-run", "--venv", str(tmp_path / "none")], f"{tmp_path}/none/bin/python: no such program"),
    }[case]
    done = device_check(tmp_path, *args)
    assert done.returncode != 0
    assert done.stdout == ""
    assert expected in done.stderr.strip().splitlines()[-1], done.stderr


# --- a GPU machine, as precision.py and latency.py see it ----------------------------------------------------------

@pytest.mark.parametrize("capability, hip, expected", [((9, 0), None, torch.bfloat16), ((8, 0), None, torch.bfloat16),
                                                       ((7, 5), None, torch.float16), ((7, 0), None, torch.float16),
                                                       ((9, 4), "6.2", torch.bfloat16)])
def test_auto_picks_bf16_only_on_gpus_that_compute_it_natively(monkeypatch, capability, hip, expected):
    """A T4 (7.5) or a V100 (7.0) emulates bf16 (torch.cuda.is_bf16_supported() says True there): float16."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert precision.resolve_dtype("auto", "cuda:1") == expected
    assert asked in ([torch.device("cuda", 1)], [])  # the device asked about, not the current one (ROCm: none)


def test_auto_on_cuda_without_a_gpu_is_float16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.auto_dtype("cuda") == torch.float16


def test_only_a_cpu_measurement_is_refused_for_a_little_load_elsewhere():
    """On a CPU the forwards use every core; on a GPU the host only launches kernels, so other processes may keep
    all but two cores busy (a GPU host never quite idle would otherwise never store its latency)."""
    assert latency.busy_cores_limit(torch.device("cpu"), cpu_count=64) == latency.BUSY_CORES
    assert latency.busy_cores_limit(torch.device("cuda"), cpu_count=16) == 14.0
    assert latency.busy_cores_limit(torch.device("cuda", 1), cpu_count=2) == latency.BUSY_CORES


def test_a_mig_slice_and_its_whole_gpu_keep_separate_latency_tables(monkeypatch):
    """The CUDA signature holds the multiprocessor count: a slice of an H200 is not priced as the whole GPU."""
    sms = {0: 132, 1: 16}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="NVIDIA H200", multi_processor_count=sms[device.index]))
    whole, mig = (latency.device_signature(torch.device("cuda", i)) for i in (0, 1))
    assert whole == "cuda:NVIDIA H200:132SMs" and mig == "cuda:NVIDIA H200:16SMs"
