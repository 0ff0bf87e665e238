"""The README's main job: `treespark generate` on the offline default target with the shipped drafter."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import hf_treespark
from hf_treespark import arg_types
from hf_treespark.cli import commands as cli
from hf_treespark.cli.commands import main
from hf_treespark.hub import assets

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_shipped_drafter_loads_binds_and_is_exact():
    target, tokenizer = hf_treespark.load_default_target(dtype=torch.float32)
    drafter = hf_treespark.load_default_drafter(dtype=torch.float32)
    assert drafter.dtype == target.dtype == torch.float32
    assert drafter.config.target_vocab_size == target.config.vocab_size
    inputs = assets.chat_inputs(tokenizer, "Name three primary colours.")
    ref = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=24,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.acceptance_length > 1.0  # a trained drafter gets some drafted tokens accepted


@pytest.mark.slow
def test_cli_generate_with_compare(capsys):
    assert main(["generate", "--prompt", "Say hello.", "--max-new-tokens", "12", "--compare", "--dtype", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "mean acceptance length" in printed and "identical to plain greedy" in printed and "(fp32)" in printed


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "   "])
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--max-new-tokens", "0"])
    assert main(["generate", "--prompt", "hi", "--drafter", "/no/such/drafter"]) == 2
    assert "no/such/drafter" in capsys.readouterr().err


def test_version_and_help_with_defaults(capsys):
    from hf_treespark import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"treespark {__version__}"
    for command, shown in (("generate", "(default: 128)"), ("train", "(default: treespark)"),
                           ("bench", "(default: bench_results)"), ("demo", "$GRADIO_SERVER_PORT or 7860")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert shown in " ".join(capsys.readouterr().out.split()), command  # help text wraps lines


_ENTRY = """
import sys
import hf_treespark_cli
try:
    code = hf_treespark_cli.main(sys.argv[1:])
except SystemExit as done:
    code = done.code
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
package = sys.modules.get("hf_treespark")
print("RESULT", code, heavy, hasattr(package, "TreeSparkDrafter"))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"], ["demo", "--help"],
                                  ["push", "--help"], ["generate"]])
