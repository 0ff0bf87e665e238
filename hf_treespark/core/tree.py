"""The deployed tree policy: expand, prune, pack (docs/method.md).

One implementation, shared by inference (`engine.py`) and training replay
(`training/objective.py`). Everything is batched torch; the only Python loop runs over depths.
`expand_tree` proposes the candidate pool, `pack_tree` keeps the `N` best of it, and
`build_tree` does both.

Node layout of a packed tree: index 0 is the root (the anchor token `x0`), indices `1..N`
are the packed nodes ordered by depth, so parents always precede their children.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

BUDGET_POOL = 64  # the largest budget `tree_budget="auto"` considers
LOOKUP_BRANCHES = 2  # lookup branches per round at most (distinct continuations; `lookup.py`)


def as_positive_int(value, name: str) -> int:
    """`value` as an `int` when it is an integer-like positive number (int, numpy or 0-d torch integer)."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer") from None
    if number < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer")
    return number


@dataclass
class TreePolicy:
    """Knobs of the tree policy. Chain mode (`topk=1, frontier=1, budget=depth`) is DSpark drafting.

    `auto=True` (from `tree_budget="auto"`): `budget` is the candidate pool the device-specific
    choice is made from (`hf_treespark.decoding.budget`), and the decoding loop replaces it before verifying.
    `lookup`: tokens per lookup branch grafted into the pool (`lookup.py`; 0 = none).
    `shortlist`: at inference, each depth's children are chosen among its `shortlist` best draft-vocabulary entries
    by `U_d` alone (`expand_tree`; 0 = among all of them, as training replay always does).
    """

    topk: int = 4
    frontier: int = 4
    budget: int = 32
    depth: int = 7
    auto: bool = False
    lookup: int = 0
    shortlist: int = 0

    @classmethod
    def chain(cls, depth: int) -> TreePolicy:
        return cls(topk=1, frontier=1, budget=depth, depth=depth)

    @classmethod
    def from_config(cls, config, *, budget=None, topk=None, depth=None, frontier=None, chain=False, lookup=None,
                    vocab_size: int | None = None) -> TreePolicy:
        """The drafter config's policy (`tree_*` fields), overridden by per-call knobs (None = config's).

        `chain=True` drafts a single path (DSpark); a budget given with it caps the path length.
        A budget above the number of candidates is reported as the number actually packed.
        `vocab_size`: the drafter's proposal vocabulary, which `topk` may not exceed.
        Raises `ValueError` naming the first knob that cannot work.
        """
        if not isinstance(chain, bool):
            raise ValueError(f"tree_chain={chain!r} is invalid: it must be True or False")
        depth = config.block_size if depth is None else as_positive_int(depth, "tree_depth")
        if depth > config.block_size:
            raise ValueError(f"tree_depth={depth} exceeds the drafter's block size {config.block_size}; "
                             f"use a depth between 1 and {config.block_size}")
        budget = config.tree_budget if budget is None else budget
        auto = isinstance(budget, str) and budget == "auto"
        if not auto:
            budget = as_positive_int(budget, "tree_budget")
        lookup = getattr(config, "tree_lookup", 0) if lookup is None else lookup
        lookup = 0 if lookup == 0 and not isinstance(lookup, bool) else as_positive_int(lookup, "tree_lookup")
        lookup = min(lookup, depth)  # a branch deeper than the tree could never be verified whole
        shortlist = getattr(config, "tree_shortlist", 0)
        if chain:
            return cls(topk=1, frontier=1, budget=depth if auto else min(budget, depth), depth=depth, lookup=lookup,
                       shortlist=shortlist)
        topk = as_positive_int(config.tree_topk if topk is None else topk, "tree_topk")
        frontier = as_positive_int(config.tree_frontier if frontier is None else frontier, "tree_frontier")
        if vocab_size is not None and topk > vocab_size:
            raise ValueError(f"tree_topk={topk} exceeds the drafter's vocabulary of {vocab_size} tokens; "
                             f"use at most {vocab_size} children per parent")
        policy = cls(topk=topk, frontier=frontier, budget=BUDGET_POOL if auto else budget, depth=depth, auto=auto,
                     lookup=lookup, shortlist=shortlist)
        largest_pool = policy.with_budget(BUDGET_POOL * 1000).num_candidates + policy.max_lookup_nodes
        policy.budget = min(policy.budget, largest_pool)
        return policy

    def with_budget(self, budget: int) -> TreePolicy:
        """This policy at a fixed budget (`auto` resolved)."""
        return replace(self, budget=budget, auto=False)

    def validate(self, block_size: int) -> None:
        for name in ("topk", "frontier", "budget", "depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tree {name}={value!r} is invalid: it must be a positive integer")
        if self.depth > block_size:
            raise ValueError(f"tree depth={self.depth} exceeds the drafter's block size {block_size}; "
                             f"use a depth between 1 and {block_size}")

    @property
    def max_lookup_nodes(self) -> int:
        """At most how many nodes lookup branches add to the pool."""
        return LOOKUP_BRANCHES * self.lookup

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


