"""Sharing drafters: saving and pushing to the Hub with the model card (`card.py`), DSpark checkpoint conversion.

A TreeSpark drafter directory is what `save_pretrained` writes (`config.json` with an `auto_map`,
`model.safetensors`, and `modeling.py`, `configuration.py` and the modules they import (`modeling_*.py`,
`cpu_gemm.py`, `datastore.py`) as remote code, because `import hf_treespark` registers the classes for auto
classes; `custom_generate/`, the tree decoding loop as a transformers `custom_generate` recipe for users
without the package) plus a `README.md` model card:

    save_drafter(drafter, "my-drafter", acceptance_table=table)
    push_drafter_to_hub(drafter, "me/my-drafter", acceptance_table=table, base_model="org/target")

DSpark checkpoints (DeepSpec's published layout, e.g. `deepseek-ai/dspark_qwen3_8b_block7`, which vLLM and SGLang
serve) hold the same backbone, Markov head and confidence head under the same key names, plus a copy of the
target's `embed_tokens` and `lm_head`, and a Qwen3 config extended with the DSpark fields; a draft vocabulary
travels as `draft_vocab_size` and the `d2t` offsets (docs/serving.md: what each engine reads, and where):

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
from ..drafter.modeling import TreeSparkDrafter, draft_vocab_problem
from ..drafter.modeling_io import check_repo_id
from .card import CARD_NAME, PUSH_COMMIT_MESSAGE, model_card, push_drafter, write_card  # noqa: F401  (CARD_NAME)

DSPARK_SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")  # the target's, stored by DSpark, bound by us
DSPARK_D2T_KEY = "d2t"  # [|S|] int64: a draft vocabulary's index -> target id offsets (EAGLE-3's convention)
DEPTH_HEADS = ("depth1_head", "depth2_head")  # TreeSpark's own heads: a DSpark checkpoint has no place for them
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
    base_model: str | None = None,
    **options: Any,
):
    """Save `drafter` with its model card and upload the folder to the Hub repo `repo_id` (`card.push_drafter`,
    which `drafter.push_to_hub` calls too: the same card, metadata and files either way).

    The card is the `README.md` of the directory the drafter was loaded from when it has one (`source_card`:
    a card the user wrote, kept as written, or one this package wrote, whose figures are read from the drafter
    again and whose usage snippet is pointed at `repo_id`: `card.fresh_card`), unless `acceptance_table` is given;
    else one generated from the drafter's config (its `acceptance_profile` included). `base_model`: the target's
    Hub id (ORG/NAME) for the card's `base_model` and usage snippet (default: the recorded target's Hub id, when it
    is one). Creates the repo if needed. `options` are `push_to_hub`'s others (`revision`, `create_pr`,
    `commit_description`, `max_shard_size`, `tags`). Returns `huggingface_hub`'s `CommitInfo`. Raises `ValueError`
    naming `repo_id` when it is not a repository name (None, empty, not a string), or naming `base_model` when it is
    not ORG/NAME, before anything is saved or sent.
    """
    check_repo_id(repo_id, "push_drafter_to_hub")
    _register_for_auto_classes(drafter)
    return push_drafter(drafter, repo_id, acceptance_table=acceptance_table, private=private, token=token,
                        commit_message=commit_message, base_model=base_model, **options)


# ----- DSpark configs -------------------------------------------------------------------------------
def dspark_config_to_treespark(dspark_cfg: dict, **overrides: Any) -> TreeSparkConfig:
    """The `TreeSparkConfig` of a DSpark checkpoint's `config.json` (a Qwen3 config plus the DSpark fields).

    Refuses what the TreeSpark drafter does not implement: Markov heads other than `vanilla` or of rank
    0, a confidence head without the Markov features, no `mask_token_id`, embedding-output features
    (`target_layer_ids` containing -1), rotary scaling and sliding-window layers. A `draft_vocab_size` below
    `vocab_size` becomes the drafter's draft vocabulary (its ids come from the checkpoint's `d2t`). `overrides` are
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
    vocab = int(need("vocab_size"))
    draft_vocab = c.get("draft_vocab_size")
    extra = c.get("treespark") or {}  # written by `export_dspark_checkpoint`; DSpark itself ignores it
    fields = {
        "target_hidden_size": hidden,
        "target_vocab_size": vocab,
        "target_num_hidden_layers": int(need("num_target_layers")),
        "target_layer_ids": layer_ids,
        # DSpark configs are copies of the target's config, so `_name_or_path` names the target.
        "target_name_or_path": extra.get("target_name_or_path") or c.get("_name_or_path") or None,
        "block_size": int(need("block_size")),
        # a learned mask embedding travels as the row `mask_token_id` of embed_tokens (`load_dspark_checkpoint`)
        "mask_token_id": None if extra.get("learned_mask_embedding") else int(c["mask_token_id"]),
        "draft_vocab_size": int(draft_vocab) if draft_vocab is not None and int(draft_vocab) < vocab else None,
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


def _refuse_what_dspark_lacks(config: TreeSparkConfig, without_depth_heads: bool) -> None:
    """`DSparkConversionError` for a part of the drafter that a DSpark checkpoint cannot hold."""
    if config.anchor_features:
        raise DSparkConversionError("this drafter feeds the features of the position before the anchor into its "
                                    "block (anchor_features=True); DSpark drafters are conditioned by KV "
                                    "injection only and have no such projection")
    if config.normalize_features:
        raise DSparkConversionError("this drafter standardises its target features before fc "
                                    "(normalize_features=True); DSpark's fc has no bias to hold the mean")
    drop = ("DSpark drafters have none: export without it (without_depth_heads=True, `treespark export --format "
            "dspark --without-depth-heads`) and the block alone drafts that depth, as it did before the head was "
            "trained")
    if config.depth1_head and not without_depth_heads:
        raise DSparkConversionError("this drafter has a depth-1 head (depth1_head > 0) that reads the features of the "
                                    f"position before the anchor directly; {drop}")
    if config.depth2_head and not without_depth_heads:
        raise DSparkConversionError("this drafter has a depth-2 head (depth2_head > 0) that reads the parent drafted "
                                    f"at depth 1; {drop}")


def _dspark_mask_token_id(config: TreeSparkConfig, mask_token_id: int | None) -> int:
    """The `mask_token_id` of the DSpark config: the drafter's own, or for a learned mask embedding the row of the
    exported `embed_tokens` chosen to hold it."""
    if config.mask_token_id is not None:
        if mask_token_id is not None and int(mask_token_id) != config.mask_token_id:
            raise DSparkConversionError(f"mask_token_id={mask_token_id}: this drafter was trained with its mask slots "
                                        f"on token id {config.mask_token_id}, which its DSpark checkpoint keeps; "
                                        "leave mask_token_id out")
        return config.mask_token_id
    if mask_token_id is None:
        raise DSparkConversionError("this drafter uses a learned mask embedding (mask_token_id=None), and DSpark "
                                    "checkpoints fill the mask slots with embed_tokens[mask_token_id]: give "
                                    "mask_token_id (`--mask-token-id ID`), a token id the target never reads in a "
                                    "prompt (a reserved special token); that row of the exported embed_tokens "
                                    "receives the learned embedding")
    if not 0 <= int(mask_token_id) < config.target_vocab_size:
        raise DSparkConversionError(f"mask_token_id={mask_token_id} is not a token id of the target "
                                    f"(0 to {config.target_vocab_size - 1})")
    return int(mask_token_id)


def treespark_config_to_dspark(config: TreeSparkConfig, num_anchors: int = 512, mask_token_id: int | None = None,
                               without_depth_heads: bool = False) -> dict:
    """The DSpark `config.json` dict (Qwen3 config + DSpark fields) of a TreeSpark config.

    `num_anchors` is DSpark's training-time anchors per sequence (informative for inference). The
    tree policy and target name travel under a `treespark` key that DSpark ignores. A draft vocabulary is
    `draft_vocab_size` (its ids travel as the `d2t` tensor). A learned mask embedding needs `mask_token_id`: the
    row of the exported `embed_tokens` that holds it (see `_dspark_mask_token_id`). Depth heads are refused unless
    `without_depth_heads`; anchor features and standardised features always are.
    """
    _refuse_what_dspark_lacks(config, without_depth_heads)
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
        "mask_token_id": _dspark_mask_token_id(config, mask_token_id),
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
            "learned_mask_embedding": config.mask_token_id is None,
        },
    }
    if config.draft_vocab_size is not None:
        out["draft_vocab_size"] = config.draft_vocab_size
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


