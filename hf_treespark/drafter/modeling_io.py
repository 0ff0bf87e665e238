"""Saving and loading a drafter: what `save_pretrained` writes beside the weights, what `from_pretrained` refuses.

A drafter directory is a transformers checkpoint (`config.json`, `model.safetensors`, this package's modeling files
as remote code) plus, when the package is installed, a model card and `custom_generate/` (`card.py`), and the
drafter's datastore (`datastore.safetensors`) when it carries one. Weights are saved in the dtype they were loaded
from when that loses nothing, so a bfloat16 checkpoint loaded as float32 and saved again stays bfloat16.

Loading refuses what would decode wrongly without saying so: missing, unexpected or misshaped weights, a damaged
`draft_vocab_ids`, NaN or inf values. It then re-aligns tensors read from the file (`_align_tensors`), so that a
reloaded drafter computes bit for bit what it computed when it was saved.

This file imports only torch, transformers and the drafter's own modules: it ships beside `modeling.py` as remote
code. What the package adds to a save and a push (the model card, `custom_generate/`: `hub.card`) is handed to it
by `import hf_treespark` (`use_sharing`); loaded as remote code, a save writes the checkpoint alone.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager

import torch
from torch import nn

from ..sources.datastore import DATASTORE_FILE, Datastore
from .configuration import TreeSparkConfig
from .modeling_binding import draft_vocab_problem
from .remote_code import write_flat

_SHARING = None  # `hub.card` once `import hf_treespark` has run `use_sharing`; None as remote code


def use_sharing(card) -> None:
    """Give saves and pushes the package's card module (`save_and_push`, `write_custom_generate`, `write_card`,
    `push_drafter`): `hf_treespark/__init__.py` calls this, so the drafter never imports the hub layer above it."""
    global _SHARING
    _SHARING = card


class DrafterSaving:
    """`save_pretrained`, `push_to_hub` and `from_pretrained` of `TreeSparkDrafter` (mixed into it, before
    `PreTrainedModel`, whose methods these extend)."""

    def save_pretrained(self, save_directory, *args, dtype: torch.dtype | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a model card (`README.md`) when the directory has none and the
        drafter's datastore (`datastore.safetensors`) when it carries one.

        `push_to_hub=True` saves, then uploads what was written and the card (`card.save_and_push`).
        The weights are written in `dtype`; by default in the dtype they were loaded from (a bfloat16
        checkpoint loaded as float32 is saved as bfloat16 again) when that loses nothing, else in the
        model's own dtype.

        Raises `OSError` (errno `ENOSPC`, the writer's error chained) naming the directory, the bytes the save
        needs and the bytes free there when the disk fills up; every other error as it comes.
        """
        card = _SHARING  # None as remote code, without the package: no card, no custom_generate/
        if card is not None and kwargs.pop("push_to_hub", False):
            return card.save_and_push(self, save_directory, *args, dtype=dtype, **kwargs)
        dtype = dtype or self._lossless_stored_dtype()
        try:
            return self._save_files(save_directory, card, dtype, *args, **kwargs)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, self._disk_full_message(save_directory, dtype)) from err

    def _save_files(self, save_directory, card, dtype: torch.dtype | None, *args, **kwargs):
        """What `save_pretrained` writes (`card`: the package's `hf_treespark.hub.card`, or None as remote code)."""
        os.makedirs(save_directory, exist_ok=True)
        if card is not None:
            card.write_custom_generate(save_directory)
            card.write_card(save_directory, self)
        if self.datastore is not None:
            self.datastore.save(save_directory)
        with self._remote_code_written_flat(save_directory, in_package=card is not None):
            if dtype is None or dtype == self.dtype:
                return super().save_pretrained(save_directory, *args, **kwargs)
            # Swap every weight for a `dtype` copy while saving (config.json records it too), then put the
            # original tensors back: the drafter in memory is not rounded.
            params = [p for p in self.parameters() if p.is_floating_point()]
            originals = [p.data for p in params]
            try:
                for p in params:
                    p.data = p.data.to(dtype)
                return super().save_pretrained(save_directory, *args, **kwargs)
            finally:
                for p, data in zip(params, originals, strict=True):
                    p.data = data
                self.config.dtype = self.dtype

    @contextmanager
    def _remote_code_written_flat(self, save_directory, in_package: bool):
        """Around `PreTrainedModel.save_pretrained`: the drafter's modules written as flat remote code
        (`remote_code.write_flat`) instead of transformers' copy, which follows single-dot imports only and so cannot
        read the package's subpackages. As remote code (`in_package` False) the modules are flat already and
        transformers copies them as it loaded them."""
        cls = type(self)
        if not in_package or cls._auto_class is None:
            yield
            return
        auto_class = cls._auto_class
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}),
                                auto_class: f"{cls.__module__.split('.')[-1]}.{cls.__name__}"}
        cls._auto_class = None  # for the save only: transformers then skips its copy (`is_remote_code`)
        try:
            yield
        finally:
            cls._auto_class = auto_class
        write_flat(save_directory, *(_in_package(c.__module__) for c in (cls, type(self.config))))

    def push_to_hub(self, repo_id: str, *, acceptance_table: str | None = None, **options):
        """Upload the drafter as `treespark push` does (`hf_treespark.hub.card.push_drafter`): its TreeSpark model card,
        the weights, remote code, `custom_generate/` and the datastore. `options` are `PushToHubMixin.push_to_hub`'s
        (`commit_message`, `private`, `token`, `revision`, `create_pr`, `commit_description`, `max_shard_size`,
        `tags`); `acceptance_table` is a measured table for a new card, as for `treespark push`.

        Raises `ValueError` naming `repo_id` when it is not a repository name (None, empty, not a string), before
        anything is saved or sent."""
        check_repo_id(repo_id, "push_to_hub")
        if _SHARING is None:  # loaded as remote code, without the package: transformers' own upload
            return super().push_to_hub(repo_id, **options)
        return _SHARING.push_drafter(self, repo_id, acceptance_table=acceptance_table, **options)

    def _disk_full_message(self, save_directory, dtype: torch.dtype | None) -> str:
        """What a save into `save_directory` that filled the disk needed (the weights in `dtype`, else their own,
        and the datastore's tensors), what is free there, and what to do."""
        weights = sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
                      for t in self.state_dict().values())
        store = _datastore_bytes(self.datastore)
        directory = os.path.abspath(save_directory)
        free = _free_bytes(directory)
        parts = f" ({_size(weights)} of weights, {_size(store)} of datastore)" if store else ""
        message = (f"No space left on the disk of {directory}: saving the drafter there needs {_size(weights + store)}"
                   f"{parts}, and {'an unknown number of bytes' if free is None else _size(free)} are free there. "
                   "Free space on that disk, or save to another directory.")
        if _is_staging(directory):
            message += (" A push stages the drafter in a temporary directory like this one first: set TMPDIR to a "
                        "directory on a disk with room.")
        return message

    def _lossless_stored_dtype(self) -> torch.dtype | None:
        """The dtype of the checkpoint this drafter was loaded from, if every weight is still exact in it."""
        stored = self.__dict__.get("_stored_dtype")
        if stored is None or stored == self.dtype:
            return None
        exact = all(torch.equal(p, p.to(stored).to(p.dtype)) for p in self.parameters() if p.is_floating_point())
        return stored if exact else None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing checkpoints with missing, unexpected or misshaped weights."""
        want_info = kwargs.pop("output_loading_info", False)
        name = os.fspath(pretrained_model_name_or_path)
        if name.startswith((os.sep, ".", "~")) and not os.path.isdir(os.path.expanduser(name)):
            raise OSError(f"No TreeSpark drafter directory at {name!r}: check the path (a Hub repo id looks like "
                          "'org/name').")
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  **kwargs)
        except Exception as err:  # corrupted safetensors raise their own error types
            raise OSError(f"Could not load a TreeSpark drafter from {pretrained_model_name_or_path!r}: {err}") from err
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise OSError(f"Refusing the TreeSpark drafter checkpoint at {pretrained_model_name_or_path!r}: it does "
                          f"not match its config ({bad}). The file is incomplete or from another model.")
        weights = _weights_path(name, kwargs)
        problem = None if model.draft_vocab_ids is None else draft_vocab_problem(model.draft_vocab_ids,
                                                                                 model.config.target_vocab_size)
        if problem is not None:
            raise OSError(f"Refusing the TreeSpark drafter checkpoint {weights}: its draft_vocab_ids buffer is "
                          f"damaged ({problem}): the file was cut or edited. Use an intact copy of the drafter.")
        nonfinite = nonfinite_tensors(model)
        if nonfinite:
            raise ValueError(f"Refusing the TreeSpark drafter checkpoint {weights}: NaN or inf values in "
                             f"{', '.join(nonfinite)}. Training diverged or the file was damaged: retrain the "
                             "drafter, or re-save it from a copy whose weights are finite.")
        model.__dict__["_stored_dtype"] = _stored_dtype(pretrained_model_name_or_path, kwargs)
        model.datastore = _load_datastore(pretrained_model_name_or_path, kwargs, model.config)
        _align_tensors(model)
        return (model, info) if want_info else model


def _datastore_bytes(datastore) -> int:
    """The bytes of `datastore`'s tensors as `Datastore.save` writes them (token ids in 16 bits below a vocabulary
    of 65535, else 32); 0 for None."""
    index = getattr(datastore, "index", None)
    if index is None:
        return 0
    token_bytes = 2 if datastore.vocab_size < 65535 else 4
    return int(index.tokens.size) * token_bytes + int(index.positions.nbytes)


def _free_bytes(directory: str) -> int | None:
    """The bytes free on the disk of `directory` (or of its nearest existing parent); None where that cannot be
    read."""
    path = directory
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _is_staging(directory: str) -> bool:
    """Whether `directory` looks like a `tempfile.TemporaryDirectory` (a push's staging directory): a `tmp*` folder
    right inside the temporary directory."""
    path = os.path.realpath(directory)
    return (os.path.dirname(path) == os.path.realpath(tempfile.gettempdir())
            and os.path.basename(path).startswith("tmp"))


def _size(count: int) -> str:
    """`count` bytes, with its size in the largest binary unit below it when that is KiB or more."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count} bytes ({count / scale:.1f} {unit})"
    return f"{count} bytes"


def check_repo_id(repo_id, caller: str) -> str:
    """`repo_id` when it is a non-empty string (the Hub judges its form); else `ValueError` naming `caller`'s
    `repo_id` and what to pass."""
    if isinstance(repo_id, str) and repo_id.strip():
        return repo_id
    raise ValueError(f"{caller} needs repo_id, the Hub repository to upload to: pass 'org/name' (or 'name' for one "
                     f"under your own account); got {repo_id!r}")


def nonfinite_tensors(model: nn.Module, limit: int = 8) -> list[str]:
    """The floating-point tensors of `model`'s state dict that hold NaN or inf, each as `"name (n NaN, m inf)"`;
    at most `limit` named, then how many more."""
    found = []
    for key, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            found.append(f"{key} ({', '.join(f'{n} {what}' for n, what in ((nan, 'NaN'), (inf, 'inf')) if n)})")
    return found if len(found) <= limit else [*found[:limit], f"{len(found) - limit} more tensors"]


TENSOR_ALIGNMENT = 64  # bytes: what torch's CPU allocator gives every fresh tensor


@torch.no_grad()
def _align_tensors(model: nn.Module) -> None:
    """Copy each CPU parameter and buffer that does not start on a `TENSOR_ALIGNMENT` boundary into fresh storage.

    Weights read from a safetensors file can sit at any 4-byte offset of it, and BLAS kernels round
    differently at different alignments (a linear layer's output moved by an ulp): a reloaded drafter
    would not compute bit for bit what it computed when it was saved. Aligned, it does.
    """
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.device.type == "cpu" and tensor.data_ptr() % TENSOR_ALIGNMENT:
                tensor.data = tensor.data.clone()


def _hub_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                   "subfolder", "proxies") if k in kwargs}