def test_the_console_command_parses_without_importing_torch(argv):
    """`treespark --help` took 6 s importing torch and transformers; parsing needs neither."""
    assert 'treespark = "hf_treespark_cli:main"' in (REPO / "pyproject.toml").read_text()  # the console script
    proc = subprocess.run([sys.executable, "-c", _ENTRY, *argv], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    result = proc.stdout.strip().splitlines()[-1]
    assert result == f"RESULT {2 if argv == ['generate'] else 0} [] False", proc.stdout + proc.stderr


def test_the_console_command_runs_a_command_with_the_package_imported_whole():
    """Once parsed, the command runs after `import hf_treespark` (drafter registered, generate() routed)."""
    proc = subprocess.run([sys.executable, "-c", _ENTRY, "push", "--drafter", "/no/such/drafter", "--repo-id", "a/b"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.stdout.strip().splitlines()[-1] == "RESULT 2 ['torch', 'transformers'] True"
    assert proc.stderr.strip() == ("treespark: error: --drafter '/no/such/drafter': no drafter directory there "
                                   "(config.json missing); give the final/ directory of a training run")


def test_push_uploads_the_drafter_with_its_card_without_network(tmp_path, monkeypatch, capsys):
    from conftest import make_drafter, make_target
    from huggingface_hub import HfApi

    from hf_treespark.hub.sharing import save_drafter

    drafter_dir = save_drafter(make_drafter(make_target()).to(torch.bfloat16), tmp_path / "final")
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create", repo_id, kwargs))
        return types.SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, **kwargs):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        dtype = json.loads((Path(folder_path) / "config.json").read_text()).get("dtype")
        calls.append(("upload", repo_id, files, dtype))
        return types.SimpleNamespace(commit_url=f"https://hub.example/{repo_id}/commit/1")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert main(["push", "--drafter", str(drafter_dir), "--repo-id", "org/tiny-drafter", "--private"]) == 0
    assert calls[0] == ("create", "org/tiny-drafter", {"exist_ok": True, "private": True})
    _, repo, files, dtype = calls[1]
    assert repo == "org/tiny-drafter" and dtype == "bfloat16"  # uploaded in the dtype it was saved in
    assert {"README.md", "config.json", "model.safetensors", "modeling.py", "configuration.py"} <= set(files)
    assert ("uploaded to https://hub.example/org/tiny-drafter/commit/1, model card: its own README.md"
            in capsys.readouterr().out)  # the directory's card, not a regenerated one

    calls.clear()
    assert main(["push", "--drafter", str(tmp_path / "nothing"), "--repo-id", "org/x"]) == 2
    assert "--drafter" in capsys.readouterr().err
    assert main(["push", "--drafter", str(drafter_dir), "--repo-id", "org/x/y"]) == 2
    assert "--repo-id 'org/x/y' is not a Hub repository id" in capsys.readouterr().err
    assert calls == []  # nothing was uploaded


@pytest.mark.parametrize(("kind", "text", "message"), [
    (arg_types.at_least(2), "1", "must be a whole number >= 2, got '1'"),
    (arg_types.at_least(1), "1.5", "must be a whole number >= 1, got '1.5'"),
    (arg_types.auto_or_at_least(1), "many", "must be 'auto' or a whole number >= 1, got 'many'"),
    (arg_types.whole_numbers, "2,0", "must be whole numbers >= 1 separated by commas, got '2,0'"),
    (arg_types.positive_number, "inf", "must be a finite number > 0, got 'inf'"),
    (arg_types.non_negative_number, "-1", "must be a finite number >= 0, got '-1'"),
    (arg_types.temperature, "nan", "must be a finite number >= 0 (0 = greedy), got 'nan'"),
    (arg_types.probability, "1.5", "must be a number in [0, 1], got '1.5'"),
    (arg_types.names_from(("fp32", "bf16")), "fp32,fp32", "must be names from fp32, bf16 separated by commas, each "
                                                           "once, got 'fp32,fp32'"),
    (arg_types.json_object, "[1]", "must be a JSON object like '{\"key\": 1.0}', got '[1]'"),
    (arg_types.existing_file, "no/such.txt", "no/such.txt: no such file"),
    (arg_types.existing_dir, "no/such", "no/such: no such directory"),
])
def test_each_argparse_type_says_what_the_value_must_be_and_what_was_given(kind, text, message):
    """One wording per type, whichever command or script uses it (hf_treespark/arg_types.py)."""
    import argparse

    with pytest.raises(argparse.ArgumentTypeError) as refused:
        kind(text)
    assert message in str(refused.value)


def test_argparse_types_read_their_values_as_before():
    assert arg_types.at_least(0)(" 3 ") == 3 and arg_types.auto_or_at_least(1)("auto") == "auto"
    assert arg_types.whole_numbers("1,4,8") == [1, 4, 8] and arg_types.names_from(("a", "b"))("b, a") == ["b", "a"]
    assert arg_types.positive_number("1e-3") == 1e-3 and arg_types.temperature("0") == 0.0
    assert arg_types.probability("1") == 1.0 and arg_types.json_object('{"surv": 1}') == {"surv": 1}


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "warm"])
def test_cli_refuses_a_temperature_that_is_not_a_finite_number_at_least_zero(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--temperature", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --temperature: must be a finite number >= 0 (0 = greedy), got '{value}'" in err


def test_ctrl_c_ends_with_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(args):
        print("partial answer", end="", flush=True)  # the streamer was mid-answer
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert main(["generate", "--prompt", "hi"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "\ntreespark: interrupted\n" and captured.out == "partial answer"


@pytest.mark.slow
def test_sigint_during_generate_exits_130_without_a_traceback():
    command = [sys.executable, "-m", "hf_treespark.cli", "generate", "--prompt", "Write a long story about a tree.",
               "--max-new-tokens", "1000"]
    # A shell starts background jobs with SIGINT ignored, and a child inherits that (Python then installs no
    # handler): give the command the default disposition, as a terminal would.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.read(1)  # the answer has started streaming: the models are loaded and decoding
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out.decode()[-500:], err.decode()[-2000:])
    assert err.decode().strip().splitlines()[-1] == "treespark: interrupted"
    assert "Traceback" not in err.decode()


# ----- treespark demo: where to serve, checked before loading models -------------------------------------
@pytest.fixture
def demo_calls(monkeypatch):
    """Record build_app/launch instead of loading models and serving."""
    pytest.importorskip("gradio")
    from hf_treespark.demo import page as demo

    calls = {}

    def build_app(**kwargs):
        calls["built"] = kwargs
        return "app"

    monkeypatch.setattr(demo, "build_app", build_app)
    monkeypatch.setattr(demo, "launch", lambda app, **kwargs: calls.setdefault("launch", kwargs))
    for name in ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return calls


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "99999"], "--port 99999 is not a port number: choose one in 1-65535"),
    (["--port", "0"], "--port 0 is not a port number"),
    (["--host", "no such host!"], "--host 'no such host!' is not an address of this machine"),
])
def test_demo_refuses_an_address_before_loading_models(demo_calls, argv, message, capsys):
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err
    assert "built" not in demo_calls


