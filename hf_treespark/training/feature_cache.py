"""The feature cache of `treespark train`: the target's features of each reference sequence, computed once.

A training step needs, per reference, the hidden states of `target_layer_ids` and the target's final hidden state
(from which the reference distributions are rebuilt with the frozen LM head). With `--feature-cache DIR` they are
computed once (`fill_feature_cache`, batched) and read back every epoch; each file carries the signature of the
target and layers it was computed with, and a sequence digest, so a cache of another target, other layers or
other data is refused (`FeatureCacheMismatch`) instead of training on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..decoding.engine import target_features
from .data import collate_references

logger = logging.getLogger(__name__)


def _sequence_digest(input_ids: list[int]) -> str:
    """A short fingerprint of a sequence's token ids (the cache's key is only the sequence id)."""
    return hashlib.sha1(json.dumps(input_ids).encode()).hexdigest()[:16]


def cache_signature(target, layer_ids: list[int]) -> dict[str, str]:
    """What every cached file of one run shares: the target's shape, the feature layers and the stored dtype.

    Written into each file's safetensors metadata next to the sequence's own length and token fingerprint, so a
    cache directory shared by runs with other settings is caught instead of read as if it fitted.
    """
    cfg = target.config
    shape = f"{cfg.model_type} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size}"
    return {"target": shape, "target_layer_ids": ",".join(str(i) for i in layer_ids), "dtype": "bfloat16"}


# What a differing metadata field means for the user, and which setting to look at.
_CACHE_FIELD_HINTS = {
    "num_tokens": "sequence length in tokens (another --max-length or other --data)",
    "token_ids": "token ids (other --data under the same sequence ids, or another --max-length)",
    "target": "target model",
    "target_layer_ids": "target layers (the drafter's target_layer_ids)",
    "dtype": "stored dtype",
}


class FeatureCacheMismatch(ValueError):
    """A cached file was written for other settings than this run's (sequence length, data, target, layers)."""


class FeatureCache:
    """Target features per reference sequence on disk (`<id>.safetensors`, bf16), written once, read each epoch.

    Each file records in its metadata what it holds (`num_tokens`, a `token_ids` fingerprint, and the run-wide
    `signature`: target shape, target layers, dtype). `status` compares that with what a run needs; a file
    written for other settings raises `FeatureCacheMismatch` naming the directory and the setting that differs.
    """

    def __init__(self, directory: str | Path, signature: dict[str, str] | None = None):
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"feature cache {self.directory} is a file, not a directory: give --feature-cache "
                                     "a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.signature = dict(signature or {})

    def path(self, seq_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in seq_id)
        return self.directory / f"{safe}.safetensors"

    def has(self, seq_id: str) -> bool:
        return self.path(seq_id).is_file()

    def metadata(self, ref) -> dict[str, str]:
        """The metadata a file for reference `ref` must carry under this cache's signature."""
        return {**self.signature, "num_tokens": str(len(ref.input_ids)), "token_ids": _sequence_digest(ref.input_ids)}

    def status(self, ref) -> str:
        """`"ok"`, `"missing"` or `"damaged"` (unreadable: recompute it) for reference `ref`'s file.

        Raises `FeatureCacheMismatch` when the file is readable but was written for other settings. Files from
        before metadata was recorded are checked by their row count only.
        """
        path = self.path(ref.id)
        if not path.is_file():
            return "missing"
        try:
            with safe_open(str(path), "pt") as f:
                stored = f.metadata() or {}
                rows = f.get_slice("features").get_shape()[0]
        except Exception:  # safetensors raises its own error type for a cut-off or garbled file
            return "damaged"
        if not stored:
            stored = {"num_tokens": str(rows)}
        wanted = self.metadata(ref)
        for key in wanted:  # a fixed order: the run-wide settings first, then the sequence's length
            value = stored.get(key, wanted[key])
            if value != wanted[key]:
                raise FeatureCacheMismatch(
                    f"feature cache {self.directory} was filled with other settings: {path.name} holds "
                    f"{_CACHE_FIELD_HINTS.get(key, key)} {value!r}, this run needs {wanted[key]!r}. Give this run "
                    "its own --feature-cache directory (one per --max-length, data and target), or delete "
                    f"{self.directory} to recompute it.")
        return "ok"

    def put(self, ref, features: torch.Tensor, reference_hidden: torch.Tensor) -> None:
        """Store `features` `[T, n_layers * d]` and `reference_hidden` `[T, d]` of `ref` (atomically: tmp + rename)."""
        tmp = self.path(ref.id).with_suffix(".tmp")
        save_file({"features": features.to(torch.bfloat16).contiguous(),
                   "reference_hidden": reference_hidden.to(torch.bfloat16).contiguous()}, str(tmp),
                  metadata=self.metadata(ref))
        tmp.replace(self.path(ref.id))

    def get(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.path(seq_id)
        try:
            data = load_file(str(path))
        except Exception as err:
            raise RuntimeError(f"feature cache file {path} cannot be read ({err}): delete it and start the run "
                               "again; it is recomputed and training resumes from the last checkpoint") from err
        return data["features"].float(), data["reference_hidden"].float()


def fill_feature_cache(cache: FeatureCache, target, layer_ids, references, batch_size: int = 8,
                       progress: bool = True) -> None:
    """Compute and store target features for every reference not yet cached (resumable).

    Unreadable files (a crash or a full disk mid-write) are recomputed with a warning naming them; files written
    for other settings raise `FeatureCacheMismatch` before any training step.
    """
    todo = []
    for ref in references:
        status = cache.status(ref)
        if status == "damaged":
            logger.warning("feature cache file %s is damaged (unreadable); recomputing it", cache.path(ref.id))
        if status != "ok":
            todo.append(ref)
    device = next(target.parameters()).device
    for start in tqdm(range(0, len(todo), batch_size), desc="caching target features", disable=not progress):
        chunk = todo[start : start + batch_size]
        batch = collate_references(chunk, pad_id=0)
        feats, hidden = target_features(target, layer_ids, batch["input_ids"].to(device),
                                        batch["attention_mask"].to(device))
        for row, ref in enumerate(chunk):
            n = len(ref.input_ids)
            cache.put(ref, feats[row, :n].cpu(), hidden[row, :n].cpu())
