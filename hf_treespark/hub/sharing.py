"""Sharing drafters: model cards, saving and pushing to the Hub, DSpark checkpoint conversion.

A TreeSpark drafter directory is what `save_pretrained` writes (`config.json` with an `auto_map`,
`model.safetensors`, and `modeling.py`, `configuration.py` and the modules they import (`modeling_*.py`,
`cpu_gemm.py`, `datastore.py`) as remote code, because `import hf_treespark` registers the classes for auto
classes; `custom_generate/`, the tree decoding loop as a transformers `custom_generate` recipe for users
without the package) plus a `README.md` model card:

    save_drafter(drafter, "my-drafter", acceptance_table=table)
    push_drafter_to_hub(drafter, "me/my-drafter", acceptance_table=table)

DSpark checkpoints (DeepSpec's published layout, e.g. `deepseek-ai/dspark_qwen3_8b_block7`) hold
the same backbone, Markov head and confidence head under the same key names, plus a copy of the
target's `embed_tokens` and `lm_head`, and a Qwen3 config extended with the DSpark fields:

    drafter = load_dspark_checkpoint("dspark_qwen3_8b_block7")       # DSpark -> TreeSpark
    export_dspark_checkpoint(drafter, target, "exported")              # TreeSpark -> DSpark
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..drafter.configuration import TreeSparkConfig
from ..drafter.modeling import TreeSparkDrafter
from ..drafter.modeling_io import check_repo_id
from .card import (  # noqa: F401  (re-exported: the card and custom_generate/ are part of sharing)
    _REPO_ID,
    CARD_NAME,
    CUSTOM_GENERATE_DIR,
    LICENSE,
    PIPELINE_TAG,
    PUSH_COMMIT_MESSAGE,
    REPO_PLACEHOLDER,
    custom_generate_modules,
    hub_target_id,
    model_card,
    push_drafter,
    source_card,
    write_card,
    write_custom_generate,
)

DSPARK_SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")  # the target's, stored by DSpark, bound by us
_IGNORED_KEYS = ("rotary_emb.inv_freq",)  # a derived buffer some exporters store


class DSparkConversionError(ValueError):
    """A DSpark checkpoint or config that cannot become a TreeSpark drafter (or the reverse)."""


# ----- saving and pushing ---------------------------------------------------------------------------
def save_drafter(
    drafter: TreeSparkDrafter,
    save_directory: str | os.PathLike,
    acceptance_table: str | None = None,
    repo_id: str | None = None,
    **kwargs: Any,
) -> Path:
    """`drafter.save_pretrained(save_directory, **kwargs)` plus a `README.md` model card (kept if one exists).

    The directory then holds `config.json` (with `auto_map`), `model.safetensors`, `modeling.py`,
    `configuration.py` and the modules they import (remote code for `trust_remote_code=True`), `custom_generate/` (see
    `write_custom_generate`) and the card. Returns the directory.
    """
    if kwargs.get("push_to_hub"):
        raise ValueError("save_drafter does not push; use push_drafter_to_hub so that the model card is uploaded too")
    _register_for_auto_classes(drafter)
    save_directory = Path(save_directory)
    write_card(save_directory, drafter, acceptance_table, repo_id)  # first: save_pretrained's own has no table
    drafter.save_pretrained(save_directory, **kwargs)
    return save_directory


def _register_for_auto_classes(drafter: TreeSparkDrafter) -> None:
    """`import hf_treespark` does this for the package's classes; a drafter loaded as remote code has its own."""
    if getattr(type(drafter), "_auto_class", None) is None:
        type(drafter).register_for_auto_class("AutoModel")
    if getattr(type(drafter.config), "_auto_class", None) is None:
        type(drafter.config).register_for_auto_class()


def push_drafter_to_hub(
    drafter: TreeSparkDrafter,
    repo_id: str,
    acceptance_table: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = PUSH_COMMIT_MESSAGE,
    **options: Any,
):
    """Save `drafter` with its model card and upload the folder to the Hub repo `repo_id` (`card.push_drafter`,
    which `drafter.push_to_hub` calls too: the same card, metadata and files either way).

    The card is the `README.md` of the directory the drafter was loaded from when it has one (`source_card`:
    a card the user wrote, or the one saved with the drafter's measured tables; its usage snippet is pointed
    at `repo_id`), unless `acceptance_table` is given; else one generated from the drafter's config (its
    `acceptance_profile` included). Creates the repo if needed. `options` are `push_to_hub`'s others
    (`revision`, `create_pr`, `commit_description`, `max_shard_size`, `tags`). Returns `huggingface_hub`'s
    `CommitInfo`. Raises `ValueError` naming `repo_id` when it is not a repository name (None, empty, not a
    string), before anything is saved or sent.
    """
    check_repo_id(repo_id, "push_drafter_to_hub")
    _register_for_auto_classes(drafter)
    return push_drafter(drafter, repo_id, acceptance_table=acceptance_table, private=private, token=token,
                        commit_message=commit_message, **options)


