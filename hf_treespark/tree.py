"""The deployed tree policy: expand, prune, pack (SPEC section 2).

One implementation, shared by inference (`generation.py`) and training replay
(`training/replay.py`). Everything is batched torch; the only Python loop runs over depths.

Node layout of a packed tree: index 0 is the root (the anchor token `x0`), indices `1..N`
are the packed nodes ordered by depth, so parents always precede their children.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TreePolicy:
    """Knobs of the tree policy. Chain mode (`topk=1, frontier=1, budget=depth`) is DSpark drafting."""

    topk: int = 4
    frontier: int = 4
    budget: int = 32
    depth: int = 7

    @classmethod
    def chain(cls, depth: int) -> TreePolicy:
        return cls(topk=1, frontier=1, budget=depth, depth=depth)

    def validate(self, block_size: int) -> None:
        for name in ("topk", "frontier", "budget", "depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tree {name}={value!r} is invalid: it must be a positive integer")
        if self.depth > block_size:
            raise ValueError(f"tree depth={self.depth} exceeds the drafter's block size {block_size}; "
                             f"use a depth between 1 and {block_size}")

    @property
    def expanded_depth(self) -> int:
        """Depths worth drafting: a prefix-closed set of `N` nodes never reaches below depth `N`."""
        return min(self.depth, self.budget)

    @property
    def num_candidates(self) -> int:
        """Candidates before packing: `k + (D' - 1) * min(F, ...) * k`, `D'` the expanded depth."""
        total, width = self.topk, self.topk
        for _ in range(1, self.expanded_depth):
            width = min(self.frontier, width) * self.topk
            total += width
        return total


@dataclass
class DraftTree:
    """A packed candidate tree per batch row (root at index 0).

    tokens:    `[b, N + 1]` token of each node (`tokens[:, 0]` is `x0`).
    parents:   `[b, N + 1]` index of each node's parent (-1 for the root).
    depths:    `[b, N + 1]` depth of each node (0 for the root).
    scores:    `[b, N + 1]` joint score, sum of `log p_k(token | parent token)` along the path.
    ancestors: `[b, N + 1, N + 1]` bool, row `i` marks `i` and all its ancestors.
    candidates: the candidate pool before packing (`Candidates`), for inspection and replay.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    ancestors: torch.Tensor
    candidates: Candidates

    @property
    def num_nodes(self) -> int:
        """Number of non-root nodes `N`."""
        return self.tokens.shape[1] - 1


