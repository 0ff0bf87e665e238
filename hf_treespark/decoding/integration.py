"""How `target.generate(..., assistant_model=drafter)` reaches the TreeSpark loop.

transformers has no registry for tree verifiers. Its documented extension point is
`generate(custom_generate=<callable>)`: `generate()` prepares the generation config, the
logits processors and the stopping criteria, then hands the decoding loop to the callable, and
passes it every keyword that the callable declares beyond `_sample`'s. We wrap
`GenerationMixin.generate` so that a TreeSpark `assistant_model` is re-routed to that path,
renamed so that transformers does not also start its own assisted decoding. Every other call
goes to the original `generate` untouched (once a `custom_generate` path is known to exist, below).
`install()` does it (`import hf_treespark` calls it unless the environment sets `HF_TREESPARK_NO_PATCH=1`);
`uninstall()` puts transformers' own functions back.

If a model class overrides `generate` itself, or transformers changes, the guard on
`_get_candidate_generator` turns the opaque failure into a message naming
`hf_treespark.generate`.

Two arguments of `generate` need help on that path: `tokenizer` (which the `custom_generate`
callable path drops, so `stop_strings` would be refused) becomes a `StopStringCriteria` here,
and transformers' assisted-decoding knobs (`num_assistant_tokens`, ...) that mean nothing to a
tree drafter are removed with a one-time warning. `pipeline("text-generation",
assistant_model=drafter)` skips transformers' tokenizer comparison: the drafter drafts the
target's own token ids.

What the routing can judge before transformers does, it refuses by name: an `assistant_model` that
is not a model (`generate` takes the drafter itself, never a path; a pipeline takes a path or repo
id too, and a local path with nothing there is named), a drafter directory given as
`custom_generate` whose `custom_generate/` is damaged (the file is named, with the remedy: save the
drafter again), and, with or without a drafter, a `custom_generate` local directory that does not exist
(transformers would send it to the Hub client as a repo id).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import os
import warnings

import torch
from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .generation import treespark_decoding

TREE_KWARGS = ("tree_budget", "tree_topk", "tree_depth", "tree_frontier", "tree_chain", "tree_lookup", "tree_gate",
               "tree_datastore", "tree_sources", "tree_record", "tree_timer", "tree_guard")
# GenerationConfig fields of transformers' assisted decoding (chain drafters, prompt lookup, early
# exit, universal assisted decoding); a TreeSpark drafter uses none of them.
ASSISTED_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                   "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit",
                   "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight", "speculation_type")
_WARNED_IGNORED: set[str] = set()  # assisted knobs already warned about in this process
# transformers' own generate, also when this module is a second copy (a drafter repo's custom_generate/)
# imported after the package has wrapped it.
_ORIGINAL_GENERATE = getattr(GenerationMixin.generate, "treespark_original", GenerationMixin.generate)
_ORIGINAL_CANDIDATE_GENERATOR = GenerationMixin._get_candidate_generator
_ORIGINAL_LOAD_ASSISTANT_MODEL = None  # transformers' pipeline loader, set by install()
_FALLBACK = ("call hf_treespark.generate(target, drafter, input_ids, ...) instead, or use a transformers "
             "version in hf_treespark's tested range")


def is_treespark_drafter(model) -> bool:
    """True for a TreeSpark drafter, whether loaded from the package or as remote code."""
    return getattr(getattr(model, "config", None), "model_type", None) == "treespark"


def treespark_generate(target, drafter, inputs=None, streamer=None, **kwargs):
    """Run `target.generate` with TreeSpark tree decoding (what `assistant_model=drafter` routes to)."""
    if not _supports_custom_generate():
        raise RuntimeError("This transformers version's generate() has no custom_generate callable; " + _FALLBACK)
    kwargs = _drop_assisted_knobs(target, kwargs)
    kwargs = _stop_strings_as_criteria(target, kwargs)
    return _ORIGINAL_GENERATE(target, inputs, custom_generate=treespark_decoding, treespark_drafter=drafter,
                              treespark_streamer=streamer, **kwargs)


def _config_value(target, kwargs: dict, name: str):
    """`name`'s value as `generate` resolves it: keyword, else `generation_config=`, else the model's config."""
    if name in kwargs:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(target, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _without(target, kwargs: dict, names: list[str]) -> dict:
    """`kwargs` in which the fields `names` resolve to None whatever config they came from."""
    kwargs = dict(kwargs)
    config = kwargs.get("generation_config")
    if config is not None and any(getattr(config, n, None) is not None for n in names):
        config = kwargs["generation_config"] = copy.deepcopy(config)
        for n in names:
            setattr(config, n, None)
    for n in names:
        kwargs.pop(n, None)
        if getattr(getattr(target, "generation_config", None), n, None) is not None:
            kwargs[n] = None  # the model's own generation config would fill the field back in
    return kwargs


def _drop_assisted_knobs(target, kwargs: dict) -> dict:
    """Remove transformers' assisted-decoding knobs (and `assistant_tokenizer`), warning once per knob."""
    defaults = _default_generation_params()
    fields = [n for n in ASSISTED_FIELDS if _config_value(target, kwargs, n) is not None]
    # Named in the warning: what the caller set, not a config's copy of transformers' defaults.
    named = [n for n in fields if n in kwargs or _config_value(target, kwargs, n) != defaults.get(n)]
    if "assistant_tokenizer" in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k != "assistant_tokenizer"}
        named.append("assistant_tokenizer")
    new = [n for n in named if n not in _WARNED_IGNORED]
    if new:
        _WARNED_IGNORED.update(new)
        warnings.warn(f"TreeSpark tree decoding ignores transformers' assisted-decoding argument(s) "
                      f"{', '.join(new)}: the drafter drafts the target's own tokens and the tree is set by "
                      "tree_budget, tree_topk, tree_depth and tree_frontier.", UserWarning, stacklevel=4)
    return _without(target, kwargs, fields) if fields else kwargs


