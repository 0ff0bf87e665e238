"""`treespark train` / `examples/train_drafter.py` on a tiny target: bad options, shared feature caches, reruns."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_target
from training_setup import tiny_references

from hf_treespark.cli import commands as cli
from hf_treespark.training import cli as train_cli
from hf_treespark.training.data import load_references
from hf_treespark.training.trainer import FeatureCache

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_drafter.py"
# A drafter small enough for a few steps in seconds, built by the CLI itself; float32 steps, so that runs
# compared update for update (resumed, two processes) match on any CPU (bf16 autocast has its own test).
TINY = ["--mixed-precision", "no", "--draft-layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
        "--intermediate-size", "64", "--markov-rank", "16", "--mask-token-id", "3", "--anchors", "8", "--lr", "2e-3"]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """`(target directory, references JSONL)`: a saved tiny random Llama and 8 of its greedy continuations."""
    root = tmp_path_factory.mktemp("tiny")
    target = make_target("llama")
    target.save_pretrained(root / "target")
    lines = [json.dumps({"id": r.id, "prompt_ids": r.input_ids[: r.prompt_len],
                         "response_ids": r.input_ids[r.prompt_len:]}) for r in tiny_references(target)]
    (root / "refs.jsonl").write_text("\n".join(lines) + "\n")
    return root / "target", root / "refs.jsonl"


def train(tiny_files, out: Path, *extra: str) -> int:
    target, refs = tiny_files
    return train_cli.main(["--target", str(target), "--data", str(refs), "--output-dir", str(out), *TINY, *extra])


@pytest.mark.parametrize("steps", ["-1", "0"])
def test_max_steps_below_one_is_refused_before_any_work(tiny_files, tmp_path, capsys, steps):
    assert train(tiny_files, tmp_path / "run", "--max-steps", steps) == 2
    err = capsys.readouterr().err
    assert f"--max-steps must be at least 1 (got {steps})" in err
    assert not (tmp_path / "run").exists()  # no drafter saved, nothing trained
    target, refs = tiny_files
    assert cli.main(["train", "--target", str(target), "--data", str(refs), "--output-dir", str(tmp_path / "run"),
                     "--max-steps", steps]) == 2
    assert "--max-steps must be at least 1" in capsys.readouterr().err


def test_regenerate_only_without_a_mixture_is_refused_before_any_work(tiny_files, tmp_path, capsys):
    assert train(tiny_files, tmp_path / "run", "--regenerate-only") == 2
    assert "--regenerate-only needs --regenerate" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_command_trains_and_saves_the_drafter(tiny_files, tmp_path, capsys):
    assert cli.main(["train", "--target", str(tiny_files[0]), "--data", str(tiny_files[1]),
                     "--output-dir", str(tmp_path), "--max-steps", "2", "--batch-size", "4", *TINY]) == 0
    assert "trained 2 steps (to step 2 of 2)" in capsys.readouterr().out
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir()


def test_another_preset_on_the_same_output_dir_says_what_differs(tiny_files, tmp_path, capsys):
    assert train(tiny_files, tmp_path, "--preset", "treespark", "--max-steps", "2", "--batch-size", "4") == 0
    checkpoint = tmp_path / "checkpoints" / "step-00000002"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    capsys.readouterr()
    assert train(tiny_files, tmp_path, "--preset", "dspark", "--max-steps", "2", "--batch-size", "4") == 2
    err = capsys.readouterr().err
    assert "preset 'treespark' there, 'dspark' here" in err and "step-00000002" in err
    assert "intact" in err and "--output-dir" in err and "delete" not in err
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before  # the good checkpoint is untouched
    # the same preset resumes it
    assert train(tiny_files, tmp_path, "--preset", "treespark", "--max-steps", "3", "--batch-size", "4") == 0
    assert "trained 1 steps (to step 3 of 3)" in capsys.readouterr().out


def test_a_feature_cache_filled_with_another_max_length_is_refused(tiny_files, tmp_path, capsys):
    cache = tmp_path / "shared_cache"
    assert train(tiny_files, tmp_path / "short", "--max-length", "20", "--feature-cache", str(cache),
                 "--max-steps", "1") == 0
    capsys.readouterr()
    assert train(tiny_files, tmp_path / "long", "--max-length", "28", "--feature-cache", str(cache),
                 "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert f"feature cache {cache}" in err and "sequence length in tokens" in err and "--max-length" in err
    assert "'20'" in err and "'28'" in err
    assert not (tmp_path / "long" / "final").exists()


def test_a_damaged_feature_cache_file_is_recomputed_and_named(tiny_files, tmp_path, caplog):
    cache = tmp_path / "cache"
    assert train(tiny_files, tmp_path / "a", "--feature-cache", str(cache), "--max-steps", "1") == 0
    damaged = cache / "seq3.safetensors"
    intact = damaged.read_bytes()
    damaged.write_bytes(intact[: len(intact) // 2])  # a crash or a full disk mid-write
    store = FeatureCache(cache)
    with pytest.raises(RuntimeError, match=r"seq3\.safetensors.*delete it"):
        store.get("seq3")
    with caplog.at_level(logging.WARNING):
        assert train(tiny_files, tmp_path / "b", "--feature-cache", str(cache), "--max-steps", "1") == 0
    assert any("seq3.safetensors is damaged" in r.getMessage() for r in caplog.records)
    features, _ = store.get("seq3")
    assert features.shape[0] == 29  # recomputed whole


def test_a_token_id_outside_the_vocabulary_names_file_and_line(tiny_files, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(tiny_files[1].read_text().splitlines()[0] + "\n"
                   + json.dumps({"id": "x", "prompt_ids": [1, 2], "response_ids": [4, 5, 99999999]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: 'response_ids' holds token id 99999999, outside the "
                                         r"target's vocabulary \(0\.\.127\)"):
        load_references([bad], vocab_size=128)
    target, _ = tiny_files
    assert train_cli.main(["--target", str(target), "--data", str(bad), "--output-dir", str(tmp_path / "run"),
                           "--max-steps", "1", *TINY]) == 2
    assert "bad.jsonl:2: 'response_ids' holds token id 99999999" in capsys.readouterr().err


def _memory(monkeypatch, size: int) -> None:
    """Make the machine have `size` bytes of memory available to `treespark train`."""
    from hf_treespark.training import memory

    monkeypatch.setattr(memory, "available_memory", lambda device: (size, "available"))


def _never_load_the_target(monkeypatch) -> None:
    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the sizes were checked")

    monkeypatch.setattr(train_cli, "load_target", load_target)


@pytest.mark.parametrize("option, value", [("--draft-layers", "100000"), ("--intermediate-size", "10000000"),
                                           ("--markov-rank", "10000000"), ("--head-dim", "1000000")])
def test_a_drafter_too_large_for_memory_is_refused_before_anything_is_built(tiny_files, tmp_path, capsys,
                                                                           monkeypatch, option, value):
    """`--draft-layers 100000` used to grow to ~20 GB until the kernel killed the process without a word."""
    _memory(monkeypatch, 2 * 10**9)
    _never_load_the_target(monkeypatch)
    started = time.perf_counter()
    assert train(tiny_files, tmp_path / "run", "--max-steps", "1", option, value) == 2
    assert time.perf_counter() - started < 30
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.search(rf"error: {option} {value}: a drafter of [\d,]+ parameters needs [\d.]+ [GT]B to train .*more "
                     r"than the 2\.0 GB available", err), err
    assert not (tmp_path / "run").exists()


def test_an_init_from_without_a_drafter_is_refused_in_one_line_before_loading_the_target(tiny_files, tmp_path,
                                                                                         capsys, monkeypatch):
    _never_load_the_target(monkeypatch)
    assert train(tiny_files, tmp_path / "run", "--max-steps", "1", "--init-from", str(tmp_path / "none")) == 2
    assert f"--init-from {tmp_path / 'none'}: no TreeSpark drafter there" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_drafter_size_check_counts_parameters_exactly_without_building():
    from hf_treespark.drafter.configuration import TreeSparkConfig
    from hf_treespark.drafter.modeling import TreeSparkDrafter
    from hf_treespark.training.memory import available_memory, drafter_parameter_count

    for fields in ({"num_hidden_layers": 3}, {"num_hidden_layers": 1, "anchor_features": True, "mask_token_id": None},
                   {"num_hidden_layers": 2, "draft_vocab_size": 40, "normalize_features": True}):
        config = TreeSparkConfig.for_target(make_target("llama"), head_dim=32, intermediate_size=64, markov_rank=16,
                                            **fields)
        assert drafter_parameter_count(config) == sum(p.numel() for p in TreeSparkDrafter(config).parameters())
    size, where = available_memory(torch.device("cpu"))
    assert 0 < size and where.startswith("available")


def test_a_training_step_too_large_for_memory_is_refused_and_a_batch_counts_only_the_data(tiny_files, tmp_path,
                                                                                         capsys, monkeypatch):
    _memory(monkeypatch, 10**9)
    assert train(tiny_files, tmp_path / "run", "--max-steps", "1", "--anchors", "10000000") == 2
    err = capsys.readouterr().err
    assert "--batch-size 4 with --anchors 10000000: one training step holds 4 x 10000000 x 7 x 128 reference " \
           "probabilities (143.4 GB, float32)" in err and "more than the 1.0 GB available" in err
    assert not (tmp_path / "run" / "final").exists()
    # a batch never holds more than the 8 sequences there are: --batch-size 1000000 trains
    assert train(tiny_files, tmp_path / "big", "--max-steps", "1", "--batch-size", "1000000") == 0


@pytest.mark.parametrize("options, message", [
    (["--num-prompts", "100000000"], "--num-prompts 100000000: the prompt list alone needs 15.0 GB"),
    (["--num-prompts", "10000", "--regen-batch-size", "10000", "--regen-max-new-tokens", "100000"],
     "--regen-batch-size 10000: 10000 prompts answered at once with --regen-max-new-tokens 100000 need a "
     r"512\.0 GB key/value cache"),
])
def test_a_regeneration_too_large_for_memory_is_refused_before_loading_the_target(tiny_files, tmp_path, capsys,
                                                                                 monkeypatch, options, message):
    _memory(monkeypatch, 10**9)
    _never_load_the_target(monkeypatch)
    target, _ = tiny_files
    assert train_cli.main(["--target", str(target), "--regenerate", "sharegpt:1", "--output-dir", str(tmp_path / "r"),
                           *options]) == 2
    err = capsys.readouterr().err
    assert re.search(f"{message}, more than the 1.0 GB available", err), err
    assert not (tmp_path / "r").exists()


# What the user's environment may set to change how the Hub client behaves (offline mode, another endpoint).
HUB_ENVIRONMENT = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")


def _hub_online(monkeypatch) -> None:
    """The Hub client as it is with none of `HUB_ENVIRONMENT` set: the environment variables cleared, and the offline
    flag that `huggingface_hub.constants` read from them at import set back to False."""
    from huggingface_hub import constants

    for name in HUB_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def _hub_unreachable(monkeypatch) -> None:
    """The Hub client fails as it does without a network (never reached: no test depends on one), whatever the
    user's environment says about offline mode (`_hub_online`)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import httpx

    _hub_online(monkeypatch)
    def create_repo(self, repo_id, **kwargs):
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)


