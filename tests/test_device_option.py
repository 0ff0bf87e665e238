"""`--device` and `--dtype`: one option of each, built and checked in `help_format`, on every command that runs a model.

On this CPU machine a GPU is faked (`torch.cuda.is_available`, `device_count`, the capability) to follow the device from
the command line to the loaders, whose models are replaced by recorders; and the real loaders are followed to a
model's parameters with the `meta` device, which every machine has.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark import help_format
from hf_treespark.cli.commands import main
from hf_treespark.hub import loading

REPO = Path(__file__).resolve().parents[1]
MODEL_COMMANDS = ("generate", "bench", "calibrate", "demo", "answers", "distil")
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


class Loaded(Exception):
    """Raised by a recording loader: the command got as far as loading, with these arguments."""


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two CUDA GPUs that compute bf16 natively, as far as the checks and `dtype="auto"` can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.fixture
def recorded(monkeypatch):
    """Every loader the commands call records its arguments and stops the command (`Loaded`, status 2)."""
    calls = []

    def record(name):
        def loader(*args, **kwargs):
            calls.append((name, args, kwargs))
            raise Loaded(name)
        return loader

    from hf_treespark.demo import run as demo_run
    from hf_treespark.training import cli as training_cli

    for name in ("load_pair", "load_target", "load_drafter"):
        monkeypatch.setattr(loading, name, record(name))
    monkeypatch.setattr(demo_run, "load_pair", record("demo load_pair"))
    monkeypatch.setattr(training_cli, "load_target", record("training load_target"))
    return calls


def run_until_loaded(argv: list[str]) -> None:
    with pytest.raises(Loaded):
        main(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----- resolve_device: what a device string means on this machine ------------------------------------------------

def test_auto_is_cuda_where_there_is_a_gpu_else_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert help_format.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert help_format.resolve_device("auto") == torch.device("cuda")


def test_a_gpu_that_is_there_resolves_and_one_that_is_not_is_named(two_gpus):
    assert help_format.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert help_format.resolve_device(" cuda ") == torch.device("cuda")
    with pytest.raises(ValueError) as err:
        help_format.resolve_device("cuda:2")
    assert str(err.value) == ("--device cuda:2: this machine has 2 CUDA GPUs; use --device cuda:0..cuda:1 or "
                              "--device cpu")


def test_without_a_gpu_cuda_is_refused_in_one_line_saying_what_to_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as err:
        help_format.resolve_device("cuda")
    message = str(err.value)
    assert message.startswith("--device cuda: this machine has no CUDA GPU") and message.endswith("; use --device cpu")
    assert "\n" not in message


@pytest.mark.parametrize(("text", "kinds", "message"), [
    ("gpu", help_format.DEVICE_KINDS, "--device 'gpu' is not a device: use cpu, cuda or cuda:N, mps, or auto"),
    ("meta", help_format.DEVICE_KINDS, "--device 'meta' is not a device this command runs on (meta): use cpu"),
    ("mps", ("cpu", "cuda"), "--device 'mps' is not a device this command runs on (mps): use cpu, cuda or cuda:N, or"),
])
def test_a_string_that_is_no_device_here_is_refused_naming_the_choices(text, kinds, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        help_format.resolve_device(text, kinds=kinds)


# ----- one option, the same on every command that runs a model ---------------------------------------------------

@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_command_that_runs_a_model_takes_device_and_dtype_alike(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--device", "cuda", "--help"])
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE" in shown and "auto: cuda when this machine has a CUDA GPU, else cpu" in shown, shown
    if command not in ("answers", "distil"):  # these two load the target in its "auto" precision
        assert "--dtype {auto,fp32,bf16,fp16}" in shown, shown


def test_dtype_takes_torchs_names_as_the_short_ones_and_refuses_others():
    parser = argparse.ArgumentParser()
    help_format.add_dtype_option(parser)
    assert [parser.parse_args(["--dtype", name]).dtype for name in ("bfloat16", "float32", "float16", "bf16")] == [
        "bf16", "fp32", "fp16", "bf16"]
    assert parser.parse_args([]).dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp64"])


@NO_GPU
@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["bench", "--smoke"], ["calibrate"],
                                  ["demo", "--port", "0"], ["answers", "--output-dir", "OUT"],
                                  ["distil", "--output-dir", "OUT"]])
def test_on_a_cpu_device_cuda_ends_in_one_line_before_anything_loads(argv, recorded, tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "OUT" else str(free_port()) if a == "0" else a for a in argv]
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treespark: error: --device cuda: this machine has no CUDA GPU") and err.count("\n") == 1, err
    assert err.rstrip().endswith("; use --device cpu")
    assert recorded == [] and not (tmp_path / "out").exists()


@NO_GPU
def test_the_console_command_refuses_cuda_on_a_cpu_with_status_2_and_no_traceback():
    done = subprocess.run([sys.executable, "-m", "hf_treespark.cli", "generate", "--prompt", "hi", "--device", "cuda"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("treespark: error: --device cuda: this machine has no CUDA GPU")
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


# ----- the device reaches the loaders (a faked GPU) ---------------------------------------------------------------

@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["calibrate", "--latency-only"]])
def test_generate_and_calibrate_load_the_pair_on_the_device_given(argv, two_gpus, recorded):
    run_until_loaded([*argv, "--device", "cuda:1", "--dtype", "bfloat16"])
    (name, args, kwargs), = recorded
    assert name == "load_pair" and args[2] == "bf16" and kwargs["device"] == torch.device("cuda", 1)


def test_auto_loads_on_the_gpu_when_there_is_one(two_gpus, recorded):
    run_until_loaded(["generate", "--prompt", "hi"])
    assert recorded[0][2]["device"] == torch.device("cuda")


def test_bench_loads_target_and_drafter_on_the_device_in_its_precision(two_gpus, recorded, monkeypatch, tmp_path):
    run_until_loaded(["bench", "--smoke", "--device", "cuda:1", "--output-dir", str(tmp_path / "bench")])
    (name, args, kwargs), = recorded
    # "auto" decided for the GPU (bf16 natively there), not for this machine's CPU
    assert name == "load_target" and args[1] == torch.bfloat16 and kwargs["device"] == torch.device("cuda", 1)

    recorded.clear()
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: (argparse.Namespace(), None))
    run_until_loaded(["bench", "--smoke", "--device", "cuda", "--dtype", "fp16", "--output-dir", str(tmp_path / "b")])
    (name, args, kwargs), = recorded
    assert name == "load_drafter" and args[1] == torch.float16 and kwargs["device"] == torch.device("cuda")


def test_demo_builds_its_app_for_the_device_given(two_gpus, recorded, monkeypatch):
    pytest.importorskip("gradio")
    from hf_treespark.demo import page

    built = {}
    monkeypatch.setattr(page, "build_app", lambda **kwargs: built.update(kwargs) or "app")
    monkeypatch.setattr(page, "launch", lambda app, **kwargs: None)
    assert main(["demo", "--port", str(free_port()), "--device", "cuda:1", "--dtype", "fp16"]) == 0
    assert built["device"] == torch.device("cuda", 1) and built["dtype"] == "fp16"


def test_the_demo_app_loads_its_pair_on_its_device(recorded):
    pytest.importorskip("gradio")
    from hf_treespark.demo import page

    with pytest.raises(Loaded):
        page.build_app(device=torch.device("cuda", 1), dtype="bf16")
    (name, args, kwargs), = recorded
    assert name == "demo load_pair" and args == (None, None, "bf16") and kwargs == {"device": torch.device("cuda", 1)}


@pytest.mark.parametrize("command", ["answers", "distil"])
def test_answers_and_distil_load_the_target_on_the_device_given(command, two_gpus, recorded, tmp_path):
    run_until_loaded([command, "--output-dir", str(tmp_path / "run"), "--device", "cuda:1"])
    (name, args, kwargs), = recorded
    assert name == "training load_target" and kwargs["device"] == "cuda:1"
    recorded.clear()
    run_until_loaded([command, "--output-dir", str(tmp_path / "run")])  # auto: the GPU
    assert recorded[0][2]["device"] == "cuda"


# ----- the real loaders put the models on the device (meta: on any machine) ----------------------------------------

def test_the_loaders_put_target_and_drafter_on_the_device_they_are_given(tmp_path, monkeypatch):
    import transformers

    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kwargs: "tokenizer")
    loaded, tokenizer, drafter = loading.load_pair(str(tmp_path / "target"), str(tmp_path / "drafter"), "fp32",
                                                   device="meta")
    assert tokenizer == "tokenizer"
    assert {p.device.type for p in loaded.parameters()} == {"meta"} == {p.device.type for p in drafter.parameters()}
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


def test_packing_is_refused_for_a_model_that_is_not_on_the_cpu():
    with pytest.raises(ValueError, match="packs the linear layers of a model on the CPU, and this one is on meta"):
        loading.load_drafter(None, "fp32", device="meta", cpu_pack=True)


def test_export_takes_the_short_dtype_names_every_other_command_takes():
    """`--dtype` is spelled one way: `treespark export --dtype bf16` is `bfloat16`, and `fp16` is refused by name."""
    import argparse

    import pytest

    from hf_treespark.cli.args import add_export_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_export_arguments(parser)
    assert parser.parse_args(["--output", "x", "--dtype", "bf16"]).dtype == "bfloat16"
    assert parser.parse_args(["--output", "x", "--dtype", "fp32"]).dtype == "float32"
    assert parser.parse_args(["--output", "x", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--output", "x", "--dtype", "fp16"])