def _default_generation_params() -> dict:
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig(), "_get_default_generation_params", None)
    return defaults() if defaults is not None else {}


def _stop_strings_as_criteria(target, kwargs: dict) -> dict:
    """`stop_strings` + `tokenizer` as a `StopStringCriteria` in `stopping_criteria`, as plain `generate` builds it.

    transformers' `custom_generate` callable path drops `tokenizer`, so it would refuse the stop strings.
    """
    tokenizer = kwargs.get("tokenizer")
    stop_strings = _config_value(target, kwargs, "stop_strings")
    if stop_strings is None:
        return kwargs
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=<the target's tokenizer> to generate() "
                         "together with stop_strings")
    kwargs = _without(target, kwargs, ["stop_strings"])
    kwargs.pop("tokenizer")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    return kwargs


def _supports_custom_generate() -> bool:
    return "custom_generate" in inspect.signature(_ORIGINAL_GENERATE).parameters


def _not_a_model(assistant) -> str:
    """Why `generate(assistant_model=...)` cannot take `assistant`, a value that is not a model."""
    if isinstance(assistant, (str, os.PathLike)):
        path = os.fspath(assistant)
        if not os.path.exists(path):
            return (f"assistant_model={path!r}: no such directory; generate() takes the drafter itself, not a path: "
                    "pass hf_treespark.TreeSparkDrafter.from_pretrained(<its directory or Hub repo id>)")
        return (f"assistant_model={path!r} is a path: generate() takes the drafter itself: pass "
                f"hf_treespark.TreeSparkDrafter.from_pretrained({path!r})")
    return (f"assistant_model={assistant!r:.60} ({type(assistant).__name__}) is not a model: pass a TreeSpark drafter "
            "(hf_treespark.TreeSparkDrafter.from_pretrained(...)) or another transformers assistant model")


