"""The README's main job: `treespark generate` on the offline default target with the shipped drafter."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import hf_treespark
from hf_treespark import assets
from hf_treespark.cli import main


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
                           ("bench", "(default: bench_results)"), ("demo", "(default: 7860)")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert shown in capsys.readouterr().out, command


def test_push_uploads_the_drafter_with_its_card_without_network(tmp_path, monkeypatch, capsys):
    from conftest import make_drafter, make_target
    from huggingface_hub import HfApi

    from hf_treespark.hub import save_drafter

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
    assert "uploaded to https://hub.example/org/tiny-drafter/commit/1" in capsys.readouterr().out

    calls.clear()
    assert main(["push", "--drafter", str(tmp_path / "nothing"), "--repo-id", "org/x"]) == 2
    assert "--drafter" in capsys.readouterr().err
    assert main(["push", "--drafter", str(drafter_dir), "--repo-id", "org/x/y"]) == 2
    assert "--repo-id 'org/x/y' is not a Hub repository id" in capsys.readouterr().err
    assert calls == []  # nothing was uploaded
