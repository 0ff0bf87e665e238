"""`treespark export`: a training checkpoint as a drafter directory, or a drafter as a DSpark checkpoint.

    treespark export runs/s9/checkpoints/step-00009200 --output runs/s9/step-9200
    treespark calibrate --drafter runs/s9/step-9200     # its acceptance profile, for tree_budget="auto"
    treespark export --format dspark --without-depth-heads --output dspark/    # the shipped drafter, for vLLM/SGLang

A checkpoint (`Trainer.save_checkpoint`) holds the whole training state; `--format drafter` writes just the drafter,
as `from_pretrained` loads it. The checkpoint is checked whole before anything is written: every weight of the
drafter present, of its shape, and nothing else. `--format dspark` writes a drafter (a training checkpoint, a drafter
directory, or the shipped drafter) in DeepSpec's DSpark layout, which vLLM and SGLang serve
(`hub.sharing.export_dspark_checkpoint`; docs/serving.md), and prints the command that serves it on each engine.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

PREFIX = "drafter."  # the drafter's weights inside the training objective's state dict
EXPORT_DTYPES = ("bfloat16", "float32")  # names `precision.resolve_dtype` reads
FORMATS = ("drafter", "dspark")  # `--format`: a drafter directory, or a DSpark checkpoint for the serving engines


def checkpoint_config(checkpoint: Path):
    """The drafter config of `checkpoint`: its `drafter_config.json`, or for a checkpoint written before that
    file existed, the architecture fields of its `trainer_state.json`. A file that cannot give one raises
    `ValueError` naming it and what is wrong."""
    from ..drafter.configuration import TreeSparkConfig

    path = checkpoint / "drafter_config.json"
    if path.is_file():
        fields = read_json_object(path, "a drafter config")
    else:
        path = checkpoint / "trainer_state.json"
        if not path.is_file():
            raise FileNotFoundError(f"{checkpoint} is not a complete training checkpoint (no trainer_state.json); "
                                    "give a step-* directory of OUTPUT_DIR/checkpoints")
        fields = read_json_object(path, "a training checkpoint's state").get("drafter_config")
        if not isinstance(fields, dict):
            raise ValueError(f"{path} has no drafter_config object: the checkpoint is damaged, export another one")
    try:
        return TreeSparkConfig.from_dict(fields)  # as `from_json_file` reads a config
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path} does not hold a valid drafter config ({err}); the checkpoint is damaged, export "
                         "another one") from None


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path`; `ValueError` naming the file when it is not UTF-8 JSON or not an object."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} cannot be read as {what} ({err}); the file is damaged (an interrupted write, a "
                         "full disk)") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} cannot be read as {what}: it holds a JSON {type(value).__name__}, not an object")
    return value


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The drafter's weights in `checkpoint/model.safetensors`, without the objective's prefix."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = checkpoint / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} has no model.safetensors: not a training checkpoint, or an "
                                "incomplete one")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} cannot be read ({err}); the checkpoint is damaged, export another one") from err
    return {k.removeprefix(PREFIX): v for k, v in state.items()}


def checkpoint_drafter(checkpoint: Path):
    """The drafter of training checkpoint `checkpoint` in float32, its acceptance profile left out (the weights it
    was measured with are gone). `ValueError` naming the checkpoint when its weights are not exactly those of its
    drafter config (missing, unexpected, other shape) or its draft vocabulary is damaged."""
    from ..drafter.modeling import TreeSparkDrafter, draft_vocab_problem

    config = checkpoint_config(checkpoint)
    config.acceptance_profile = None
    weights = checkpoint_weights(checkpoint)
    drafter = TreeSparkDrafter(config)  # float32, shaped by the config, its draft vocabulary too
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        parts = [f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                 for label, keys in (("missing", missing), ("unexpected", unexpected), ("other shape", wrong)) if keys]
        raise ValueError(f"{checkpoint} does not hold the weights of its drafter config ({'; '.join(parts)}); "
                         "nothing was written")
    problem = "draft_vocab_ids" in weights and draft_vocab_problem(weights["draft_vocab_ids"], config.target_vocab_size)
    if problem:
        raise ValueError(f"{checkpoint / 'model.safetensors'} holds a damaged draft_vocab_ids buffer ({problem}); "
                         "nothing was written, export another checkpoint")
    drafter.load_state_dict(weights, strict=True)
    return drafter


def _check_output(output: Path, dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty: give a new directory")


def export_checkpoint(checkpoint: str | Path, output: str | Path, dtype: str = "bfloat16"):
    """Write the drafter of training checkpoint `checkpoint` to the directory `output` (weights in `dtype`).

    The acceptance profile is left out (the weights it was measured with are gone): `treespark calibrate`
    measures the new one. Returns the drafter.
    """
    from ..hub.sharing import save_drafter
    from ..precision import resolve_dtype

    checkpoint, output = Path(checkpoint), Path(output)
    _check_output(output, dtype)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint}: no such checkpoint directory")
    drafter = checkpoint_drafter(checkpoint)
    save_drafter(drafter.to(resolve_dtype(dtype)), output)
    return drafter


# ----- --format dspark --------------------------------------------------------------------------------------
def source_drafter(source: str | Path | None, dtype: str):
    """The drafter `--format dspark` converts, in `dtype`: the shipped drafter (`source` None), a training checkpoint
    (a directory with `trainer_state.json`), or a drafter directory (`config.json`, as `from_pretrained` reads)."""
    from ..drafter.modeling import TreeSparkDrafter
    from ..hub.assets import load_default_drafter
    from ..precision import resolve_dtype

    if source is None:
        return load_default_drafter(dtype=dtype)
    source = Path(source)
    if (source / "trainer_state.json").is_file():
        return checkpoint_drafter(source).to(resolve_dtype(dtype))
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: neither a training checkpoint (trainer_state.json) nor a drafter directory "
                                "(config.json); leave it out to export the shipped drafter")
    return TreeSparkDrafter.from_pretrained(source, dtype=resolve_dtype(dtype)).eval()


def export_target(config, target: str | None) -> str:
    """The target whose embeddings and LM head the DSpark checkpoint copies: `target` (a name or path, "default"
    for the offline default), else the one the drafter records (the offline default for SmolLM2-135M-Instruct).
    `ValueError` when neither is known."""
    from ..hub.card import hub_target_id
    from ..hub.default_target import DEFAULT_TARGET_HUB_ID

    name = target or config.target_name_or_path
    if not name:
        raise ValueError("this drafter records no target: give --target, the model it drafts for (its embed_tokens "
                         "and lm_head are copied into the DSpark checkpoint)")
    return "default" if target is None and hub_target_id(name) == DEFAULT_TARGET_HUB_ID else name


def _load_target(name: str, dtype: str):
    """The target `name` ("default": the offline default) on the CPU in `dtype`, for its embeddings and LM head."""
    from ..precision import resolve_dtype

    if name == "default":
        from ..hub.assets import load_default_target

        return load_default_target(dtype=dtype)[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=resolve_dtype(dtype, "cpu")).eval()


def export_dspark(source: str | Path | None, output: str | Path, target: str | None = None, dtype: str = "bfloat16",
                  mask_token_id: int | None = None, without_depth_heads: bool = False) -> tuple[dict, str]:
    """Write drafter `source` (see `source_drafter`) as a DSpark checkpoint in the new directory `output`, weights in
    `dtype`, the embeddings and LM head copied from `target` (see `export_target`); `mask_token_id` and
    `without_depth_heads` as for `hub.sharing.export_dspark_checkpoint`. The drafter is checked before the target
    is loaded. Returns `(the DSpark config written, the target name used)`."""
    from ..hub.sharing import export_dspark_checkpoint, treespark_config_to_dspark

    output = Path(output)
    _check_output(output, dtype)
    drafter = source_drafter(source, dtype)
    treespark_config_to_dspark(drafter.config, mask_token_id=mask_token_id, without_depth_heads=without_depth_heads)
    name = export_target(drafter.config, target)
    export_dspark_checkpoint(drafter, _load_target(name, dtype), output, mask_token_id=mask_token_id,
                             without_depth_heads=without_depth_heads)
    return read_json_object(output / "config.json", "a DSpark config"), name


def serving_commands(output: str | Path, dspark_config: dict, target: str) -> dict[str, str]:
    """The command that serves `target` with the DSpark checkpoint in `output` on each engine (docs/serving.md):
    vLLM drafts `num_speculative_tokens` = the block size per round; SGLang's DSPARK block size is the same count."""
    from ..hub.card import hub_target_id
    from ..hub.default_target import DEFAULT_TARGET_HUB_ID

    model = shlex.quote(DEFAULT_TARGET_HUB_ID if target == "default" else hub_target_id(target))
    draft, block = shlex.quote(str(output)), int(dspark_config["block_size"])
    spec = json.dumps({"method": "dspark", "model": str(output), "num_speculative_tokens": block})
    return {
        "vLLM": f"vllm serve {model} --speculative-config {shlex.quote(spec)}",
        "SGLang": (f"python -m sglang.launch_server --model-path {model} --speculative-algorithm DSPARK "
                   f"--speculative-draft-model-path {draft} --speculative-dspark-block-size {block}"),
    }


