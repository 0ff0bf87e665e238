"""What a TreeSpark `generate()` call accepts: refusals by name, and the per-call knobs resolved.

Apart from the decoding loop so that a reader of `generation.py` sees the loop, not the input validation: every
check here raises a one-line error that names the argument and what to do, before the target runs a forward; the
`resolve_*` functions turn `tree_*` arguments into the policy, datastore and sources a session takes (the gate
threshold: `controller.resolve_gate`).
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig

from ..core.tree import TreePolicy
from ..sources.datastore import DATASTORE_FILE, Datastore, DatastoreError


def resolve_policy(drafter, tree_budget=None, tree_topk=None, tree_depth=None, tree_frontier=None,
                   tree_chain=False, tree_lookup=None) -> TreePolicy:
    """The drafter config's tree policy, overridden by the per-call knobs (`TreePolicy.from_config`)."""
    return TreePolicy.from_config(drafter.config, budget=tree_budget, topk=tree_topk, depth=tree_depth,
                                  frontier=tree_frontier, chain=tree_chain, lookup=tree_lookup,
                                  vocab_size=drafter.draft_vocab_size)


def real_scalar(value) -> float | None:
    """`value` as a float when it is one real number (Python, numpy, or a 0-d torch tensor), else None: bools,
    strings, complex numbers and tensors with dimensions are not."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


_loaded_datastores: dict[tuple[str, float], Datastore] = {}  # by path and modification time


def resolve_sources(tree_sources) -> dict:
    """`tree_sources`: `{name: value}` of registered branch sources for this call (`sources.base.register_source`;
    each factory decides from `value` whether it takes part), or None. Raises `ValueError` for anything else."""
    if tree_sources is None:
        return {}
    if not isinstance(tree_sources, dict) or not all(isinstance(name, str) for name in tree_sources):
        raise ValueError(f"tree_sources={tree_sources!r:.60} is invalid: give a dict of registered source names to "
                         "their values, e.g. tree_sources={'my_source': True}")
    if "datastore" in tree_sources:
        raise ValueError("tree_sources names 'datastore': choose the datastore with tree_datastore=...")
    return dict(tree_sources)


def resolve_datastore(drafter, tree_datastore=None) -> Datastore | None:
    """The datastore whose branches join this call's rounds (`datastore.py`), or None.

    `None`: the drafter's own (`drafter.datastore`, loaded with it) when its config's `tree_datastore` is on;
    `False`: none; `True`: the drafter's own, which must exist; a `Datastore`, or the directory or file of one
    (loaded once per process). Raises `ValueError` naming the knob for anything else and for a datastore built
    for another vocabulary (a `DatastoreError`, naming the file, for a damaged one)."""
    own = getattr(drafter, "datastore", None)
    vocab = drafter.config.target_vocab_size
    if tree_datastore is None:
        return own if getattr(drafter.config, "tree_datastore", True) else None
    if isinstance(tree_datastore, (bool, np.bool_)):
        if tree_datastore and own is None:
            raise ValueError("tree_datastore=True, but this drafter carries no datastore: build one with `treespark "
                             "datastore --data FILES --output DRAFTER_DIR`, or pass a Datastore or its directory")
        return own if tree_datastore else None
    if isinstance(tree_datastore, (str, os.PathLike)):
        path = Path(tree_datastore)
        path = path / DATASTORE_FILE if path.is_dir() else path
        key = (str(path.resolve()), path.stat().st_mtime if path.is_file() else 0.0)
        if key not in _loaded_datastores:
            try:
                _loaded_datastores[key] = Datastore.load(path, vocab_size=vocab)
            except DatastoreError as err:
                raise DatastoreError(f"tree_datastore={os.fspath(tree_datastore)!r}: {err}") from None
        return _loaded_datastores[key]
    if isinstance(tree_datastore, Datastore):
        if tree_datastore.vocab_size != vocab:
            raise ValueError(f"tree_datastore: this datastore was built for a vocabulary of {tree_datastore.vocab_size}"
                             f" ids, the drafter's target has {vocab}: build one from this target's outputs")
        return tree_datastore
    raise ValueError(f"tree_datastore={tree_datastore!r:.60} is invalid: use True/False, a Datastore, or the "
                     "directory of one")


def check_supported(model, drafter, input_ids: torch.Tensor, generation_config: GenerationConfig) -> None:
    """Refuse what TreeSpark decoding cannot do, saying what to do instead."""
    if getattr(getattr(drafter, "config", None), "model_type", None) != "treespark":
        raise TypeError(f"expected a TreeSpark drafter, got {type(drafter).__name__}")
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in impl:
        raise ValueError(f"TreeSpark verification needs a 4D tree attention mask, which attn_implementation="
                         f"{impl!r} cannot take. Load the target with attn_implementation='sdpa' or 'eager'.")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("TreeSpark decoding does not do beam search: drop num_beams or the assistant_model.")
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError("TreeSpark decoding returns one sequence per prompt: drop num_return_sequences or "
                         "the assistant_model.")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("TreeSpark decoding supports decoder-only targets.")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {list(input_ids.shape)}): TreeSpark decoding needs at least one "
                         "prompt token per row.")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise ValueError(f"input_ids has dtype {input_ids.dtype}: token ids must be integers (torch.long), as the "
                         "tokenizer returns them.")
    vocab = model.get_input_embeddings().weight.shape[0]
    top = int(input_ids.max())
    if top >= vocab or int(input_ids.min()) < 0:
        bad = top if top >= vocab else int(input_ids.min())
        raise ValueError(f"input_ids holds token id {bad}, outside the target's vocabulary [0, {vocab}): "
                         "tokenize with the target's own tokenizer.")


def check_arguments(generation_config: GenerationConfig, model_kwargs: dict) -> None:
    """Refuse, by name, what plain `generate` takes but TreeSpark decoding would not read or return."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("TreeSpark decoding does not take inputs_embeds: the drafter and its lookup branches draft "
                         "from token ids. Pass input_ids (the tokenized prompt) instead, or drop the assistant_model.")
    outputs = {"output_attentions": "attentions", "output_hidden_states": "hidden states"}
    asked = [flag for flag in outputs if getattr(generation_config, flag, None)]
    if asked and generation_config.return_dict_in_generate:
        flags = ", ".join(f"{flag}=True" for flag in asked)
        raise ValueError(f"TreeSpark decoding does not return {' or '.join(outputs[f] for f in asked)} ({flags}): its "
                         f"target forwards run over drafted trees, not the committed text. Drop it; for those tensors, "
                         f"run the target once over out.sequences with {flags}.")


