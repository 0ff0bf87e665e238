"""What a TreeSpark `generate()` call returns: per-round records, the output type, and where a stop cuts a round.

Apart from the decoding loop (`generation.py`) because the hand-off to transformers' loop (`handoff.py`) builds
the same records and output, and the loop cuts a round's tokens where plain decoding would have stopped (`first_stop`);
the package's entry and the demo read these types without the loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..core.tree import DraftTree
from .engine import Round


@dataclass
class RoundRecord:
    """What happened in one drafting round.

    tree_size: non-root nodes verified. num_accepted: accepted non-root nodes, of which
    `lookup_accepted` only a lookup branch had proposed.
    accepted_path: node indices (into the packed tree, root excluded) of the accepted path.
    `datastore_accepted` only the datastore had proposed.
    committed: tokens committed this round (accepted tokens, then the bonus unless the round
    stopped first). tree: the packed tree (`tokens`, `parents`, `depths`, `scores`, root first)
    and `candidates` (every proposed node with `packed` flags), when requested.
    kind: what proposed the tree (`engine.ROUND_KINDS`: "drafter", "lookup", "gated", "probe", or "plain" for a step of
    transformers' loop after a hand-off). seconds: the round's wall time as the batch-1 loop saw it (None in a batch,
    whose rows share each round, and for a handed-off step).
    """

    tree_size: int
    num_accepted: int
    accepted_path: list[int]
    committed: list[int]
    tree: dict | None = None
    lookup_accepted: int = 0
    datastore_accepted: int = 0
    kind: str = "drafter"
    seconds: float | None = None

    @property
    def acceptance_length(self) -> int:
        return len(self.committed)

    @classmethod
    def of(cls, rnd: Round, committed: list[int], keep_tree: bool = False, seconds: float | None = None
           ) -> RoundRecord:
        """The record of an engine round whose `committed` tokens (possibly cut by a stop) were kept."""
        accepted = min(rnd.num_accepted, len(committed))
        return cls(tree_size=rnd.tree.num_nodes, num_accepted=accepted,
                   accepted_path=rnd.acceptance.path[0, 1:accepted + 1].tolist(), committed=committed,
                   tree=tree_record_dict(rnd.tree) if keep_tree else None,
                   lookup_accepted=rnd.lookup_accepted(accepted), datastore_accepted=rnd.datastore_accepted(accepted),
                   kind=rnd.kind, seconds=seconds)

    @classmethod
    def plain_step(cls, token: int) -> RoundRecord:
        """The record of one plain decoding step (transformers' loop after a hand-off): one token, no tree."""
        return cls(tree_size=0, num_accepted=0, accepted_path=[], committed=[token], kind="plain")


@dataclass
class TreeSparkGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus per-round records.

    rounds: one `RoundRecord` per drafting round.
    acceptance_length: mean tokens committed per round (accepted nodes + bonus).
    acceptance_by_depth: fraction of rounds whose accepted path reached depth `d`, for `d = 1..D`.
    tree_budget: the budget `N` used (the one chosen when `tree_budget="auto"`).
    """

    rounds: list[RoundRecord] | None = None
    acceptance_length: float | None = None
    acceptance_by_depth: list[float] | None = None
    tree_budget: int | None = None


def acceptance_stats(rounds: list[RoundRecord], depth: int) -> tuple[float, list[float]]:
    """Mean acceptance length and per-depth acceptance rate over `rounds`."""
    if not rounds:
        return 0.0, [0.0] * depth
    mean = sum(r.acceptance_length for r in rounds) / len(rounds)
    by_depth = [sum(r.num_accepted >= d for r in rounds) / len(rounds) for d in range(1, depth + 1)]
    return mean, by_depth


def first_stop(stopping_criteria: StoppingCriteriaList, ids: torch.Tensor, num_new: int) -> int | None:
    """How many of the `num_new` last tokens plain decoding would have produced before stopping."""
    start = ids.shape[1] - num_new
    for j in range(1, num_new + 1):
        if stopping_criteria(ids[:, : start + j], None).any():
            return j
    return None


def tree_record_dict(tree: DraftTree) -> dict:
    """Plain lists describing a packed tree and its candidate pool (batch row 0)."""
    cand = tree.candidates
    no_lookup = [False] * tree.tokens.shape[1]
    return {
        "lookup": tree.lookup[0].tolist() if tree.lookup is not None else no_lookup,
        "retrieved": tree.retrieved[0].tolist() if tree.retrieved is not None else no_lookup,
        "tokens": tree.tokens[0].tolist(),
        "parents": tree.parents[0].tolist(),
        "depths": tree.depths[0].tolist(),
        "scores": tree.scores[0].tolist(),
        "candidates": {
            "tokens": cand.tokens[0].tolist(),
            "parents": cand.parents[0].tolist(),
            "depths": cand.depths[0].tolist(),
            "scores": cand.scores[0].tolist(),
            "packed": cand.packed[0].tolist(),
            "node_index": cand.node_index[0].tolist(),
            "lookup": cand.lookup[0].tolist() if cand.lookup is not None else [False] * cand.tokens.shape[1],
            "retrieved": (cand.retrieved[0].tolist() if cand.retrieved is not None
                          else [False] * cand.tokens.shape[1]),
        },
    }
