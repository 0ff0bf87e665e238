"""`treespark train --train-only`: the drafter's parts by name, and training some of them with the rest frozen.

A part is a set of the drafter's parameters, named after the modules a user sees in its weights (`model.safetensors`)
and its config. The parts that hold parameters, each parameter in exactly one:

    context        fc and hidden_norm: the projection of the target's features that every layer attends to
    layers.N       decoder layer N (N from 0)
    norm           the final norm of the block's states h_k
    anchor_proj    the anchor-features projection (a drafter with `anchor_features`)
    mask_embedding the learned mask-slot embedding (a drafter without `mask_token_id`)
    markov         the Markov head: W1 (an embedding of every target id) and W2
    confidence     the confidence head c_k(y) (a drafter with `use_confidence_head`)
    depth1_head    the depth-1 head (a drafter with `depth1_head`), depth2_head the depth-2 head (`depth2_head`)

and the groups of them: `layers` (every layer), `block` (context, layers, norm and, where the drafter has them,
anchor_proj and mask_embedding: everything that computes h_k) and `depth_heads` (the depth heads the drafter has).
The target's token embeddings and LM head are never the drafter's own: they are frozen always.

A frozen parameter gets `requires_grad = False` and stays out of the optimizer, so it is never updated (weight
decay included) and AdamW keeps no moments for it: the optimizer state of a checkpoint holds the trained parts only.
"""

from __future__ import annotations

from collections.abc import Sequence

PART_HELP = ("comma-separated parts of the drafter to train, every other part frozen (no gradient, no AdamW "
             "state): block (= context, layers, norm, and anchor_proj / mask_embedding where the drafter has them), "
             "context (fc + hidden_norm), layers or layers.N, norm, markov (the Markov head), confidence, "
             "depth1_head, depth2_head, depth_heads; a part the drafter lacks is refused, naming the ones it has. A "
             "run resumes only with the parts it was started with (default: the whole drafter)")

# part -> the module (or parameter) names of the drafter it holds, for the parts that are not layers
_MODULES = {"context": ("fc", "hidden_norm"), "norm": ("norm",), "anchor_proj": ("anchor_proj",),
            "mask_embedding": ("mask_embedding",), "markov": ("markov_head",), "confidence": ("confidence_head",),
            "depth1_head": ("depth1_head",), "depth2_head": ("depth2_head",)}


def part_names(config) -> dict[str, tuple[str, ...]]:
    """Every part name a drafter of `config` (a `TreeSparkConfig`) answers to -> the parts it stands for (a part
    stands for itself; a group for its members), in the order `--help` lists them. Read from the config alone."""
    layers = tuple(f"layers.{i}" for i in range(config.num_hidden_layers))
    optional = {"anchor_proj": bool(getattr(config, "anchor_features", False)),
                "mask_embedding": getattr(config, "mask_token_id", None) is None,
                "confidence": bool(getattr(config, "use_confidence_head", True)),
                "depth1_head": bool(getattr(config, "depth1_head", 0)),
                "depth2_head": bool(getattr(config, "depth2_head", 0))}
    has = {name for name, present in optional.items() if present}
    block = ("context", *layers, "norm", *(name for name in ("anchor_proj", "mask_embedding") if name in has))
    names = {"block": block, "context": ("context",), "layers": layers, **{layer: (layer,) for layer in layers},
             "norm": ("norm",)}
    for name in ("anchor_proj", "mask_embedding", "markov", "confidence", "depth1_head", "depth2_head"):
        if name == "markov" or name in has:
            names[name] = (name,)
    heads = tuple(name for name in ("depth1_head", "depth2_head") if name in has)
    if heads:
        names["depth_heads"] = heads
    return names


def resolve_parts(text: str | Sequence[str] | None, config) -> tuple[str, ...] | None:
    """The parts `--train-only text` (comma-separated, or a list of names) trains on a drafter of `config`, sorted,
    groups expanded (so `block` and its members written out are the same choice); None for no `--train-only` (the
    whole drafter, as without freezing).

    Raises `ValueError` in one line for an empty list, or a name the drafter does not have (naming those it has)."""
    if text is None:
        return None
    asked = [name.strip() for name in (text.split(",") if isinstance(text, str) else text)]
    if not any(asked):
        raise ValueError("--train-only is empty: name the parts to train, e.g. --train-only markov (leave it out to "
                         "train the whole drafter)")
    names = part_names(config)
    unknown = [name for name in asked if name not in names]
    if unknown:
        raise ValueError(f"--train-only: {', '.join(repr(name) for name in unknown)} is not a part of this drafter; "
                         f"its parts are {', '.join(names)}")
    return tuple(sorted({part for name in asked for part in names[name]}))


def all_parts(config) -> tuple[str, ...]:
    """Every part of a drafter of `config`, sorted: what a run without `--train-only` trains."""
    return tuple(sorted({part for members in part_names(config).values() for part in members}))


def parameter_parts(drafter) -> dict[str, str]:
    """Each parameter name of `drafter` (as `named_parameters` gives it) -> its part. Raises `ValueError` naming a
    parameter no part holds (a module this table does not know: add it to `_MODULES`)."""
    owners = {module: part for part, modules in _MODULES.items() for module in modules}
    parts = {}
    for name, _ in drafter.named_parameters():
        top, _, rest = name.partition(".")
        if top == "layers":
            parts[name] = f"layers.{rest.split('.')[0]}"
        elif top in owners:
            parts[name] = owners[top]
        else:
            raise ValueError(f"drafter parameter {name!r} belongs to no --train-only part: name its module in "
                             "hf_treespark/training/freeze.py")
    return parts


def freeze_all_but(drafter, parts: tuple[str, ...]) -> list:
    """Freeze every parameter of `drafter` outside `parts` (`resolve_parts`'s): `requires_grad_(False)`. Returns the
    trained parameters, in `drafter.parameters()` order, for the optimizer. Raises `ValueError` when `parts` names a
    part the drafter has no parameter in."""
    owner = parameter_parts(drafter)
    missing = sorted(set(parts) - set(owner.values()))
    if missing:
        raise ValueError(f"--train-only: the drafter has no {', '.join(missing)}; its parts are "
                         f"{', '.join(part_names(drafter.config))}")
    trained = []
    for name, parameter in drafter.named_parameters():
        keep = owner[name] in parts
        parameter.requires_grad_(keep)
        if keep:
            trained.append(parameter)
    return trained


def describe(parts: tuple[str, ...] | None) -> str:
    """`parts` in words, for messages: 'the whole drafter' for None."""
    return "the whole drafter" if parts is None else ", ".join(parts)