# ----- DSpark configs -------------------------------------------------------------------------------
def dspark_config_to_treespark(dspark_cfg: dict, **overrides: Any) -> TreeSparkConfig:
    """The `TreeSparkConfig` of a DSpark checkpoint's `config.json` (a Qwen3 config plus the DSpark fields).

    Refuses what the TreeSpark drafter does not implement: Markov heads other than `vanilla` or of rank
    0, a confidence head without the Markov features, no `mask_token_id`, embedding-output features
    (`target_layer_ids` containing -1), rotary scaling and sliding-window layers. `overrides` are
    `TreeSparkConfig` fields applied last (e.g. `target_name_or_path`, `tree_budget`).
    """
    c = dspark_cfg

    def need(key: str) -> Any:
        if key not in c or c[key] is None:
            raise DSparkConversionError(f"DSpark config has no {key!r}; it is not a DSpark drafter config")
        return c[key]

    markov_rank = int(c.get("markov_rank", 0))
    if markov_rank <= 0:
        raise DSparkConversionError("DSpark config has markov_rank=0 (a DFlash drafter without Markov head); "
                                    "TreeSpark needs the Markov head")
    head_type = str(c.get("markov_head_type", "vanilla")).lower()
    if head_type != "vanilla":
        raise DSparkConversionError(f"DSpark markov_head_type={head_type!r} is not supported: TreeSpark implements "
                                    "the vanilla Markov head W2(W1[y]) only (no gate_proj / joint_proj weights)")
    enable_conf = bool(c.get("enable_confidence_head", False))
    if enable_conf and not bool(c.get("confidence_head_with_markov", False)):
        raise DSparkConversionError("DSpark confidence_head_with_markov=false is not supported: the TreeSpark "
                                    "confidence head reads [h_k ; W1[y]]")
    if c.get("mask_token_id") is None:
        raise DSparkConversionError("DSpark config has no mask_token_id; DSpark drafters fill the mask slots with "
                                    "embed_tokens[mask_token_id]")
    layer_ids = [int(i) for i in need("target_layer_ids")]
    if any(i < 0 for i in layer_ids):
        raise DSparkConversionError(f"DSpark target_layer_ids={layer_ids} reads the embedding output (-1); "
                                    "TreeSpark reads decoder layer outputs only")
    hidden_act = c.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise DSparkConversionError(f"DSpark hidden_act={hidden_act!r} is not supported (TreeSpark's MLP is SwiGLU)")
    layer_types = c.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise DSparkConversionError(f"DSpark layer_types={layer_types} has non-full attention layers; not supported")

    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise DSparkConversionError(f"DSpark rope type {rope_type!r} is not supported (TreeSpark uses plain RoPE)")
    rope_theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    extra = c.get("treespark") or {}  # written by `export_dspark_checkpoint`; DSpark itself ignores it
    fields = {
        "target_hidden_size": hidden,
        "target_vocab_size": int(need("vocab_size")),
        "target_num_hidden_layers": int(need("num_target_layers")),
        "target_layer_ids": layer_ids,
        # DSpark configs are copies of the target's config, so `_name_or_path` names the target.
        "target_name_or_path": extra.get("target_name_or_path") or c.get("_name_or_path") or None,
        "block_size": int(need("block_size")),
        "mask_token_id": int(c["mask_token_id"]),
        "num_hidden_layers": int(need("num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(c.get("num_key_value_heads") or heads),
        "head_dim": int(c.get("head_dim") or hidden // heads),
        "intermediate_size": int(need("intermediate_size")),
        "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_theta),
        "max_position_embeddings": int(c.get("max_position_embeddings", 32768)),
        "attention_bias": bool(c.get("attention_bias", False)),
        "markov_rank": markov_rank,
        "use_confidence_head": enable_conf,
        "initializer_range": float(c.get("initializer_range", 0.02)),
    }
    fields.update({k: extra[k] for k in ("tree_topk", "tree_frontier", "tree_budget") if k in extra})
    fields.update(overrides)
    return TreeSparkConfig(**fields)


def treespark_config_to_dspark(config: TreeSparkConfig, num_anchors: int = 512) -> dict:
    """The DSpark `config.json` dict (Qwen3 config + DSpark fields) of a TreeSpark config.

    `num_anchors` is DSpark's training-time anchors per sequence (informative for inference). The
    tree policy and target name travel under a `treespark` key that DSpark ignores. A drafter with a
    draft vocabulary is refused: DSpark's Markov head spans the whole vocabulary, and filling the
    missing rows would let it propose tokens the drafter never learned to score.
    """
    if config.draft_vocab_size is not None:
        raise DSparkConversionError(f"this drafter proposes from a draft vocabulary of {config.draft_vocab_size} ids; "
                                    "DSpark checkpoints have none: export the full-vocabulary drafter it was "
                                    "restricted from")
    if config.anchor_features:
        raise DSparkConversionError("this drafter feeds the features of the position before the anchor into its "
                                    "block (anchor_features=True); DSpark drafters are conditioned by KV "
                                    "injection only and have no such projection")
    if config.depth1_head:
        raise DSparkConversionError("this drafter has a depth-1 head (depth1_head > 0) that reads the features of the "
                                    "position before the anchor directly; DSpark drafters have no such head")
    if config.depth2_head:
        raise DSparkConversionError("this drafter has a depth-2 head (depth2_head > 0) that reads the parent drafted "
                                    "at depth 1; DSpark drafters have no such head")
    if config.normalize_features:
        raise DSparkConversionError("this drafter standardises its target features before fc "
                                    "(normalize_features=True); DSpark's fc has no bias to hold the mean")
    if config.mask_token_id is None:
        raise DSparkConversionError("this drafter uses a learned mask embedding (mask_token_id=None); DSpark "
                                    "checkpoints have none and fill the mask slots with embed_tokens[mask_token_id]")
    out = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "vocab_size": config.target_vocab_size,
        "hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "num_target_layers": config.target_num_hidden_layers,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "num_anchors": int(num_anchors),
        "enable_confidence_head": bool(config.use_confidence_head),
        "markov_rank": config.markov_rank,
        "markov_head_type": "vanilla",
        "treespark": {
            "target_name_or_path": config.target_name_or_path,
            "tree_topk": config.tree_topk,
            "tree_frontier": config.tree_frontier,
            "tree_budget": config.tree_budget,
        },
    }
    if config.use_confidence_head:
        out["confidence_head_with_markov"] = True
    return out


# ----- DSpark checkpoints ---------------------------------------------------------------------------
def _read_dspark_dir(path: Path, want_config: bool, want_weights: bool) -> tuple[dict | None, dict | None]:
    from safetensors.torch import load_file

    if not path.is_dir():
        raise OSError(f"{str(path)!r} is not a directory holding a DSpark checkpoint (config.json + model.safetensors)")
    config = None
    if want_config:
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise OSError(f"no config.json in {str(path)!r}")
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise OSError(f"{str(cfg_file)!r} is not valid JSON: {err}") from err
    state_dict = None
    if want_weights:
        single, index = path / "model.safetensors", path / "model.safetensors.index.json"
        if single.is_file():
            files = [single]
        elif index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        else:
            raise OSError(f"no model.safetensors or model.safetensors.index.json in {str(path)!r} (only safetensors "
                          "DSpark checkpoints are read)")
        state_dict = {}
        for file in files:
            try:
                state_dict.update(load_file(file))
            except Exception as err:  # safetensors raises its own error type for truncated or corrupted files
                raise OSError(f"could not read DSpark weights {str(file)!r}: {err}") from err
    return config, state_dict


def load_dspark_checkpoint(
    path_or_dir: str | os.PathLike | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    config: dict | None = None,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> TreeSparkDrafter:
    """A `TreeSparkDrafter` from a DSpark checkpoint (DeepSpec's `Qwen3DSparkModel` layout).

    Reads `config.json` and `model.safetensors` (or the shards of `model.safetensors.index.json`) from
    `path_or_dir`, unless `config` / `state_dict` are given. The stored copies of the target's
    `embed_tokens.weight` / `lm_head.weight` are dropped (the drafter binds to its target); every other
    tensor must match the drafter exactly, by name and shape, or nothing is loaded. `dtype` defaults
    to the checkpoint's. `overrides` are `TreeSparkConfig` fields (e.g. `target_name_or_path`).
    Bind the result with `drafter.bind_target(target)` before use.
    """
    if path_or_dir is None and (state_dict is None or config is None):
        raise ValueError("give a checkpoint directory, or both state_dict and config")
    if path_or_dir is not None and (state_dict is None or config is None):
        read_cfg, read_sd = _read_dspark_dir(Path(path_or_dir), config is None, state_dict is None)
        config = config if config is not None else read_cfg
        state_dict = state_dict if state_dict is not None else read_sd
    where = f" at {str(path_or_dir)!r}" if path_or_dir is not None else ""

    extra_heads = sorted(k for k in state_dict if k.startswith(("markov_head.gate_proj.", "markov_head.joint_proj.")))
    if extra_heads:
        raise DSparkConversionError(f"DSpark checkpoint{where} has a gated/rnn Markov head ({extra_heads[0]}, ...); "
                                    "TreeSpark implements the vanilla Markov head only")
    tcfg = dspark_config_to_treespark(config, **overrides)
    if tcfg.mask_token_id is None:
        raise DSparkConversionError("DSpark drafters need a mask_token_id (they have no learned mask embedding)")
    vocab, hidden = tcfg.target_vocab_size, tcfg.target_hidden_size
    weights = {}
    for key, tensor in state_dict.items():
        if key in DSPARK_SHARED_KEYS:
            if tuple(tensor.shape) != (vocab, hidden):
                raise DSparkConversionError(f"DSpark checkpoint{where}: {key} has shape {tuple(tensor.shape)}, "
                                            f"expected {(vocab, hidden)} from its config")
        elif not key.endswith(_IGNORED_KEYS):
            weights[key] = tensor

    if dtype is None:
        dtype = weights["fc.weight"].dtype if "fc.weight" in weights else torch.float32
    # Built in `dtype` (not cast afterwards), so that the rotary frequencies stay float32.
    drafter = TreeSparkDrafter._from_config(tcfg, dtype=dtype)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    misshaped = [f"{k}: {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
                 for k in sorted(set(weights) & set(expected)) if weights[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if unexpected:
        problems.append(f"unexpected {unexpected}")
    if misshaped:
        problems.append(f"wrong shapes {misshaped}")
    if problems:
        raise DSparkConversionError(f"DSpark checkpoint{where} does not match its config: " + "; ".join(problems)
                                    + ". Nothing was loaded.")
    drafter.load_state_dict(weights, strict=True)
    if path_or_dir is not None:
        drafter.config._name_or_path = str(path_or_dir)
    return drafter.eval()


def export_dspark_checkpoint(
    drafter: TreeSparkDrafter,
    target: torch.nn.Module,
    save_directory: str | os.PathLike,
    num_anchors: int = 512,
) -> Path:
    """Write `drafter` as a DSpark checkpoint: `config.json` + `model.safetensors` in DeepSpec's layout.

    DSpark checkpoints carry their own `embed_tokens.weight` and `lm_head.weight` (`[V, H]`); they are
    copied from `target`, in the drafter's dtype, so engines that load DSpark drafters can serve the
    result. Refuses drafters with a learned mask embedding (DSpark has none) and targets that do not
    fit the drafter. Returns the directory.
    """
    from safetensors.torch import save_file

    dspark_cfg = treespark_config_to_dspark(drafter.config, num_anchors=num_anchors)
    drafter.check_target(target)
    dtype = drafter.fc.weight.dtype
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    # `.clone()`: a target with tied embeddings shares one tensor, which safetensors refuses to save twice.
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to("cpu", dtype).clone()
    tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().to("cpu", dtype).clone()
    tcfg = getattr(target, "config", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tcfg, key, None) is not None:
            dspark_cfg[key] = getattr(tcfg, key)
    dspark_cfg["dtype"] = str(dtype).removeprefix("torch.")

    save_directory = Path(save_directory)
    save_directory.mkdir(parents=True, exist_ok=True)
    tmp = save_directory / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    shutil.move(tmp, save_directory / "model.safetensors")
    (save_directory / "config.json").write_text(json.dumps(dspark_cfg, indent=2, sort_keys=True) + "\n",
                                                encoding="utf-8")
    return save_directory


__all__ = [
    "DSparkConversionError",
    "dspark_config_to_treespark",
    "export_dspark_checkpoint",
    "load_dspark_checkpoint",
    "model_card",
    "push_drafter_to_hub",
    "save_drafter",
    "treespark_config_to_dspark",
]