def _custom_generate_problem(folder: str) -> str | None:
    """What is wrong with the `custom_generate/` of a local drafter directory (`folder`), or None: `generate.py`
    missing or without a `generate` function, or a module of it that is not valid Python. transformers would
    otherwise fail while importing it, with a SyntaxError or AttributeError that names neither the drafter nor
    the remedy."""
    code = os.path.join(folder, "custom_generate")
    entry = os.path.join(code, "generate.py")
    if not os.path.isfile(entry):
        return f"{entry} is missing"
    for name in ["generate.py", *sorted(n for n in os.listdir(code) if n.endswith(".py") and n != "generate.py")]:
        path = os.path.join(code, name)
        try:
            with open(path, "rb") as handle:
                tree = ast.parse(handle.read(), filename=path)
        except SyntaxError as err:
            line = f", line {err.lineno}" if err.lineno else ""
            return f"{path} is not valid Python ({err.msg}{line})"
        except (ValueError, OSError) as err:
            return f"{path} is not valid Python ({err})"
        if name == "generate.py" and not any(isinstance(node, ast.FunctionDef) and node.name == "generate"
                                             for node in tree.body):
            return f"{path} defines no generate function"
    return None


def _check_custom_generate(custom) -> None:
    """Refuse a local drafter directory whose `custom_generate/` is damaged, naming the file and the remedy."""
    folder = os.fspath(custom)
    if not os.path.isdir(folder):
        return  # a Hub repo id: transformers fetches and loads it
    problem = _custom_generate_problem(folder)
    if problem is not None:
        raise ValueError(f"custom_generate={folder!r}: {problem}. Re-save the drafter there "
                         f"(drafter.save_pretrained({folder!r})) to write custom_generate/ again.")


def _check_custom_generate_exists(custom) -> None:
    """Refuse a `custom_generate` that names a local directory with nothing there (`FileNotFoundError` naming it
    and what to pass): a path object, a path that is absolute or starts with `.` or `~`, or one that cannot be a
    Hub repo id (`a/b/c`). transformers would hand it to the Hub client, which refuses it as a repo id. A callable,
    a repo id or an existing path passes untouched."""
    if not isinstance(custom, (str, os.PathLike)):
        return
    path = os.fspath(custom)
    if os.path.exists(os.path.expanduser(path)):
        return
    if isinstance(custom, str) and not _looks_local(path) and not _cannot_be_repo_id(path):
        return  # a Hub repo id: transformers fetches it
    raise FileNotFoundError(f"custom_generate={path!r}: no such directory. Pass a directory holding "
                            "custom_generate/generate.py (a saved TreeSpark drafter's directory, for one), or the Hub "
                            "repo id ('org/name') of a repository holding one.")


def _cannot_be_repo_id(name: str) -> bool:
    """Whether `name` has more parts than a Hub repo id (`name` or `org/name`), or a backslash, which no repo id
    holds. (The Hub client's own check is not imported: this module ships as remote code, which may import only
    what transformers needs.)"""
    return name.count("/") > 1 or "\\" in name


@functools.wraps(_ORIGINAL_GENERATE)
def _generate(self, *args, **kwargs):
    bound = inspect.signature(_ORIGINAL_GENERATE).bind_partial(self, *args, **kwargs)
    arguments = bound.arguments
    extra = arguments.pop("kwargs", {})
    _check_custom_generate_exists(arguments.get("custom_generate"))
    assistant = arguments.get("assistant_model")
    if assistant is not None and not isinstance(assistant, torch.nn.Module):
        raise TypeError(_not_a_model(assistant))
    if not is_treespark_drafter(assistant):
        stray = [k for k in TREE_KWARGS if k in extra]
        if stray:
            raise ValueError(f"{stray} only apply with a TreeSpark assistant_model")
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    custom = arguments.get("custom_generate")
    if isinstance(custom, (str, os.PathLike)):  # a drafter repo's custom_generate/ recipe: TreeSpark decoding too
        _check_custom_generate(custom)
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    if custom is not None:
        raise ValueError("custom_generate cannot be combined with a TreeSpark assistant_model")
    arguments.pop("self")
    arguments.pop("assistant_model")
    inputs = arguments.pop("inputs", None)
    return treespark_generate(self, assistant, inputs, **arguments, **extra)


_generate.treespark_original = _ORIGINAL_GENERATE


def _get_candidate_generator(self, *args, **kwargs):
    assistant = kwargs.get("assistant_model")
    if is_treespark_drafter(assistant):
        raise RuntimeError(
            f"{type(self).__name__}.generate reached transformers' chain-only assisted decoding with a TreeSpark "
            f"drafter (this model class overrides generate, or transformers changed); " + _FALLBACK)
    return _ORIGINAL_CANDIDATE_GENERATOR(self, *args, **kwargs)


