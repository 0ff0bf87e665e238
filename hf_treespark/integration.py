"""How `target.generate(..., assistant_model=drafter)` reaches the TreeSpark loop.

transformers has no registry for tree verifiers. Its documented extension point is
`generate(custom_generate=<callable>)`: `generate()` prepares the generation config, the
logits processors and the stopping criteria, then hands the decoding loop to the callable, and
passes it every keyword that the callable declares beyond `_sample`'s. We wrap
`GenerationMixin.generate` so that a TreeSpark `assistant_model` is re-routed to that path,
renamed so that transformers does not also start its own assisted decoding. Every other call
goes to the original `generate` untouched.

If a model class overrides `generate` itself, or transformers changes, the guard on
`_get_candidate_generator` turns the opaque failure into a message naming
`hf_treespark.generate`.
"""

from __future__ import annotations

import functools
import inspect

from transformers import GenerationMixin

from .generation import treespark_decoding

TREE_KWARGS = ("tree_budget", "tree_topk", "tree_depth", "tree_frontier", "tree_chain", "tree_lookup", "tree_record",
               "tree_timer")
_ORIGINAL_GENERATE = GenerationMixin.generate
_ORIGINAL_CANDIDATE_GENERATOR = GenerationMixin._get_candidate_generator
_FALLBACK = ("call hf_treespark.generate(target, drafter, input_ids, ...) instead, or use a transformers "
             "version in hf_treespark's tested range")


def is_treespark_drafter(model) -> bool:
    """True for a TreeSpark drafter, whether loaded from the package or as remote code."""
    return getattr(getattr(model, "config", None), "model_type", None) == "treespark"


def treespark_generate(target, drafter, inputs=None, streamer=None, **kwargs):
    """Run `target.generate` with TreeSpark tree decoding (what `assistant_model=drafter` routes to)."""
    if not _supports_custom_generate():
        raise RuntimeError("This transformers version's generate() has no custom_generate callable; " + _FALLBACK)
    return _ORIGINAL_GENERATE(target, inputs, custom_generate=treespark_decoding, treespark_drafter=drafter,
                              treespark_streamer=streamer, **kwargs)


def _supports_custom_generate() -> bool:
    return "custom_generate" in inspect.signature(_ORIGINAL_GENERATE).parameters


@functools.wraps(_ORIGINAL_GENERATE)
def _generate(self, *args, **kwargs):
    bound = inspect.signature(_ORIGINAL_GENERATE).bind_partial(self, *args, **kwargs)
    arguments = bound.arguments
    extra = arguments.pop("kwargs", {})
    assistant = arguments.get("assistant_model")
    if not is_treespark_drafter(assistant):
        stray = [k for k in TREE_KWARGS if k in extra]
        if stray:
            raise ValueError(f"{stray} only apply with a TreeSpark assistant_model")
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    if arguments.get("custom_generate") is not None:
        raise ValueError("custom_generate cannot be combined with a TreeSpark assistant_model")
    arguments.pop("self")
    arguments.pop("assistant_model")
    inputs = arguments.pop("inputs", None)
    return treespark_generate(self, assistant, inputs, **arguments, **extra)


def _get_candidate_generator(self, *args, **kwargs):
    assistant = kwargs.get("assistant_model")
    if is_treespark_drafter(assistant):
        raise RuntimeError(
            f"{type(self).__name__}.generate reached transformers' chain-only assisted decoding with a TreeSpark "
            f"drafter (this model class overrides generate, or transformers changed); " + _FALLBACK)
    return _ORIGINAL_CANDIDATE_GENERATOR(self, *args, **kwargs)


def install() -> None:
    """Route TreeSpark assistants (idempotent; done by `import hf_treespark`)."""
    if GenerationMixin.generate is not _generate and _supports_custom_generate():
        GenerationMixin.generate = _generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
