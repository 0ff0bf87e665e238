"""hf_treespark: TreeSpark tree speculative decoding for Hugging Face transformers.

`import hf_treespark` registers the drafter with `AutoConfig`/`AutoModel` and routes
`target.generate(..., assistant_model=drafter)` to tree decoding (`install()`): every other `generate` call takes
transformers' own path. `HF_TREESPARK_NO_PATCH=1` in the environment skips the routing at import, and `uninstall()`
undoes it; `generate(target, drafter, ...)` and `custom_generate=<drafter directory>` decode without it.
"""

import os

import torch
from transformers import AutoConfig, AutoModel

from .calibration.latency import cached_latency
from .core.cpu_gemm import pack_linear_layers, unpack_linear_layers
from .core.tree import DraftTree, TreePolicy, build_tree
from .decoding import budget, integration
from .decoding.generation import TreeSparkCandidateGenerator
from .decoding.generation_output import RoundRecord, TreeSparkGenerateOutput
from .decoding.integration import install, uninstall
from .drafter import modeling_io
from .drafter.configuration import TreeSparkConfig
from .drafter.modeling import TreeSparkDrafter
from .hub import card as _card
from .version import __version__  # noqa: F401  (hf_treespark.__version__)

AutoConfig.register("treespark", TreeSparkConfig, exist_ok=True)
AutoModel.register(TreeSparkConfig, TreeSparkDrafter, exist_ok=True)
TreeSparkConfig.register_for_auto_class()
TreeSparkDrafter.register_for_auto_class("AutoModel")
if os.environ.get("HF_TREESPARK_NO_PATCH", "").strip().lower() in ("", "0", "false", "no", "off"):
    install()
modeling_io.use_sharing(_card)  # saves and pushes write the model card and custom_generate/
budget.use_cost_table(cached_latency)  # "auto" reads this machine's measured round costs


def generate(target, drafter, input_ids=None, **kwargs):
    """TreeSpark decoding as a plain function: `target.generate(input_ids, assistant_model=drafter, **kwargs)`.

    Accepts every `generate` keyword (`max_new_tokens`, `do_sample`, `streamer`, `return_dict_in_generate`, ...)
    plus the tree knobs (docs/usage.md): `tree_budget` (nodes per round, or "auto"), `tree_topk`, `tree_depth`,
    `tree_frontier`, `tree_chain` (the tree's shape), `tree_lookup` (prompt-lookup branch length, 0 = off),
    `tree_gate` (the drafter gate; "price": the round pricer), `tree_datastore` (the datastore: on, off, or
    another), `tree_sources` (registered branch sources, `{name: value}`), `tree_guard` (hand a slow call to
    transformers' loop),
    `tree_record` (keep each round's tree) and `tree_timer` (time each round phase).
    """
    if isinstance(input_ids, (list, tuple)):  # one prompt as a list of token ids
        input_ids = torch.tensor([list(input_ids)], dtype=torch.long, device=target.device)
    return integration.treespark_generate(target, drafter, input_ids, **kwargs)


def load_default_target(dtype="auto", device="cpu", cpu_pack="auto"):
    """`(model, tokenizer)` of the offline default target, SmolLM2-135M-Instruct (`loading.load_target`).

    On a CPU its linear layers use prepacked oneDNN kernels unless `cpu_pack=False` (`cpu_gemm.py`).
    """
    from .hub.loading import load_target

    return load_target(None, dtype=dtype, device=device, cpu_pack=cpu_pack)


def load_default_drafter(dtype="auto", device="cpu", cpu_pack="auto"):
    """The TreeSpark drafter shipped in the package, for SmolLM2-135M-Instruct (`loading.load_drafter`)."""
    from .hub.loading import load_drafter

    return load_drafter(None, dtype=dtype, device=device, cpu_pack=cpu_pack)


__all__ = [
    "DraftTree",
    "RoundRecord",
    "TreePolicy",
    "TreeSparkCandidateGenerator",
    "TreeSparkConfig",
    "TreeSparkDrafter",
    "TreeSparkGenerateOutput",
    "build_tree",
    "generate",
    "install",
    "load_default_drafter",
    "load_default_target",
    "pack_linear_layers",
    "uninstall",
    "unpack_linear_layers",
]
