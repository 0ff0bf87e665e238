"""The seam for branch sources: what proposes nodes beside the drafter, and where sources are registered.

A branch source proposes, each round, nodes under the tree's root for the row's text; the round's planner
(`decoding.engine.RowPlanner`) grafts them into the drafter's candidate pool (`lookup.graft_nodes`: a node that
equals a drafted child is that child) and packs the pool, each node a source adds raising the round's budget by
one. The planner knows no source by name: it asks every source of the call, in order.

A new source is a class with `flag` and `propose` and one registration line:

    class Repeat:
        flag = "repeat"                      # names its nodes in `DraftTree.flags` and its phase in a profile

        def propose(self, history):          # 1-D token ids, the root `x0` last
            return [(-1, int(history[-1]), -1.0)]   # (parent: -1 the root or an earlier node, token, log step prob)

    register_source("repeat", lambda drafter, value: Repeat() if value else None)

and then `generate(..., tree_sources={"repeat": True})`. The drafter's own datastore is the source "datastore"
(`datastore.py`, registered there); prompt lookup, which also decides lookup-only rounds, stays with the planner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

Node = tuple[int, int, float]  # (parent: -1 for the root or the index of an earlier node, token, log step probability)


class BranchSource(Protocol):
    """What a round asks a source: `propose(history) -> nodes` (parents before children), and `flag`, the name its
    nodes carry in `Candidates.flags` / `DraftTree.flags` (and its phase in `PhaseTimer`)."""

    flag: str

    def propose(self, history: torch.Tensor) -> list[Node]: ...


# name -> factory(drafter, value) -> BranchSource or None (None: not used in this call). `value` is what the call
# gave for the name in `tree_sources` (or the drafter's own setting for the built-in ones).
SOURCES: dict[str, Callable[[Any, Any], BranchSource | None]] = {}


def register_source(name: str, factory: Callable[[Any, Any], BranchSource | None]) -> None:
    """Make `name` a branch source a call can ask for (`tree_sources={name: value}`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a branch source needs a name, not {name!r}")
    SOURCES[name] = factory


def build_sources(drafter, chosen: dict[str, Any]) -> list[BranchSource]:
    """The sources of a call: each `name: value` of `chosen` through its registered factory, in order; a factory
    that returns None adds nothing. Raises `ValueError` naming an unknown source and the registered ones."""
    sources = []
    for name, value in chosen.items():
        if name not in SOURCES:
            raise ValueError(f"tree_sources names {name!r}, which is not a registered branch source; registered: "
                             f"{', '.join(sorted(SOURCES)) or 'none'} (hf_treespark.sources.base.register_source)")
        source = SOURCES[name](drafter, value)
        if source is not None:
            sources.append(source)
    return sources