def check_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                generation_config: GenerationConfig, streamer) -> torch.Tensor:
    """The batch's attention mask (`[B, T]`, long), after refusing what batched decoding cannot take: a mask of
    another shape or with values other than 0 and 1, right padding, a row of padding only; streamers and scores
    (per-step tensors of the whole batch, which rows that advance by several tokens a round do not have)."""
    rows, length = input_ids.shape
    if streamer is not None:
        raise ValueError(f"streamer: streaming needs batch size 1 (got {rows} rows), as transformers' streamers do. "
                         "Drop the streamer, or generate one prompt at a time to stream it.")
    asked = [flag for flag in ("output_scores", "output_logits") if getattr(generation_config, flag, False)]
    if asked:
        raise ValueError(f"{', '.join(f'{flag}=True' for flag in asked)} is supported at batch size 1 only (got "
                         f"{rows} rows): drop it, or generate one prompt at a time for per-step scores.")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (rows, length):
        shape = (list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                 else type(attention_mask).__name__)
        raise ValueError(f"attention_mask has shape {shape} but input_ids has [{rows}, {length}]: pass the mask the "
                         "tokenizer returned with these ids.")
    mask = attention_mask.long()
    if not bool(((mask == 0) | (mask == 1)).all()) or (attention_mask.dtype.is_floating_point
                                                       and not torch.equal(attention_mask.float(), mask.float())):
        raise ValueError("attention_mask holds values other than 0 and 1: pass the tokenizer's mask (1 = token, "
                         "0 = padding).")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        bad = int((mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"row {bad} of the batch is right-padded (attention_mask zeros after tokens): TreeSpark "
                         "decoding, like plain decoder-only generation, needs left padding; load the tokenizer with "
                         "padding_side='left'.")
    if not bool(mask[:, -1].all()):
        bad = int((mask[:, -1] == 0).nonzero()[0, 0])
        raise ValueError(f"row {bad} of the batch is all padding (attention_mask is 0 everywhere): give every row at "
                         "least one prompt token.")
    return mask


def left_padding(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> int:
    """Number of left-padding positions (batch size 1); other padding is refused."""
    if attention_mask is None or bool(attention_mask.all()):
        return 0
    keep = attention_mask[0].bool()
    num_pad = int(keep.nonzero()[0, 0]) if keep.any() else input_ids.shape[1]
    if not bool(keep[num_pad:].all()):
        raise ValueError("TreeSpark decoding supports left padding only (attention_mask zeros at the start).")
    return num_pad


def empty_cache(model_kwargs: dict) -> DynamicCache | None:
    """The caller's `DynamicCache` if it passed one (it must be empty), else None (the session makes one)."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if not isinstance(cache, DynamicCache):
        return None
    if cache.get_seq_length() > 0:
        raise ValueError("TreeSpark decoding starts from an empty cache; do not pass a filled cache.")
    return cache
