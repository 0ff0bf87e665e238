"""A round's parts for one row: the target's features, the drafter pass and its candidate pool, the row's plan.

    draft    one drafter pass over `[x0, MASK * (B - 1)]`, conditioned on the target features of the positions
             committed since the last pass (`drafter_pass`); the tree policy expands a candidate pool
             (`expand_pool`, `tree.expand_tree`) and packs the `N` best nodes (`tree.pack_tree`)
    plan     `RowPlanner`: the row's lookup branches, lookup-only rounds (no drafter pass), the drafter gate, the
             datastore's branches, and packing the drafter's pool with them
    record   `Round`: the packed tree, the walk's result, how many nodes it accepted; `PhaseTimer`: time per phase

`session.DecodingSession` runs the round for `B >= 1` rows with these; `draft_pool` is the draft step for everything
else that drafts (the candidate generator, the latency measurement). Imports only torch, transformers and the
core, sources and drafter subpackages, so it ships as remote code.
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..core.tree import Candidates, DraftTree, TreePolicy, expand_tree, pack_tree
from ..core.verify import (
    Acceptance,
)
from ..drafter.modeling import TreeSparkDrafterOutput
from ..sources.lookup import (
    LOOKUP_LONG_TOKENS,
    LOOKUP_ROUND_NGRAM,
    DrafterGate,
    add_lookup_branches,
    find_lookup_branches,
    gated_branch_length,
    graft_lookup,
    graft_nodes,
    is_lookup_round,
    lookup_pool,
    max_extra_budget,
)


def feature_indices(target_layer_ids: list[int]) -> list[int]:
    """Indices into HF's `hidden_states` of the drafter's target layers (`config.target_layer_ids`):
    layer `l` is `hidden_states[l + 1]`, since index 0 holds the embeddings."""
    return [layer + 1 for layer in target_layer_ids]


def select_features(hidden_states: tuple[torch.Tensor, ...], indices: list[int]) -> torch.Tensor:
    """The drafter's conditioning: `[b, s, n_layers * d_target]`, the chosen layers concatenated."""
    return torch.cat([hidden_states[i] for i in indices], dim=-1)