def test_demo_refuses_a_port_in_use_before_loading_models(demo_calls, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["demo", "--port", str(port)]) == 2
    assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err
    assert "built" not in demo_calls


def test_demo_honours_gradio_server_name_and_port_unless_flags_are_given(demo_calls, monkeypatch, capsys):
    port, other = _free_port(), _free_port()
    monkeypatch.setenv("GRADIO_SERVER_NAME", "localhost")
    monkeypatch.setenv("GRADIO_SERVER_PORT", str(port))
    assert main(["demo"]) == 0
    assert demo_calls["launch"]["host"] == "localhost" and demo_calls["launch"]["port"] == port
    demo_calls.clear()
    assert main(["demo", "--host", "127.0.0.1", "--port", str(other)]) == 0
    assert demo_calls["launch"]["host"] == "127.0.0.1" and demo_calls["launch"]["port"] == other
    monkeypatch.setenv("GRADIO_SERVER_PORT", "http")
    assert main(["demo"]) == 2
    assert "GRADIO_SERVER_PORT='http' is not a port number" in capsys.readouterr().err


def test_demo_checks_its_address_before_importing_gradio(demo_calls, monkeypatch, capsys):
    """gradio's own import reads GRADIO_SERVER_PORT and fails on a bad one with a traceback: our check runs first."""
    from hf_treespark.demo import page as demo

    imported = []
    monkeypatch.setattr(demo, "import_gradio", lambda: imported.append(True))
    monkeypatch.setenv("GRADIO_SERVER_PORT", "abc")
    assert main(["demo"]) == 2
    assert capsys.readouterr().err.strip() == ("treespark: error: GRADIO_SERVER_PORT='abc' is not a port number: "
                                               "set it to one in 1-65535")
    assert not imported and "built" not in demo_calls


def test_generate_refuses_a_prompt_that_is_not_utf8_before_loading_models(monkeypatch, capsys):
    """Bytes that are not UTF-8 reach Python as lone surrogates (`--prompt $'\\xff\\xfe'`); the tokenizer would fail
    on them with a traceback after the models load."""
    monkeypatch.setattr(cli, "_load_pair", lambda args: pytest.fail("models loaded"))
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", b"\xff\xfe".decode("utf-8", "surrogateescape")])
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("treespark: error: --prompt is not valid UTF-8 text (the shell "
                                                        "passed bytes that are not): give it as UTF-8")
    with pytest.raises(ValueError, match="not valid UTF-8 text"):
        assets.chat_inputs(None, "caf\udce9")


def test_demo_defaults_to_127_0_0_1_port_7860(demo_calls):
    with socket.socket() as probe:  # skip when something else already serves there
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", 7860))
        except OSError:
            pytest.skip("port 7860 is in use on this machine")
    assert main(["demo"]) == 0
    assert (demo_calls["launch"]["host"], demo_calls["launch"]["port"]) == ("127.0.0.1", 7860)


def test_the_command_lines_dtype_choices_are_the_loaders():
    """`--dtype`'s choices are written out in help_format (no torch there); they must be what the loaders take."""
    from hf_treespark import help_format, precision

    assert help_format.DTYPE_CHOICES == precision.DTYPE_CHOICES