class SourceFlags:
    """`lookup` and `retrieved`: the flags (`flags[name]`, bool, one column per node or candidate) of the nodes only a
    lookup branch, or only the datastore, proposed; None where that source added none."""

    flags: dict[str, torch.Tensor]

    @property
    def lookup(self) -> torch.Tensor | None:
        return self.flags.get("lookup")

    @property
    def retrieved(self) -> torch.Tensor | None:
        return self.flags.get("retrieved")


@dataclass
class DraftTree(SourceFlags):
    """A packed candidate tree per batch row (root at index 0).

    tokens:    `[b, N + 1]` token of each node (`tokens[:, 0]` is `x0`).
    parents:   `[b, N + 1]` index of each node's parent (-1 for the root).
    depths:    `[b, N + 1]` depth of each node (0 for the root).
    scores:    `[b, N + 1]` joint score, sum of `log p_k(token | parent token)` along the path.
    ancestors: `[b, N + 1, N + 1]` bool, row `i` marks `i` and all its ancestors.
    candidates: the candidate pool before packing (`Candidates`), for inspection and replay.
    flags: per branch source (its flag name: "lookup", "retrieved" for the datastore, a registered source's name),
        `[b, N + 1]` bool: the nodes only that source proposed (not the drafter, not an earlier source).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    ancestors: torch.Tensor
    candidates: Candidates
    flags: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        """Number of non-root nodes `N`."""
        return self.tokens.shape[1] - 1


@dataclass
class Candidates(SourceFlags):
    """Every candidate proposed before global packing, in depth-major order (`C` of them).

    tokens/parents/depths/scores: `[b, C]`; `parents` index into the candidates (-1 = root).
    packed: `[b, C]` bool, which candidates global packing kept (None before packing).
    node_index: `[b, C]` position of each candidate in the packed tree (-1 if not packed; None before packing).
    expansions: per depth `k = 1..D`, the expanded parents: `(parent_candidate [b, P_k] (-1 = root),
        parent_tokens [b, P_k], child_candidates [b, P_k, topk])`.
    flags: per branch source, `[b, C]` bool: the candidates only that source grafted (`lookup.graft_nodes`).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    packed: torch.Tensor | None
    node_index: torch.Tensor | None
    expansions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    flags: dict[str, torch.Tensor] = field(default_factory=dict)


def build_tree(
    depth_logits: torch.Tensor,
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
    root_tokens: torch.Tensor,
    policy: TreePolicy,
    vocab_ids: torch.Tensor | None = None,
) -> DraftTree:
    """Build the packed tree from one drafter pass: `pack_tree(expand_tree(...), policy.budget)`.

    Args:
        depth_logits: `[b, >= D, |S|]` depth logits `U_k` (slot `k - 1` drafts depth `k`).
        markov_bias: parent tokens `[b, P]` (target ids) -> Markov correction `[b, P, |S|]`.
        root_tokens: `[b]` anchor tokens `x0`.
        policy: topk `k`, frontier width `F`, budget `N`, depth `D`.
        vocab_ids: `[|S|]` target id of each draft-vocabulary entry, or None when `S` is the whole
            vocabulary. Tree tokens are always target ids.
    """
    pool = expand_tree(depth_logits, markov_bias, root_tokens, policy, vocab_ids)
    return pack_tree(pool, root_tokens, policy.budget, policy.depth)