def last_logits_only(target) -> dict:
    """`{"logits_to_keep": 1}` where the target's forward takes it, else `{}`: a prompt's logits are needed at its
    last position only (as plain `generate` computes them), and the LM head over every position of a prompt costs
    a quarter of a small target's forward."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


@torch.no_grad()
def target_features(target, layer_ids: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """One frozen-target forward: `([b, T, n_layers * d], [b, T, d])` = selected layers, final normed state.

    Logits are computed for the last position only where the target supports `logits_to_keep` (the
    LM head over every position is a quarter of a small target's forward, and none of it is used).
    """
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                 **last_logits_only(target))
    return select_features(out.hidden_states, feature_indices(layer_ids)), out.hidden_states[-1]


@torch.no_grad()
def drafter_pass(drafter, policy: TreePolicy, anchor: torch.Tensor, position: int,
                 new_features: torch.Tensor | None, context_cache) -> TreeSparkDrafterOutput:
    """One drafter pass for anchor `x0` (`[b]`) at `position`: its output, with depth logits `[b, D', |S|]`
    (float32) and, for a drafter with a depth-2 head, what the head reads besides the parent.

    `new_features` `[b, s, n_layers * d_target]`: target features of the positions committed since the
    last pass; they are appended to `context_cache` (the drafter's projected context). `U_k` is computed
    only for the `D'` depths the policy expands (a budget `N < B` never reaches below depth `N`).
    """
    return drafter(anchor_ids=anchor[:, None], anchor_positions=torch.full_like(anchor[:, None], position),
                   target_features=new_features, context_cache=context_cache, logit_slots=policy.expanded_depth)


def draft_pool(drafter, policy: TreePolicy, anchor: torch.Tensor, position: int,
               new_features: torch.Tensor | None, context_cache, stop_budget: int | None = None) -> Candidates:
    """The draft step: `drafter_pass`, then the tree policy's candidate pool (`tree.expand_tree`;
    `stop_budget`: its early stop)."""
    drafted = drafter_pass(drafter, policy, anchor, position, new_features, context_cache)
    return expand_pool(drafter, drafted, anchor, policy, stop_budget)


def expand_pool(drafter, drafted: TreeSparkDrafterOutput, anchor: torch.Tensor, policy: TreePolicy,
                stop_budget: int | None = None) -> Candidates:
    """`tree.expand_tree` of one pass's output with `drafter`'s Markov head, draft vocabulary, shortlist rows and
    depth-2 head: the candidate pool every decoding path packs."""
    parent_logits = None
    if drafted.depth2_inputs is not None:
        inputs = drafted.depth2_inputs
        parent_logits = lambda d, parents, rows: drafter.depth2_logits(inputs, parents, rows) if d == 2 else None  # noqa: E731
    return expand_tree(drafted.depth_logits, drafter.markov_bias, anchor, policy, drafter.draft_vocab_ids, stop_budget,
                       drafter.markov_bias_rows, parent_logits)


def drafted_rows(drafted: TreeSparkDrafterOutput, rows) -> TreeSparkDrafterOutput:
    """A pass's output for some batch rows only (`rows`: an index into its first dimension)."""
    inputs = drafted.depth2_inputs
    return TreeSparkDrafterOutput(depth_logits=drafted.depth_logits[rows],
                                  depth2_inputs=None if inputs is None else tuple(t[rows] for t in inputs))


def _max_depth(pool: Candidates, depth: int) -> int:
    """The deepest level a packed tree of `pool` can reach: the policy's `depth`, or deeper grafted branches."""
    return max(depth, int(pool.depths.max())) if pool.depths.numel() else depth


class PhaseTimer:
    """Wall time of each round phase, summed over rounds (`seconds[phase]`), for profiling a decoding call.

    Phases: `draft` (drafter pass), `tree` (expand and pack), `datastore` (its lookup), `verify` (the target
    forward), `walk` (acceptance), `commit` (cache and drafter context); `round` is the whole round as the loop sees it,
    so `round - sum(phases)` is everything else. CUDA is synchronised around each phase.
    """

    PHASES = ("draft", "tree", "datastore", "verify", "walk", "commit")

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.rounds = 0

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[phase] += time.perf_counter() - start
        self.rounds += phase == "round"


# What a round verified: a drafter pass's tree (with any lookup and datastore branches), a lookup-only branch, a
# round the drafter gate closed (a short branch or the root), the per-call guard's probe (the root alone), or a plain
# step of transformers' loop after a hand-off.
ROUND_KINDS = ("drafter", "lookup", "gated", "probe", "plain")


def synchronised_clock(device: torch.device) -> float:
    """`time.perf_counter()` once the device's queued work is done (a CUDA forward returns before it has run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Round:
    """One verified round: the packed tree, the walk's result, and how many nodes it accepted."""

    tree: DraftTree
    acceptance: Acceptance
    num_accepted: int
    verify_seconds: float | None = None  # the target forward alone (a probe's; every round's on a CPU)
    kind: str = "drafter"  # one of `ROUND_KINDS`: what proposed this round's tree

    @property
    def tokens(self) -> torch.Tensor:
        """`[1, num_accepted + 1]`: accepted tokens, then the bonus."""
        return self.acceptance.tokens[:, : self.num_accepted + 1]

    def lookup_accepted(self, count: int | None = None) -> int:
        """How many of the first `count` accepted nodes (default: all) only a lookup branch proposed."""
        return self._accepted_from(self.tree.lookup, count)

    def datastore_accepted(self, count: int | None = None) -> int:
        """How many of the first `count` accepted nodes (default: all) only the datastore proposed."""
        return self._accepted_from(self.tree.retrieved, count)

    def source_accepted(self, count: int | None = None) -> int:
        """How many of the first `count` accepted nodes (default: all) a branch source proposed (lookup, the
        datastore, a registered source) and the drafter did not."""
        return sum(self._accepted_from(flags, count) for flags in self.tree.flags.values())

    def _accepted_from(self, flags: torch.Tensor | None, count: int | None) -> int:
        if flags is None:
            return 0
        path = self.acceptance.path[0, 1: 1 + (self.num_accepted if count is None else count)]
        return int(flags[0, path].sum())


@dataclass
class RoundPlan:
    """What a round verifies, before the drafter pass: the text's lookup branches and what each branch source
    proposed (`proposed`: `(flag, nodes)` per source), and either the packed tree already (a lookup-only or gated
    round: `tree`; no drafter pass) or None (the drafter's pool is still to come: `RowPlanner.pack`)."""

    x0: torch.Tensor  # [1]
    branches: list
    proposed: list
    tree: DraftTree | None = None

    @property
    def num_proposed(self) -> int:
        return sum(len(nodes) for _, nodes in self.proposed)


class RowPlanner:
    """The per-sequence part of a round's tree: lookup branches, lookup-only rounds, the drafter gate, the branch
    sources' nodes, and packing the drafter's pool with them (`session.DecodingSession` keeps one per row).

    `max_nodes`: at most this many nodes per tree, lookup and datastore nodes included (None: the budget plus
    their allowance, as at batch size 1; 0: the root alone, a plain step).
    """

    def __init__(self, policy: TreePolicy, gate: float = 0.0, sources=(), timer: PhaseTimer | None = None,
                 max_nodes: int | None = None):
        self.policy = policy
        self.gate = DrafterGate(gate) if policy.lookup else None
        self.sources = list(sources)  # `sources.base.BranchSource`s, asked in order every round that is not lookup-only
        self.timer = timer
        self.max_nodes = max_nodes
        self.ran_drafter = False  # whether the current round ran the drafter
        self.lookup_only = False  # whether the current round is lookup-only
        self.long_lookup = False  # the last lookup-only round accepted its whole branch
        self.pricer = None  # `controller.RoundPricer` (one row): what each round carries, in place of the gate
        self.priced: tuple | None = None  # the current priced round: (match length, chain tokens, plan, prior cost)

    def _phase(self, name: str):
        return self.timer(name) if self.timer is not None else nullcontext()

    def _pack(self, pool: Candidates, x0: torch.Tensor, budget: int) -> DraftTree:
        if self.max_nodes is not None:
            budget = min(budget, self.max_nodes)
        return pack_tree(pool, x0, budget, _max_depth(pool, self.policy.depth))

    def plan(self, history: torch.Tensor, probe: bool = False) -> RoundPlan:
        """This round's plan for the unpadded text `history` (1-D, its last token the anchor `x0`); a `probe`
        verifies the root alone (a plain step, for the per-call guard: `call_guard.py`).

        With `policy.lookup`, continuations of the text's suffix found earlier in it are grafted into the
        candidate pool before packing (`lookup.py`). A round whose suffix matches strongly
        (`lookup.is_lookup_round`) verifies only its lookup branches and skips the drafter pass. So does a round
        the drafter gate closes (`lookup.DrafterGate`): it verifies a short branch of its best match, if any.
        Every other round also grafts what the branch sources propose (`sources/base.py`: the datastore's
        continuations of the text's suffix in the target's earlier outputs, a registered source's nodes); each
        node a source adds raises the round's budget by one.
        """
        x0 = history[-1:]
        self.ran_drafter = False
        self.priced = None
        if probe or self.max_nodes == 0:
            self.lookup_only = False
            return RoundPlan(x0, [], [], self._pack(lookup_pool(x0, [], self.policy.lookup), x0, 0))
        length = self.policy.lookup
        if self.pricer is not None:
            return self._priced_plan(x0, history, length)
        with self._phase("tree"):
            branches = find_lookup_branches(history, LOOKUP_LONG_TOKENS if self.long_lookup else length)
            self.lookup_only = is_lookup_round(branches)
            if self.lookup_only:
                pool = lookup_pool(x0, branches)
                return RoundPlan(x0, branches, [], self._pack(pool, x0, pool.tokens.shape[1]))
            branches = [(tokens[:length], n) for tokens, n in branches]
        proposed = []
        for source in self.sources:
            with self._phase(source.name):
                proposed.append((source.flag, source.propose(history)))
        if self.gate is not None and not self.gate.is_open:
            with self._phase("tree"):
                self.gate.skipped()
                pool = lookup_pool(x0, branches, self.policy.lookup)
                for flag, nodes in proposed:
                    pool = graft_nodes(pool, nodes, flag)
                return RoundPlan(x0, branches, proposed, self._pack(pool, x0, pool.tokens.shape[1]))
        self.ran_drafter = True
        return RoundPlan(x0, branches, proposed)

    def _chain(self, branches: list) -> list[int]:
        """The tokens a chain round verifies: the best branch (the longest, most recent match), `L` tokens after a
        match of 2 tokens or more (up to `LOOKUP_LONG_TOKENS` after a chain accepted whole, or a 3-token match),
        `LOOKUP_WEAK_TOKENS` after a 1-token match; none without a match."""
        if not branches:
            return []
        tokens, n = branches[0]
        length = self.policy.lookup
        if n >= LOOKUP_ROUND_NGRAM or self.long_lookup:
            return list(tokens)
        return list(tokens[:gated_branch_length(n, length)])

    def _priced_plan(self, x0: torch.Tensor, history: torch.Tensor, length: int) -> RoundPlan:
        """`plan` with a pricer (`controller.RoundPricer`): the best branch alone as a chain (no drafter pass; the
        root alone without a match), or the drafter's tree with the lookup branches and the sources that pay."""
        with self._phase("tree"):
            branches = find_lookup_branches(history, LOOKUP_LONG_TOKENS if self.long_lookup else length)
            n = branches[0][1] if branches else 0
            chain = self._chain(branches)
            extra = max_extra_budget(branches, length)
            if self.pricer.wants_chain(n, len(chain), extra):
                self.lookup_only = bool(chain)
                plan = RoundPlan(x0, branches, [])
                pool = graft_lookup(lookup_pool(x0, [], length), [(chain, max(n, 1))] if chain else [])
                plan.tree = self._pack(pool, x0, len(chain))
                self.priced = (n, chain, plan, self.pricer.chain_cost_prior(len(chain)))
                return plan
        self.lookup_only = False
        short = [(tokens[:length], m) for tokens, m in branches]
        proposed = []
        for source in self.sources:
            if self.pricer.source_open(source.flag):
                with self._phase(source.name):
                    proposed.append((source.flag, source.propose(history)))
        self.ran_drafter = True
        plan = RoundPlan(x0, short, proposed)
        self.priced = (n, chain, plan, self.pricer.tree_price(extra))
        return plan

    def round_kind(self, probe: bool = False) -> str:
        """The kind (`ROUND_KINDS`) of the round this planner last planned."""
        if probe:
            return "probe"
        return "lookup" if self.lookup_only else "drafter" if self.ran_drafter else "gated"

    def stop_budget(self, plan: RoundPlan) -> int | None:
        """The early stop of this round's expansion (`tree.expand_tree`): the most nodes it can pack."""
        if self.policy.auto:  # the first round of an "auto" budget chooses it from the whole pool: no early stop
            return None
        return self.policy.budget + max_extra_budget(plan.branches, self.policy.lookup) + plan.num_proposed

    def pack(self, plan: RoundPlan, pool: Candidates) -> DraftTree:
        """The drafter's candidate `pool` (batch size 1) with the plan's lookup and datastore branches, packed."""
        pool, extra = add_lookup_branches(pool, plan.branches, self.policy.lookup)
        for flag, nodes in plan.proposed:
            pool = graft_nodes(pool, nodes, flag)
        flags = {flag for flag, _ in plan.proposed if flag in pool.flags}
        extra += sum(int(pool.flags[flag][0].sum()) for flag in flags)
        return self._pack(pool, plan.x0, self.policy.budget + extra)

    def after_round(self, tree: DraftTree, rnd: Round, seconds: float | None = None) -> None:
        """Update the lookup state, and the drafter gate or the pricer, with the round's result (`seconds`: its wall
        time, where it was timed)."""
        if self.lookup_only:
            self.long_lookup = rnd.num_accepted == tree.num_nodes >= self.policy.lookup
        if self.priced is not None:
            n, chain, plan, cost = self.priced
            kind = "tree" if self.ran_drafter else "chain"
            self.pricer.observe(kind, n, chain, rnd.tokens[0].tolist(), rnd.num_accepted, seconds, cost)
            for flag, _ in plan.proposed if self.ran_drafter else ():
                flags = tree.flags.get(flag)
                if flags is not None:
                    self.pricer.observe_source(flag, int(flags[0, 1:].sum()), rnd._accepted_from(flags, None))
        elif self.ran_drafter and self.gate is not None:
            self.gate.drafted(rnd.num_accepted - rnd.source_accepted())