@pytest.fixture
def no_models(monkeypatch):
    """Loading a model fails the test: these commands must stop at their options."""
    from hf_treespark.hub import loading

    def refuse(*args, **kwargs):
        pytest.fail("models loaded")

    for name in ("load_pair", "load_target", "load_drafter"):
        monkeypatch.setattr(loading, name, refuse)
    monkeypatch.setattr(cli, "_load_pair", refuse)


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--batch-size", ""], "argument --batch-size: is empty: give batch sizes, e.g. 1,2,4,8,16"),
    (["bench", "--batch-size", " , "], "argument --batch-size: expected whole numbers >= 1 separated by commas"),
    (["calibrate", "--batch-sizes", ""], "argument --batch-sizes: is empty: give batch sizes, e.g. 1,2,4,8,16"),
    (["calibrate", "--batch-sizes", "2,,4"], "argument --batch-sizes: expected whole numbers >= 1 separated by"),
    (["calibrate", "--batch-sizes", "1000"], "argument --batch-sizes: batch size 1000 is more than 256"),
    (["bench", "--batch-size", "2,4,257"], "argument --batch-size: batch size 257 is more than 256"),
    (["calibrate", "--drafter", ""], "--drafter is empty: give a value, or leave the option out for its default"),
    (["calibrate", "--target", " "], "--target is empty: give a value, or leave the option out for its default"),
    (["bench", "--methods", ""], "--methods is empty: give a value, or leave the option out for its default"),
    (["datastore", "--data", "x.jsonl", "--output", ""], "--output is empty: give a value"),
    (["datastore", "--data", "", "--output", "out"], "--data is empty: give a value"),
    (["generate", "--prompt", "hi", "--drafter", ""], "--drafter is empty"),
    (["distil", "--output-dir", ""], "--output-dir is empty: give a value"),
    (["distil", "--output-dir", "run", "--drafter", ""], "--drafter is empty"),  # not the shipped drafter unasked
])
def test_empty_or_unbounded_option_values_are_refused_at_parsing(argv, message, no_models, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"treespark {argv[0]}: error: ") and message in last, last


@pytest.mark.parametrize(("argv", "message"), [
    (["--suites", " , "], "--suites ' , ': no suite named"),
    (["--methods", ","], "--methods ',': no method named"),
    (["--batch-size", ""], "argument --batch-size: is empty"),
])
def test_python_m_bench_refuses_empty_lists_too(argv, message, no_models, capsys):
    from hf_treespark.bench import run as bench

    try:
        code = bench.main(argv)
    except SystemExit as done:
        code = done.code
    assert code == 2 and message in capsys.readouterr().err


# ----- treespark distil: training/distill.py's options and run, wired like train-depth1 ---------------------------
def test_distil_help_says_which_labels_it_trains_on(capsys):
    from hf_treespark.training.distill import LABELS

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert "labelled by the target's own argmax" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as done:
        main(["distil", "--help"])
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert LABELS in shown and "--output-dir" in shown and "(default: 512)" in shown


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-length", "1"], "--max-length must be at least 2, got 1"),
    (["--sources", "notes.pdf"], "--sources 'notes.pdf': give 'sharegpt', a .txt file or a .jsonl chat file "
                                 "(messages or conversations)"),
])
def test_distil_refuses_a_bad_argument_before_anything_loads(argv, message, tmp_path, no_models, monkeypatch, capsys):
    from hf_treespark.training import cli as training_cli

    monkeypatch.setattr(training_cli, "load_target", lambda *a, **k: pytest.fail("models loaded"))
    assert main(["distil", "--output-dir", str(tmp_path / "run"), *argv]) == 2
    assert capsys.readouterr().err.strip() == f"treespark: error: {message}"
    assert not (tmp_path / "run").exists()


def test_the_console_command_shows_distils_help_before_the_package_initialises():
    """`treespark distil --help` through the console entry: its options come from training/distill.py, whose
    module imports torch, but the package's `__init__` (the drafter's registration) is still not run to show them."""
    proc = subprocess.run([sys.executable, "-c", _ENTRY, "distil", "--help"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT 0 ") and proc.stdout.strip().endswith("False")
    assert "usage: treespark distil" in proc.stdout and "--max-disk-gb" in proc.stdout, proc.stderr