def _weights_path(name: str, kwargs: dict) -> str:
    """The weights file of a local checkpoint (`model.safetensors`, or the index of its shards); else `name`."""
    if not os.path.isdir(name):
        return name
    single = os.path.join(name, kwargs.get("subfolder") or "", "model.safetensors")
    index = single + ".index.json"
    return index if not os.path.isfile(single) and os.path.isfile(index) else single


def _load_datastore(name, kwargs: dict, config: TreeSparkConfig) -> Datastore | None:
    """The drafter's `datastore.safetensors` (a directory's or a Hub repo's), or None where it has none. A damaged
    file or one built for another vocabulary raises `DatastoreError` naming it."""
    if os.path.isdir(name):
        path = os.path.join(name, kwargs.get("subfolder") or "", DATASTORE_FILE)
        path = path if os.path.isfile(path) else None
    else:
        from transformers.utils import cached_file

        try:
            path = cached_file(name, DATASTORE_FILE, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False, **_hub_kwargs(kwargs))
        except OSError:
            path = None
    if path is None:
        return None
    return Datastore.load(path, vocab_size=config.target_vocab_size, grow_tokens=config.datastore_grow_tokens)


def _stored_dtype(name, kwargs: dict) -> torch.dtype | None:
    """The weights' dtype recorded in a checkpoint's `config.json` (`dtype`, formerly `torch_dtype`), if any."""
    try:
        config_dict, _ = TreeSparkConfig.get_config_dict(name, **_hub_kwargs(kwargs))
    except (OSError, ValueError):
        return None
    value = config_dict.get("dtype") or config_dict.get("torch_dtype")
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _in_package(module: str) -> str:
    """`"hf_treespark.drafter.modeling"` -> `"drafter.modeling"`."""
    return module.split(".", 1)[1]