def _load_assistant_model(model, assistant_model, assistant_tokenizer):
    """transformers' pipeline `load_assistant_model`, accepting a TreeSpark drafter (object, path or repo id).

    The drafter needs no assistant tokenizer: it drafts the target's token ids (`bind_target`
    refuses a target whose vocabulary differs). Refused by name: a value that is neither a model nor a path or
    repo id, and a local path (absolute, or starting with `.` or `~`) with nothing there.
    """
    if assistant_model is not None and not isinstance(assistant_model, (str, os.PathLike, torch.nn.Module)):
        raise TypeError(f"assistant_model={assistant_model!r:.60} ({type(assistant_model).__name__}) is not a model: "
                        "pass a TreeSpark drafter, or the directory or Hub repo id of one")
    if isinstance(assistant_model, (str, os.PathLike)) and model.can_generate():
        from transformers import AutoConfig

        assistant_model = os.fspath(assistant_model)
        try:
            model_type = AutoConfig.from_pretrained(assistant_model).model_type
        except (OSError, ValueError):
            if _looks_local(assistant_model) and not os.path.exists(os.path.expanduser(assistant_model)):
                raise FileNotFoundError(f"assistant_model={assistant_model!r}: no such directory: pass a saved "
                                        "drafter's directory, its Hub repo id ('org/name'), or the drafter itself"
                                        ) from None
            model_type = None  # not a config we can read: transformers' own loader says why
        if model_type == "treespark":
            from ..drafter.modeling import TreeSparkDrafter

            assistant_model = TreeSparkDrafter.from_pretrained(assistant_model, dtype=model.dtype)
            assistant_model = assistant_model.to(model.device).eval()
    if is_treespark_drafter(assistant_model):
        return (assistant_model, None) if model.can_generate() else (None, None)
    return _ORIGINAL_LOAD_ASSISTANT_MODEL(model, assistant_model, assistant_tokenizer)


def _looks_local(name: str) -> bool:
    """True for a path that cannot be a Hub repo id (absolute, relative to `.`, or under `~`)."""
    return os.path.isabs(name) or name.startswith((".", "~"))


def _install_pipeline_support() -> None:
    global _ORIGINAL_LOAD_ASSISTANT_MODEL
    from transformers.pipelines import base

    loader = getattr(base, "load_assistant_model", None)
    if loader is None or loader is _load_assistant_model:
        return  # another transformers version: pipelines built with the drafter are not supported there
    _ORIGINAL_LOAD_ASSISTANT_MODEL = loader
    base.load_assistant_model = _load_assistant_model


def install() -> None:
    """Route TreeSpark assistants (idempotent; done by `import hf_treespark` unless `HF_TREESPARK_NO_PATCH=1`)."""
    if GenerationMixin.generate is not _generate and _supports_custom_generate():
        GenerationMixin.generate = _generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    _install_pipeline_support()


def uninstall() -> None:
    """Undo `install` (idempotent): transformers' own `GenerationMixin.generate`, `_get_candidate_generator` and
    pipeline `load_assistant_model` again, the very objects it had. Then `generate(assistant_model=drafter)` reaches
    transformers' assisted decoding, which refuses the drafter (`modeling.NEEDS_PACKAGE`); TreeSpark decoding stays
    reachable through `hf_treespark.generate(target, drafter, ...)` and `custom_generate=<drafter directory>`."""
    if GenerationMixin.generate is _generate:
        GenerationMixin.generate = _ORIGINAL_GENERATE
    if GenerationMixin._get_candidate_generator is _get_candidate_generator:
        GenerationMixin._get_candidate_generator = _ORIGINAL_CANDIDATE_GENERATOR
    if _ORIGINAL_LOAD_ASSISTANT_MODEL is not None:
        from transformers.pipelines import base

        if base.load_assistant_model is _load_assistant_model:
            base.load_assistant_model = _ORIGINAL_LOAD_ASSISTANT_MODEL