@dataclass
class Candidates:
    """Every candidate proposed before global packing, in depth-major order (`C` of them).

    tokens/parents/depths/scores: `[b, C]`; `parents` index into the candidates (-1 = root).
    packed: `[b, C]` bool, which candidates global packing kept.
    node_index: `[b, C]` position of each candidate in the packed tree (-1 if not packed).
    expansions: per depth `k = 1..D`, the expanded parents: `(parent_candidate [b, P_k] (-1 = root),
        parent_tokens [b, P_k], child_candidates [b, P_k, topk])`.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    packed: torch.Tensor
    node_index: torch.Tensor
    expansions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def build_tree(
    depth_logits: torch.Tensor,
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
    root_tokens: torch.Tensor,
    policy: TreePolicy,
) -> DraftTree:
    """Build the packed tree from one drafter pass.

    Args:
        depth_logits: `[b, >= D, V]` depth logits `U_k` (slot `k - 1` drafts depth `k`).
        markov_bias: parent tokens `[b, P]` -> Markov correction `[b, P, V]`.
        root_tokens: `[b]` anchor tokens `x0`.
        policy: topk `k`, frontier width `F`, budget `N`, depth `D`.

    Scores: `score(n) = score(parent) + log_softmax(U_d + W2(W1[token(parent)]))[token(n)]`.
    Frontier pruning keeps the `F` best nodes of each depth for expansion; global packing keeps
    the `N` best candidates, ties going to the smaller depth. Since scores never increase along a
    path, the packed set is prefix-closed. Runs without gradient: choices are discrete.
    """
    with torch.no_grad():
        return _build_tree(depth_logits, markov_bias, root_tokens, policy)


def _build_tree(depth_logits, markov_bias, root_tokens, policy: TreePolicy) -> DraftTree:
    b = root_tokens.shape[0]
    device = root_tokens.device
    k = policy.topk
    tokens, parents, depths, scores, expansions = [], [], [], [], []
    # Frontier of depth 0: the root.
    front_tok = root_tokens[:, None]  # [b, 1]
    front_score = torch.zeros(b, 1, device=device)
    front_cand = torch.full((b, 1), -1, dtype=torch.long, device=device)
    offset = 0
    for d in range(1, policy.expanded_depth + 1):  # deeper candidates could never be packed
        logp = torch.log_softmax(depth_logits[:, d - 1, None, :].float() + markov_bias(front_tok), dim=-1)  # [b, P, V]
        top_logp, top_tok = logp.topk(k, dim=-1)  # [b, P, k]
        num_parents = front_tok.shape[1]
        child_scores = (front_score[:, :, None] + top_logp).reshape(b, num_parents * k)
        child_ids = offset + torch.arange(num_parents * k, device=device)
        expansions.append((front_cand, front_tok, child_ids.view(1, num_parents, k).expand(b, -1, -1)))
        tokens.append(top_tok.reshape(b, -1))
        parents.append(front_cand[:, :, None].expand(-1, -1, k).reshape(b, -1))
        depths.append(torch.full((b, num_parents * k), d, dtype=torch.long, device=device))
        scores.append(child_scores)
        # Frontier pruning: the F best nodes of this depth expand into the next.
        keep = child_scores.topk(min(policy.frontier, num_parents * k), dim=-1).indices  # [b, F]
        front_tok = tokens[-1].gather(1, keep)
        front_score = child_scores.gather(1, keep)
        front_cand = offset + keep
        offset += num_parents * k

    cand_tokens, cand_parents = torch.cat(tokens, 1), torch.cat(parents, 1)
    cand_depths, cand_scores = torch.cat(depths, 1), torch.cat(scores, 1)
    num_cand = cand_tokens.shape[1]
    budget = min(policy.budget, num_cand)

    # Global packing: best scores first, ties to the earlier candidate (= smaller depth).
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices
    chosen = order[:, :budget].sort(dim=1).values  # [b, N], depth-major order: parents first
    packed = torch.zeros(b, num_cand, dtype=torch.bool, device=device).scatter_(1, chosen, True)
    node_index = torch.full((b, num_cand), -1, dtype=torch.long, device=device)
    node_index.scatter_(1, chosen, torch.arange(1, budget + 1, device=device).expand(b, -1))

    cand_parent_of_chosen = cand_parents.gather(1, chosen)
    node_parents = torch.where(
        cand_parent_of_chosen < 0, 0, node_index.gather(1, cand_parent_of_chosen.clamp(min=0))
    )
    root_col = lambda value, like: torch.full((b, 1), value, dtype=like.dtype, device=device)  # noqa: E731
    tree_tokens = torch.cat([root_tokens[:, None], cand_tokens.gather(1, chosen)], 1)
    tree_parents = torch.cat([root_col(-1, node_parents), node_parents], 1)
    tree_depths = torch.cat([root_col(0, cand_depths), cand_depths.gather(1, chosen)], 1)
    tree_scores = torch.cat([root_col(0.0, cand_scores), cand_scores.gather(1, chosen)], 1)
    candidates = Candidates(cand_tokens, cand_parents, cand_depths, cand_scores, packed, node_index, expansions)
    return DraftTree(tree_tokens, tree_parents, tree_depths, tree_scores,
                     ancestor_matrix(tree_parents, policy.depth), candidates)


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """`[b, n]` parent indices (-1 = root, parents first) -> `[b, n, n]` bool, row `i` = `i` and its ancestors.

    Computed as `row(i) = e_i | row(parent(i))`, iterated `max_depth` times (one gather per depth).
    """
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    index = parents.clamp(min=0)[:, :, None].expand(b, n, n)  # the root's row stays {root}
    anc = eye
    for _ in range(max_depth):
        anc = eye | anc.gather(1, index)
    return anc