@torch.no_grad()
def expand_tree(depth_logits, markov_bias, root_tokens: torch.Tensor, policy: TreePolicy,
                vocab_ids: torch.Tensor | None = None, stop_budget: int | None = None,
                markov_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                parent_logits: Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor | None] | None = None
                ) -> Candidates:
    """The candidate pool: frontier expansion over `policy.expanded_depth` depths (no packing yet).

    Scores: `score(n) = score(parent) + log p_d(token(n) | token(parent))`, with
    `log p_d(v | y) = z_v - logsumexp(z)`, `z = U_d + W2(W1[y])`: only the top-`k` entries and one
    log-sum-exp per parent are needed, never a full log-softmax row. Frontier pruning keeps the `F`
    best nodes of each depth for expansion. Runs without gradient: choices are discrete.
    `depth_logits` may hold fewer than `policy.depth` slots when only the expanded depths were computed.

    Shortlist (`policy.shortlist = M` with `markov_rows`, inference): each depth's children are chosen among the `M`
    entries of largest `U_d`, so the Markov correction is computed for `M` rows of `W2`, not all `|S|`
    (`markov_rows(parent_tokens [b, P], rows [b, M]) -> [b, P, M]`); the log-sum-exp adds the rest of the
    vocabulary at `U_d` alone. The tree can differ from the full expansion only where the parent lifts a token from
    outside the `M` into a parent's top `k`; verification is the same either way, so decoding stays exact.

    Early stop (`stop_budget=M`, inference): expansion ends after depth `d` once no frontier node
    scores above the `M`-th best candidate so far. Scores never increase along a path and ties go
    to the smaller depth, so no deeper candidate could be among the `M` best: `pack_tree` with any
    budget `<= M` packs exactly the tree of the full pool. Each depth skipped saves one Markov-head
    product (the largest part of the tree's cost). Training replay expands every depth.

    Parent logits (`parent_logits(d, parent_tokens [b, P], rows) -> [b, P, |S|]` or None, a drafter's depth-2 head): a
    depth for which it returns a tensor takes its logits from it instead of `U_d + W2(W1[y])`. With a shortlist, `rows`
    are the depth's `M` shortlisted entries and it returns their logits only (`[b, P, M]`; the rest of the vocabulary
    enters the log-sum-exp at `U_d`, as above); without one, `rows` is None and it returns whole rows.
    """
    b = root_tokens.shape[0]
    device = root_tokens.device
    k = policy.topk
    depths_to_expand = policy.expanded_depth
    shortlist = None
    if markov_rows is not None and k <= policy.shortlist < depth_logits.shape[-1]:
        u = depth_logits[:, :depths_to_expand].float()
        short_z, short_rows = u.topk(policy.shortlist, dim=-1)  # [b, D', M]
        every, kept = u.logsumexp(dim=-1), short_z.logsumexp(dim=-1)
        rest = every + torch.log1p(-torch.exp(kept - every).clamp(max=1.0))  # the other entries, -inf if none
        shortlist = (short_z, short_rows, rest)
    tokens, parents, depths, scores, expansions = [], [], [], [], []
    # Frontier of depth 0: the root.
    front_tok = root_tokens[:, None]  # [b, 1]
    front_score = torch.zeros(b, 1, device=device)
    front_cand = torch.full((b, 1), -1, dtype=torch.long, device=device)
    offset = 0
    for d in range(1, depths_to_expand + 1):  # deeper candidates could never be packed
        rows = None if shortlist is None else shortlist[1][:, d - 1]  # [b, M]
        given = parent_logits(d, front_tok, rows) if parent_logits is not None else None
        if shortlist is None:
            z = given if given is not None else depth_logits[:, d - 1, None, :].float() + markov_bias(front_tok)
            top_z, top_tok = z.topk(k, dim=-1)  # [b, P, k] indices into the draft vocabulary
            log_norm = z.logsumexp(dim=-1, keepdim=True)
        else:
            short_z, _, rest = shortlist
            z = given if given is not None else short_z[:, d - 1, None, :] + markov_rows(front_tok, rows)  # [b, P, M]
            top_z, top_at = z.topk(k, dim=-1)
            top_tok = rows[:, None, :].expand(-1, z.shape[1], -1).gather(2, top_at)
            log_norm = torch.logaddexp(z.logsumexp(dim=-1, keepdim=True), rest[:, d - 1, None, None])
        if vocab_ids is not None:
            top_tok = vocab_ids[top_tok]  # target ids
        top_logp = top_z - log_norm
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
        if stop_budget is not None and d < depths_to_expand and offset >= stop_budget:
            mth_best = torch.cat(scores, 1).topk(stop_budget, dim=1).values[:, -1]
            if bool((front_score.max(dim=1).values <= mth_best).all()):
                break
    return Candidates(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depths, 1), torch.cat(scores, 1),
                      packed=None, node_index=None, expansions=expansions)


