"""A training checkpoint as a drafter directory: `treespark export`.

    treespark export runs/s9/checkpoints/step-00009200 --output runs/s9/step-9200
    treespark calibrate --drafter runs/s9/step-9200     # its acceptance profile, for tree_budget="auto"

A checkpoint (`Trainer.save_checkpoint`) holds the whole training state; this writes just the drafter, as
`from_pretrained` loads it. The checkpoint is checked whole before anything is written: every weight of the
drafter present, of its shape, and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PREFIX = "drafter."  # the drafter's weights inside the training objective's state dict
EXPORT_DTYPES = ("bfloat16", "float32")  # names `precision.resolve_dtype` reads


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


def export_checkpoint(checkpoint: str | Path, output: str | Path, dtype: str = "bfloat16"):
    """Write the drafter of training checkpoint `checkpoint` to the directory `output` (weights in `dtype`).

    The acceptance profile is left out (the weights it was measured with are gone): `treespark calibrate`
    measures the new one. Returns the drafter.
    """
    from ..drafter.modeling import TreeSparkDrafter, draft_vocab_problem
    from ..hub.sharing import save_drafter
    from ..precision import resolve_dtype

    checkpoint, output = Path(checkpoint), Path(output)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint}: no such checkpoint directory")
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty: give a new directory")
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
    save_drafter(drafter.to(resolve_dtype(dtype)), output)
    return drafter