def _drafter_weights(state_dict: dict, config: dict, tcfg: TreeSparkConfig, where: str) -> dict[str, torch.Tensor]:
    """The drafter's tensors of a DSpark state dict: the target's `embed_tokens` / `lm_head` (shapes checked) and
    `t2d` dropped, `d2t` turned into `draft_vocab_ids`, a learned mask embedding read back from its embed row."""
    hidden = tcfg.target_hidden_size
    rows = dict(zip(DSPARK_SHARED_KEYS, (tcfg.target_vocab_size, tcfg.proposal_vocab_size), strict=True))  # rows
    weights = {}
    for key, tensor in state_dict.items():
        if key in rows:
            if tuple(tensor.shape) != (rows[key], hidden):
                raise DSparkConversionError(f"DSpark checkpoint{where}: {key} has shape {tuple(tensor.shape)}, "
                                            f"expected {(rows[key], hidden)} from its config")
        elif key != "t2d" and not key.endswith(_IGNORED_KEYS):  # t2d: EAGLE-3's training-only mask
            weights[key] = tensor
    d2t = weights.pop(DSPARK_D2T_KEY, None)
    if tcfg.draft_vocab_size is not None:
        if d2t is None or tuple(d2t.shape) != (tcfg.draft_vocab_size,):
            got = "none" if d2t is None else f"shape {tuple(d2t.shape)}"
            raise DSparkConversionError(f"DSpark checkpoint{where} has draft_vocab_size={tcfg.draft_vocab_size} but "
                                        f"no d2t tensor of that length (got {got})")
        ids = torch.arange(tcfg.draft_vocab_size) + d2t.long()  # target id of draft index i: i + d2t[i]
        problem = draft_vocab_problem(ids, tcfg.target_vocab_size)
        if problem is not None:
            raise DSparkConversionError(f"DSpark checkpoint{where}: its d2t does not map to a draft vocabulary "
                                        f"({problem})")
        weights["draft_vocab_ids"] = ids
    elif d2t is not None:
        raise DSparkConversionError(f"DSpark checkpoint{where} has a d2t tensor but no draft_vocab_size below "
                                    "vocab_size in its config")
    if tcfg.mask_token_id is None:  # exported with a learned mask embedding, written into its row of embed_tokens
        if "embed_tokens.weight" not in state_dict:
            raise DSparkConversionError(f"DSpark checkpoint{where} records a learned mask embedding but has no "
                                        "embed_tokens.weight to hold it")
        weights["mask_embedding"] = state_dict["embed_tokens.weight"][int(config["mask_token_id"])].clone()
    return weights


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
    `embed_tokens.weight` / `lm_head.weight` are dropped (the drafter binds to its target); a `d2t` tensor
    becomes the draft vocabulary; every other tensor must match the drafter exactly, by name and shape, or
    nothing is loaded. `dtype` defaults to the checkpoint's. `overrides` are `TreeSparkConfig` fields (e.g.
    `target_name_or_path`). Bind the result with `drafter.bind_target(target)` before use.
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
    weights = _drafter_weights(state_dict, config, tcfg, where)

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