@torch.no_grad()
def pack_tree(pool: Candidates, root_tokens: torch.Tensor, budget: int, max_depth: int) -> DraftTree:
    """Global packing: the `budget` best-scored candidates of `pool`, ties to the smaller depth.

    Since scores never increase along a path, the packed set is prefix-closed. Packing the pool of a
    larger budget gives the same tree as expanding for `budget` alone (deeper candidates never win).
    """
    b = root_tokens.shape[0]
    device = root_tokens.device
    cand_tokens, cand_parents, cand_depths, cand_scores = pool.tokens, pool.parents, pool.depths, pool.scores
    num_cand = cand_tokens.shape[1]
    budget = min(budget, num_cand)
    # Best scores first, ties to the smaller depth, then to the earlier candidate.
    by_depth = torch.sort(cand_depths, dim=1, stable=True).indices
    order = by_depth.gather(1, torch.sort(cand_scores.gather(1, by_depth), dim=1, descending=True, stable=True).indices)
    # [b, N] in depth-major order (then candidate order): parents first.
    rank = cand_depths * num_cand + torch.arange(num_cand, device=device)
    chosen = order[:, :budget]
    chosen = chosen.gather(1, rank.gather(1, chosen).sort(dim=1).indices)
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
    flags = {name: torch.cat([root_col(False, flag), flag.gather(1, chosen)], 1) for name, flag in pool.flags.items()}
    candidates = replace(pool, packed=packed, node_index=node_index)
    return DraftTree(tree_tokens, tree_parents, tree_depths, tree_scores,
                     ancestor_matrix(tree_parents, max_depth), candidates, flags)


def stack_trees(trees: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(tokens [B, W], depths [B, W], ancestors [B, W, W])`: one-row trees (`[1, ...]` each) as the rows of one
    verify forward, `W` the widest tree's nodes + 1. A smaller tree is padded with copies of its root at depth 0 that
    see only themselves (and the prefix) and are never walked. One tree is returned as it is."""
    if len(trees) == 1:
        return trees[0].tokens, trees[0].depths, trees[0].ancestors
    rows, width = len(trees), max(tree.num_nodes for tree in trees) + 1
    device = trees[0].tokens.device
    tokens = torch.stack([tree.tokens[0, :1].expand(width) for tree in trees]).clone()  # [B, W]
    depths = torch.zeros(rows, width, dtype=trees[0].depths.dtype, device=device)  # [B, W]
    ancestors = torch.eye(width, dtype=torch.bool, device=device).repeat(rows, 1, 1)  # [B, W, W]
    for i, tree in enumerate(trees):
        n = tree.num_nodes + 1
        tokens[i, :n], depths[i, :n] = tree.tokens[0], tree.depths[0]
        ancestors[i, :n, :n] = tree.ancestors[0]
    return tokens, depths, ancestors


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