@pytest.mark.parametrize("repo_id, offline, message", [
    ("not a repo id!!", False, "--push-to-hub 'not a repo id!!' is not a Hub repository id"),
    ("me/drafter", True, "--push-to-hub me/drafter: HF_HUB_OFFLINE is set, so the upload would fail after training"),
])
def test_a_push_that_cannot_succeed_is_refused_before_training(tiny_files, tmp_path, capsys, monkeypatch, repo_id,
                                                              offline, message):
    """A bad repository id used to be rejected only after the whole run had trained."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    _never_load_the_target(monkeypatch)
    assert train(tiny_files, tmp_path / "run", "--max-steps", "1", "--push-to-hub", repo_id) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_failed_push_after_training_says_what_failed_keeps_final_and_how_to_retry(tiny_files, tmp_path, capsys,
                                                                                  monkeypatch):
    """Without a network the upload used to end in two chained httpx tracebacks."""
    _hub_unreachable(monkeypatch)
    out = tmp_path / "run"
    assert cli.main(["train", "--target", str(tiny_files[0]), "--data", str(tiny_files[1]), "--output-dir", str(out),
                     "--max-steps", "1", *TINY, "--push-to-hub", "me/drafter"]) == 2
    captured = capsys.readouterr()
    assert "trained 1 steps" in captured.out
    assert captured.err.count("error:") == 1 and "Traceback" not in captured.err
    assert (f"treespark: error: pushing to the Hub repository me/drafter failed (ConnectError: [Errno -2] Name or "
            f"service not known). The trained drafter is kept in {out / 'final'}; retry with: treespark push "
            f"--drafter {out / 'final'} --repo-id me/drafter") in captured.err
    assert (out / "final" / "model.safetensors").is_file()


def test_the_push_command_without_a_network_or_offline_ends_in_one_line(tmp_path, capsys, monkeypatch):
    from conftest import make_drafter

    from hf_treespark.hub.sharing import save_drafter

    final = save_drafter(make_drafter(make_target()), tmp_path / "final")
    _hub_unreachable(monkeypatch)
    assert cli.main(["push", "--drafter", str(final), "--repo-id", "me/drafter"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "ConnectError: [Errno -2] Name or service not known" in err
    assert f"retry with: treespark push --drafter {final} --repo-id me/drafter" in err
    monkeypatch.undo()
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "hf_treespark.cli", "push", "--drafter", str(final), "--repo-id",
                           "me/drafter"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"treespark: error: pushing .* failed \(OfflineModeIsEnabled: .*offline mode is enabled.*\); "
                     "retry with: treespark push", proc.stderr), proc.stderr
    assert (final / "model.safetensors").is_file()


def test_example_under_torchrun_trains_as_one_process_with_twice_the_batch(tiny_files, tmp_path):
    """The README's command: 2 CPU processes with batch 1 each make the update of 1 process with batch 2."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    target, refs = tiny_files
    # A large Adam epsilon makes the update linear in the gradient (see tests/ddp_worker.py).
    common = ["--target", str(target), "--data", str(refs), *TINY, "--max-steps", "2", "--save-every", "1",
              "--adam-eps", "1", "--lr", "0.5"]
    subprocess.run([sys.executable, str(EXAMPLE), *common, "--output-dir", str(tmp_path / "one"),
                    "--batch-size", "2"], check=True, env=env, timeout=300)
    two = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", "29541", str(EXAMPLE), *common,
                          "--output-dir", str(tmp_path / "two"), "--batch-size", "1"],
                         env=env, timeout=300, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "on 2 process(es)" in two.stdout
    from safetensors.torch import load_file

    a = load_file(tmp_path / "one" / "final" / "model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "model.safetensors")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-4), key
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


def test_a_run_sigkilled_during_a_checkpoint_write_resumes_to_the_uninterrupted_weights(tiny_files, tmp_path):
    """SIGKILL while a `.tmp-step-N` checkpoint is being written; the same command then finishes the run."""
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    target, refs = tiny_files

    def command(out: Path) -> list[str]:
        return [sys.executable, str(EXAMPLE), "--target", str(target), "--data", str(refs), *TINY,
                "--max-steps", "30", "--save-every", "1", "--batch-size", "1", "--output-dir", str(out)]

    subprocess.run(command(tmp_path / "whole"), check=True, env=env, timeout=300, capture_output=True)
    run = tmp_path / "killed"
    proc = subprocess.Popen(command(run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Wait until a checkpoint after the first is being written (its temporary directory exists), then kill.
        while proc.poll() is None and not any((run / "checkpoints").glob(".tmp-step-0000000[3-9]")):
            time.sleep(0.001)
        proc.kill()
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -9, "the run ended before it could be killed mid-checkpoint"
    done = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert done and done[-1] < "step-00000030" and not (run / "final").exists()

    again = subprocess.run(command(run), env=env, timeout=300, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_from = int(done[-1].split("-")[1])
    assert f"trained {30 - resumed_from} steps (to step 30 of 30)" in again.stdout
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(run / "final" / "model.safetensors")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), key


def test_draft_vocab_size_trains_over_the_most_frequent_response_ids(tiny_files, tmp_path, capsys):
    from collections import Counter

    from hf_treespark.drafter.modeling import TreeSparkDrafter

    assert train(tiny_files, tmp_path / "run", "--max-steps", "2", "--draft-vocab-size", "40") == 0
    assert "[draft vocabulary] 40 ids cover" in capsys.readouterr().out
    drafter = TreeSparkDrafter.from_pretrained(tmp_path / "run" / "final")
    assert drafter.config.draft_vocab_size == 40 and drafter.markov_head.markov_w2.weight.shape[0] == 40
    counts = Counter()
    for ref in load_references(tiny_files[1]):
        counts.update(ref.input_ids[ref.prompt_len:])
    most = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    assert drafter.draft_vocab_ids.tolist()[: min(40, len(most))] == [i for i, _ in most[:40]]
    # A run resumed with the same option rebuilds the same vocabulary and goes on.
    assert train(tiny_files, tmp_path / "run", "--max-steps", "3", "--draft-vocab-size", "40") == 0
    assert "(to step 3 of 3)" in capsys.readouterr().out


def test_a_negative_draft_vocab_size_is_refused(tiny_files, tmp_path, capsys):
    assert train(tiny_files, tmp_path / "run", "--draft-vocab-size", "-5") == 2
    assert "--draft-vocab-size must be >= 0 (got -5)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_bad_replay_anchors_is_refused_before_any_work(tiny_files, tmp_path, capsys):
    assert train(tiny_files, tmp_path / "run", "--loss", '{"replay_anchors": 0}') == 2
    assert "replay_anchors must be a positive number of anchors per sequence" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("loss, message", [
    ('{"survival": 1.0}', "--loss: unknown key(s) survival; the keys are ce, l1, conf, surv, cov"),
    ('{"surv": 1.0', "argument --loss: not valid JSON"),
    ('[1, 2]', "argument --loss: must be a JSON object"),
])
def test_a_bad_loss_option_is_refused_in_one_line_before_any_work(tiny_files, tmp_path, capsys, loss, message):
    try:
        code = train(tiny_files, tmp_path / "run", "--loss", loss)
    except SystemExit as stop:  # argparse's own refusal of the option's value
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_loss_keys_are_the_loss_config_fields():
    from dataclasses import fields

    from hf_treespark.training.objective import LossConfig

    assert train_cli.LOSS_KEYS == tuple(f.name for f in fields(LossConfig))


def test_a_draft_vocab_size_above_the_target_vocabulary_is_refused(tiny_files, tmp_path, capsys):
    vocab = make_target("llama").config.vocab_size
    assert train(tiny_files, tmp_path / "run", "--draft-vocab-size", str(vocab + 1)) == 2
    assert f"--draft-vocab-size {vocab + 1} exceeds the target's vocabulary of {vocab} ids" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--updates-per-batch", "0"], "--updates-per-batch must be at least 1 (got 0)"),
    (["--updates-per-batch", "2", "--grad-accum", "2"], "--updates-per-batch 2 with --grad-accum 2"),
])
def test_bad_updates_per_batch_is_refused_before_any_work(tiny_files, tmp_path, capsys, extra, message):
    assert train(tiny_files, tmp_path / "run", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_normalize_features_sets_statistics_once_and_a_resumed_run_keeps_them(tiny_files, tmp_path, monkeypatch):
    from hf_treespark import TreeSparkDrafter
    from hf_treespark.training.trainer import Trainer

    out = tmp_path / "run"
    assert train(tiny_files, out, "--normalize-features", "--anchor-features", "--max-steps", "2",
                 "--no-feature-cache") == 0
    first = TreeSparkDrafter.from_pretrained(out / "final")
    assert first.config.normalize_features and first.config.anchor_features
    assert torch.count_nonzero(first.feature_mean) > 0 and torch.isfinite(first.feature_scale).all()
    assert not torch.equal(first.feature_scale, torch.ones_like(first.feature_scale))

    calls = []
    real = Trainer.set_feature_statistics
    monkeypatch.setattr(Trainer, "set_feature_statistics", lambda self, *a, **k: calls.append(1) or real(self))
    assert train(tiny_files, out, "--normalize-features", "--anchor-features", "--max-steps", "3",
                 "--no-feature-cache") == 0
    assert calls == []  # resumed: the statistics come from the checkpoint
    resumed = TreeSparkDrafter.from_pretrained(out / "final")
    assert torch.equal(resumed.feature_mean, first.feature_mean)
    assert torch.equal(resumed.feature_scale, first.feature_scale)


@pytest.mark.parametrize(("cuda", "native_bf16", "expected"), [(False, True, "bf16"), (False, False, "no")])
def test_mixed_precision_auto_is_bf16_on_a_cpu_with_native_bf16_only(monkeypatch, tmp_path, cuda, native_bf16,
                                                                       expected):
    from hf_treespark.training import trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    from hf_treespark import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native_bf16)
    assert trainer.mixed_precision(trainer.TrainConfig(output_dir=str(tmp_path))) == expected
    for chosen in ("no", "bf16"):  # an explicit choice is kept
        assert trainer.mixed_precision(trainer.TrainConfig(output_dir=str(tmp_path), mixed_precision=chosen)) == chosen


def test_a_bf16_drafter_trains_from_float32_weights_under_bf16_autocast(tiny_files, tmp_path, capsys):
    """`--init-from` a drafter saved in bf16 (as the shipped one is): its weights train in float32, so small
    AdamW updates are not rounded away, and `--mixed-precision bf16` changes the products, not the weights."""
    from hf_treespark.drafter.modeling import TreeSparkDrafter

    assert train(tiny_files, tmp_path / "first", "--max-steps", "1", "--batch-size", "4") == 0
    start = TreeSparkDrafter.from_pretrained(tmp_path / "first" / "final").to(torch.bfloat16)
    start.save_pretrained(tmp_path / "bf16")
    parser = train_cli.argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(["--init-from", str(tmp_path / "bf16"), "--output-dir", str(tmp_path / "x")])
    drafter = train_cli.build_drafter(args, None)
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    from accelerate.state import AcceleratorState

    losses = {}
    for mode in ("no", "bf16"):
        AcceleratorState._reset_state()  # one precision per process, as in a real run
        out = tmp_path / mode
        assert train(tiny_files, out, "--init-from", str(tmp_path / "bf16"), "--max-steps", "2", "--batch-size", "4",
                     "--mixed-precision", mode) == 0
        losses[mode] = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
        assert torch.isfinite(torch.tensor(losses[mode]))
    assert losses["no"] != losses["bf16"]  # autocast ran the step's products in bf16
    capsys.readouterr()


@pytest.mark.parametrize("option, saved, other", [("--batch-size", "4", "2"), ("--updates-per-batch", "1", "2"),
                                                  ("--seed", "0", "1")])
def test_a_resume_with_another_data_position_setting_is_refused(tiny_files, tmp_path, capsys, option, saved, other):
    """These settings decide which data a step number stands for: resuming under others would skip or repeat
    data silently."""
    base = ["--max-steps", "2", "--batch-size", "4"] if option != "--batch-size" else ["--max-steps", "2"]
    assert train(tiny_files, tmp_path, *base, option, saved) == 0
    capsys.readouterr()
    assert train(tiny_files, tmp_path, *base, option, other) == 2
    key = option.removeprefix("--").replace("-", "_")
    err = capsys.readouterr().err
    assert f"{key} {int(saved)!r} there, {int(other)!r} here" in err and "intact" in err


def test_export_writes_the_checkpoints_drafter_and_refuses_a_damaged_one(tiny_files, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from hf_treespark.drafter.modeling import TreeSparkDrafter

    assert train(tiny_files, tmp_path / "run", "--max-steps", "2", "--draft-vocab-size", "40") == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert "treespark calibrate --drafter" in capsys.readouterr().out
    final = TreeSparkDrafter.from_pretrained(tmp_path / "run" / "final")
    exported = TreeSparkDrafter.from_pretrained(tmp_path / "out")
    assert exported.config.draft_vocab_size == 40 and exported.config.acceptance_profile is None
    assert exported.config.target_name_or_path == final.config.target_name_or_path
    assert final.state_dict().keys() == exported.state_dict().keys()
    assert all(torch.equal(v, exported.state_dict()[k]) for k, v in final.state_dict().items())
    # bf16 by default, like the shipped drafter
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "bf16")]) == 0
    assert TreeSparkDrafter.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16
    # a checkpoint written before drafter_config.json: the architecture comes from trainer_state.json
    (checkpoint / "drafter_config.json").unlink()
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "old"), "--dtype", "float32"]) == 0
    old = TreeSparkDrafter.from_pretrained(tmp_path / "old")
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in final.state_dict().items())
    # an existing output directory is not overwritten
    capsys.readouterr()
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "out")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    # a checkpoint missing a weight is refused, naming it, and nothing is written
    weights = load_file(str(checkpoint / "model.safetensors"))
    del weights["drafter.fc.weight"]
    save_file(weights, str(checkpoint / "model.safetensors"))
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "missing: fc.weight" in err and "nothing was written" in err
    assert not (tmp_path / "bad").exists()
    (checkpoint / "model.safetensors").write_bytes(b"not safetensors")
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "bad")]) == 2
    assert "cannot be read" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def _checkpoint_of(drafter, directory: Path) -> Path:
    """A training checkpoint's files for `drafter`, as `Trainer.save_checkpoint` writes them (no training)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    drafter.config.to_json_file(str(directory / "drafter_config.json"))
    save_file({f"drafter.{k}": v.contiguous() for k, v in drafter.state_dict().items()},
              str(directory / "model.safetensors"))
    (directory / "trainer_state.json").write_text(json.dumps({"step": 1, "drafter_config": {}}))
    return directory


def _edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("damage, file, message", [
    (lambda c: (c / "drafter_config.json").write_text('{"markov_rank": 1'), "drafter_config.json",
     "cannot be read as a drafter config .*Expecting"),
    (lambda c: (c / "drafter_config.json").write_bytes(b"\xff\xfe"), "drafter_config.json",
     "cannot be read as a drafter config .*can't decode byte 0xff"),
    (lambda c: (c / "drafter_config.json").write_text("[1, 2]"), "drafter_config.json", "holds a JSON list"),
    (lambda c: _edit_json(c / "drafter_config.json", markov_rank=-4), "drafter_config.json",
     "does not hold a valid drafter config .*markov_rank=-4"),
    (lambda c: ((c / "drafter_config.json").unlink(), (c / "trainer_state.json").write_text('{"drafter_config": 3}')),
     "trainer_state.json", "has no drafter_config object"),
    (lambda c: ((c / "drafter_config.json").unlink(), (c / "trainer_state.json").write_text("{")),
     "trainer_state.json", "cannot be read as a training checkpoint's state"),
])
def test_export_names_the_damaged_json_file_and_what_is_wrong(tmp_path, capsys, damage, file, message):
    """A damaged drafter_config.json used to give the JSON parser's message alone (or a TypeError traceback)."""
    from conftest import make_drafter

    checkpoint = _checkpoint_of(make_drafter(make_target("llama")), tmp_path / "step-00000001")
    damage(checkpoint)
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"treespark: error: {checkpoint / file}")
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_damaged_draft_vocabulary_naming_the_weights_file(tmp_path, capsys):
    from conftest import make_drafter
    from safetensors.torch import load_file, save_file

    drafter = make_drafter(make_target("llama")).restrict_vocabulary(list(range(40, 80)))
    checkpoint = _checkpoint_of(drafter, tmp_path / "step-00000001")
    weights = load_file(checkpoint / "model.safetensors")
    weights["drafter.draft_vocab_ids"][5] = 40  # a repeated id
    save_file(weights, checkpoint / "model.safetensors")
    assert cli.main(["export", str(checkpoint), "--output", str(tmp_path / "out")]) == 2
    assert (f"{checkpoint / 'model.safetensors'} holds a damaged draft_vocab_ids buffer (id 40 appears 2 times)"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_draft_layers_above_an_init_from_drafter_grow_it_without_changing_its_drafts(tiny_files, tmp_path, capsys):
    from hf_treespark.decoding.engine import target_features
    from hf_treespark.drafter.modeling import TreeSparkDrafter

    assert train(tiny_files, tmp_path / "one", "--max-steps", "2") == 0
    small = TreeSparkDrafter.from_pretrained(tmp_path / "one" / "final")
    assert small.config.num_hidden_layers == 1
    # the grown drafter drafts what the trained one drafts, before any step
    target = make_target("llama")
    grown = TreeSparkDrafter.from_pretrained(tmp_path / "one" / "final")
    train_cli.grow_layers(grown, 3)
    assert grown.config.num_hidden_layers == 3 and len(grown.layers) == 3
    for layer in grown.layers[1:]:
        assert torch.count_nonzero(layer.self_attn.o_proj.weight) == 0
        assert torch.count_nonzero(layer.mlp.down_proj.weight) == 0
        assert torch.count_nonzero(layer.self_attn.q_proj.weight) > 0
    ids = torch.randint(4, 100, (1, 12))
    feats, _ = target_features(target, small.config.target_layer_ids, ids, torch.ones_like(ids))
    kwargs = dict(anchor_ids=ids[:, 10:11], anchor_positions=torch.tensor([[10]]), target_features=feats[:, :10],
                  context_positions=torch.arange(10)[None])
    with torch.no_grad():
        assert torch.equal(small.bind_target(target)(**kwargs).depth_logits,
                           grown.bind_target(target)(**kwargs).depth_logits)
    # through the CLI: trains the new layers, saves and loads as a 3-layer drafter
    assert train(tiny_files, tmp_path / "three", "--init-from", str(tmp_path / "one" / "final"),
                 "--draft-layers", "3", "--max-steps", "2") == 0
    trained = TreeSparkDrafter.from_pretrained(tmp_path / "three" / "final")
    assert trained.config.num_hidden_layers == 3
    assert torch.count_nonzero(trained.layers[2].self_attn.o_proj.weight) > 0
    # resuming that run without --draft-layers is refused, naming the difference
    capsys.readouterr()
    assert train(tiny_files, tmp_path / "three", "--init-from", str(tmp_path / "one" / "final"),
                 "--max-steps", "3") == 2
    assert "num_hidden_layers 3 there, 1 here" in capsys.readouterr().err
    # a drafter cannot shrink
    assert train(tiny_files, tmp_path / "shrink", "--init-from", str(tmp_path / "three" / "final"),
                 "--draft-layers", "2", "--max-steps", "1") == 2
    assert "a drafter can grow, not shrink" in capsys.readouterr().err


def test_a_rerun_says_in_words_that_it_resumed_and_from_which_step(tiny_files, tmp_path, capsys):
    assert train(tiny_files, tmp_path, "--max-steps", "2", "--batch-size", "4") == 0
    assert "resumed" not in capsys.readouterr().out
    assert train(tiny_files, tmp_path, "--max-steps", "3", "--batch-size", "4") == 0
    out = capsys.readouterr().out
    assert f"[train] resumed from {tmp_path / 'checkpoints' / 'step-00000002'} at step 2 of 3" in out


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        train_cli.main(["--help"], prog="train_drafter.py")
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: auto) (default: auto)" not in text
    assert text.count("(default: auto)") == 1  # --mixed-precision


def test_a_plain_causal_lm_given_as_init_from_is_refused_in_one_paragraph(tiny_files, tmp_path, capsys):
    """A plain model's directory used to pass as a drafter config and end in a load report of 24-28 KB."""
    target, _ = tiny_files
    assert train(tiny_files, tmp_path / "run", "--init-from", str(target), "--max-steps", "1") == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and len(err) < 700 and len(captured.out) < 200, err
    assert f"--init-from {target} holds a llama model (LlamaForCausalLM), not a TreeSpark drafter" in err
    assert f"--target {target}" in err
    assert not (tmp_path / "run").exists()