def dspark_tensors(drafter: TreeSparkDrafter, target: torch.nn.Module, mask_token_id: int) -> dict[str, torch.Tensor]:
    """The tensors of `drafter`'s DSpark checkpoint, on the CPU in the drafter's dtype, by DeepSpec's names.

    The drafter's own tensors (its depth heads left out), the target's `embed_tokens.weight` `[V, H]` (row
    `mask_token_id` replaced by the drafter's learned mask embedding where it has one) and `lm_head.weight`: `[V, H]`,
    or for a draft vocabulary `S` the rows of `S` in draft order `[|S|, H]`, with `d2t` `[|S|]` (int64), the offsets
    that map a draft index to its target id, `target_id = i + d2t[i]` (EAGLE-3's convention, which vLLM reads).
    """
    head = target.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise DSparkConversionError("the target's LM head has a bias; a DSpark checkpoint's lm_head has none")
    dtype = drafter.fc.weight.dtype
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()
               if not k.startswith(tuple(f"{name}." for name in DEPTH_HEADS))}
    learned_mask = tensors.pop("mask_embedding", None)
    ids = tensors.pop("draft_vocab_ids", None)
    # `.clone()`: a target with tied embeddings shares one tensor, which safetensors refuses to save twice.
    embed = target.get_input_embeddings().weight.detach().to("cpu", dtype).clone()  # [V, H]
    if learned_mask is not None:
        embed[mask_token_id] = learned_mask.to(dtype)
    tensors["embed_tokens.weight"] = embed
    lm_head = head.weight.detach().to("cpu", dtype)  # [V, H]
    if ids is None:
        tensors["lm_head.weight"] = lm_head.clone()
    else:
        ids = ids.to("cpu", torch.long)
        tensors["lm_head.weight"] = lm_head[ids].contiguous()  # [|S|, H]
        tensors[DSPARK_D2T_KEY] = ids - torch.arange(ids.numel())  # [|S|]
    return tensors