def sglang_problem(dspark_config: dict) -> str | None:
    """Why SGLang cannot serve this DSpark checkpoint as exported (docs/serving.md), or None."""
    if dspark_config.get("draft_vocab_size") is not None:
        return ("SGLang's DSpark model has no draft vocabulary (its Markov head and LM head span the whole vocabulary) "
                "and would not load this checkpoint's d2t: serve it on vLLM (SGLang needs a whole-vocabulary drafter)")
    if (dspark_config.get("treespark") or {}).get("learned_mask_embedding"):
        return ("SGLang embeds the mask slots with the target's own embed_tokens, not the learned mask embedding "
                "this checkpoint carries in its embed_tokens: serve it on vLLM")
    return None


def export_dspark_command(args) -> int:
    """`treespark export --format dspark`: export, then print where it went and the serving commands."""
    config, target = export_dspark(args.checkpoint, args.output, target=args.target, dtype=args.dtype,
                                   mask_token_id=args.mask_token_id, without_depth_heads=args.without_depth_heads)
    what = args.checkpoint or "the shipped drafter"
    vocab = (f"draft vocabulary {config['draft_vocab_size']} (d2t)" if config.get("draft_vocab_size")
             else "full vocabulary")
    source = "the offline default target" if target == "default" else target
    print(f"[export] {what} -> {args.output} (DSpark, {args.dtype}, block {config['block_size']}, {vocab}, "
          f"mask token {config['mask_token_id']}, embeddings and LM head of {source})")
    for engine, command in serving_commands(args.output, config, target).items():
        print(f"[export] serve it with {engine}: {command}")
    problem = sglang_problem(config)
    if problem:
        print(f"[export] note: {problem}")
    return 0