def export_dspark_checkpoint(
    drafter: TreeSparkDrafter,
    target: torch.nn.Module,
    save_directory: str | os.PathLike,
    num_anchors: int = 512,
    mask_token_id: int | None = None,
    without_depth_heads: bool = False,
) -> Path:
    """Write `drafter` as a DSpark checkpoint: `config.json` + `model.safetensors` in DeepSpec's layout, which vLLM
    (`Qwen3DSparkModel`) and SGLang (`--speculative-algorithm DSPARK`) load; docs/serving.md lists what each reads.

    The tensors are `dspark_tensors`' (the target's embeddings and LM head copied in the drafter's dtype), the config
    `treespark_config_to_dspark`'s, plus the target's `bos/eos/pad_token_id` and `dtype`. `mask_token_id`: the row
    of `embed_tokens` that holds a learned mask embedding (refused without one for such a drafter, and for any other
    drafter when it differs from its own). `without_depth_heads`: leave the depth-1/2 heads out (refused otherwise).
    Refuses drafters with anchor features or standardised features, and targets that do not fit. Nothing is written
    when it refuses. Returns the directory.
    """
    from safetensors.torch import save_file

    dspark_cfg = treespark_config_to_dspark(drafter.config, num_anchors, mask_token_id, without_depth_heads)
    drafter.check_target(target)
    tensors = dspark_tensors(drafter, target, dspark_cfg["mask_token_id"])
    tcfg = getattr(target, "config", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tcfg, key, None) is not None:
            dspark_cfg[key] = getattr(tcfg, key)
    dspark_cfg["dtype"] = str(drafter.fc.weight.dtype).removeprefix("torch.")

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
    "dspark_tensors",
    "export_dspark_checkpoint",
    "load_dspark_checkpoint",
    "model_card",
    "push_drafter_to_hub",
    "save_drafter",
    "treespark_config_to_dspark",
]
