"""The round controller: what each round of a `generate` call runs, decided in one place.

The decoding loop (`generation.treespark_decoding`) asks the controller once before every round (`next_round`) and
tells it what the round did (`observe`). The controller owns everything the call decides about speed:

    budget   the drafter's tree budget: fixed as given, or "auto" resolved here once (`budget.auto_budget` for one
             row; `budget.BatchBudget` for a batch, chosen again for the rows left as rows finish and as their
             acceptance corrects the drafter's profile); where it needs the first drafter pool's scores, the
             session calls `choose_from_scores` once
    gate     the drafter gate's threshold (`sources.lookup.DrafterGate`): `tree_gate` as given, or "auto" (this
             device's costs, `budget.gate_threshold`; for a batch, per number of rows, `BatchBudget.gate_threshold`)
    carry    one row with lookup on and `tree_gate="price"`: before each round, whether it verifies the best lookup
             branch alone (no drafter pass) or the drafter's tree, and which branch sources join it (`RoundPricer`,
             which the row's planner asks; it replaces the drafter gate there)
    guard    one row: the per-call guard (`call_guard.CallGuard`) and its probe rounds, which hand a call whose rounds
             are slower than plain steps to transformers' own loop
    plain    a batch: plain steps in transformers' own loop when "auto" finds that no tree pays for the rows left

The costs are this device's cost table (`budget.use_cost_table`) or the defaults in `budget.py`; the controller
never measures anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.tree import TreePolicy
from .budget import BatchBudget, auto_budget, gate_threshold, round_prices
from .call_guard import CallGuard, resolve_guard
from .generation_checks import real_scalar


def resolve_gate(model, drafter, policy: TreePolicy, tree_gate="auto") -> float:
    """The drafter gate's threshold for this call (`lookup.DrafterGate`): `"auto"` (this device's,
    `budget.gate_threshold`) or a number >= 0 (0: the drafter drafts every round that is not lookup-only).
    Raises `ValueError` for anything else."""
    if is_auto(tree_gate):
        return gate_threshold(model, drafter, policy) if policy.lookup else 0.0
    if is_priced(tree_gate):  # the round pricer decides in place of the gate
        return 0.0
    threshold = real_scalar(tree_gate)
    if threshold is None or not threshold >= 0:
        raise ValueError(f'tree_gate={tree_gate!r} is invalid: use "auto", "price" (price each round: the best '
                         "lookup branch alone or the drafter's tree) or a number >= 0 (drafted tokens a drafter round "
                         "must get accepted on average; 0 = always draft)")
    return threshold


def is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def is_priced(value) -> bool:
    return isinstance(value, str) and value == "price"


@dataclass
class RoundChoice:
    """What the next round runs: `budget` the drafter's budget per row (None: unchanged), `gate` the drafter gate's
    threshold (None: unchanged), `probe` the root alone (a plain step whose forward the guard times), `plain` the
    rest of the call in transformers' own loop."""

    budget: int | None = None
    gate: float | None = None
    probe: bool = False
    plain: bool = False


class RoundController:
    """The speed decisions of one `generate` call over `rows` prompts (see the module docstring).

    Args:
        target, drafter, policy: the call's models and tree policy (`policy.auto`: `tree_budget="auto"`).
        rows: the call's batch size; one row is guarded, a batch is priced by its unfinished rows.
        tree_gate: "auto", "price" (the round pricer, one row with lookup) or a number >= 0 (`resolve_gate`).
        tree_guard: True, False or a `CallGuard` (one row only; `call_guard.resolve_guard`).
        guardable: whether the call can be handed off mid-way (no scores or logits returned, no padding).
        walk_processed: the rounds walk processed scores (sampling, processors): a batch never switches to plain
            steps mid-way then.

    After construction: `policy` is the session's policy (its budget fixed where one row's "auto" chose it
    already), `budget` the budget to start a batch with (None: one row, or chosen from the first pool),
    `gate` the gate's starting threshold, `plain_from_start` whether no tree pays for the batch at all.
    """

    def __init__(self, target, drafter, policy: TreePolicy, rows: int, tree_gate="auto", tree_guard=True,
                 guardable: bool = True, walk_processed: bool = False):
        self.target, self.drafter, self.rows = target, drafter, rows
        self.walk_processed = walk_processed
        self.batched = rows > 1
        self.guard: CallGuard | None = None
        self.pricer: RoundPricer | None = None  # one row with lookup and `tree_gate="price"`: what each round carries
        self.budget: int | None = None
        self.first_budget: int | None = None  # a batch's first round's budget (None until chosen)
        self._active = rows
        self.awaiting_scores = False  # "auto" waits for the first drafter pool's scores (`choose_from_scores`)
        if self.batched:
            self.chooser = BatchBudget(target, drafter, policy)
            self.auto_gate = is_auto(tree_gate)
            self.gate = 0.0 if self.auto_gate else resolve_gate(target, drafter, policy, tree_gate)
            self.awaiting_scores = self.chooser.needs_scores
            self.budget = self.first_budget = None if self.awaiting_scores else self.chooser(rows)
            self.policy = policy
        else:
            self.chooser = None
            self.auto_gate = False
            if policy.auto:
                chosen = auto_budget(target, drafter, policy)
                if chosen is not None:
                    policy = policy.with_budget(chosen)
                self.awaiting_scores = chosen is None
            self.policy = policy
            self.gate = resolve_gate(target, drafter, policy, tree_gate)
            self.guard = resolve_guard(tree_guard, guardable)
            if is_priced(tree_gate) and policy.lookup and not self.awaiting_scores:  # the pricer replaces the gate
                self.pricer = RoundPricer(*round_prices(target, drafter, policy, NODE_COST))
        self._original = policy

    @property
    def plain_from_start(self) -> bool:
        """A batch for which no tree pays at all: transformers' own loop decodes it."""
        return self.budget == 0

    def choose_from_scores(self, scores) -> int:
        """The budget "auto" takes from the first drafter pool's scores (`[b, C]`, root excluded): the session's
        `choose_budget` callback, called once."""
        self.awaiting_scores = False
        if self.chooser is None:
            return auto_budget(self.target, self.drafter, self._original, scores[0])
        self.chooser.from_scores(scores)
        return self.chooser(self._active)

    def next_round(self, active: int, budget: int) -> RoundChoice:
        """The next round for `active` unfinished rows, the session running at `budget` now."""
        self._active = active
        if self.guard is not None:
            return RoundChoice(probe=self.guard.probing, plain=self.guard.should_hand_off)
        if self.chooser is None:
            return RoundChoice()
        choice = RoundChoice()
        if not self.awaiting_scores:
            choice.budget = budget = self.chooser(active)
            if budget == 0 and self.chooser.policy.auto and not self.walk_processed:
                return RoundChoice(plain=True)  # no tree pays for these rows any more
        if self.auto_gate:
            choice.gate = self.chooser.gate_threshold(active, budget)
        return choice

    def observe(self, budget: int, drafted_tokens: list[int], committed: list[int], seconds: float, probe: bool,
                verify_seconds: float | None) -> None:
        """A round ran at `budget`: each row's tokens from the walk (`drafted_tokens`, bonus included) and the ones
        committed (`committed`, cut where a stopping criterion was met), in `seconds` of wall time; `probe` (one row)
        and its target forward's `verify_seconds`."""
        if self.first_budget is None:
            self.first_budget = budget
        if self.chooser is not None:
            self.chooser.observe(budget, drafted_tokens)
        if self.guard is not None:
            self.guard.observe(verify_seconds if probe else seconds, committed[0], probe, verify_seconds)


# ----- what a row's round carries: a chain of the best lookup branch, or the drafter's tree --------------------------
PRICE_SMOOTHING = 0.2  # weight of the newest round in a running estimate
PRICE_EXPLORE = 16  # rounds without a tree after which a row drafts one anyway (its estimate follows the text)
SOURCE_REST = 32  # rounds a branch source that does not pay its nodes steps aside
SOURCE_PRIOR = 0.5  # a source's running gain (accepted tokens less its nodes' cost) before its rounds say otherwise
# What the pricer assumes before a row's own rounds say otherwise: the tokens the best lookup branch gets accepted
# by the length of its match (the target's own ShareGPT answers, 63k positions: 0.6 / 1.8 / 4.6 after a 1 / 2 /
# 3-token match), and a verified node's cost beyond a plain step, in plain steps (the 2-core CPUs: a verify
# forward of 17 tokens costs about 1.5 plain steps).
CHAIN_PRIOR = {0: 0.0, 1: 0.6, 2: 1.8, 3: 4.6}
NODE_COST = 0.03


def _ema(old: float, new: float) -> float:
    return (1 - PRICE_SMOOTHING) * old + PRICE_SMOOTHING * new


class RoundPricer:
    """What a row's next round carries, priced before drafting (one row per call; `engine.RowPlanner` asks it).

    A round can verify the best lookup branch alone, as a chain (no drafter pass; the root alone when nothing
    matches: a plain step), or the drafter's tree with the lookup branches and the branch sources' nodes. For the
    length `n` of the text's longest suffix match (0, 1, 2, 3 or more tokens) the pricer keeps two estimates of the
    tokens a round commits beyond its bonus: `chain[n]`, what the best branch gets accepted (seen after every round
    with a branch: the branch against the tokens committed from that round on, whatever the rounds verified; a
    branch that still agrees with all a tree round committed is followed into the next rounds), and `tree[n]`,
    what a tree round got accepted (seen in tree rounds). Each kind's cost is what its rounds took (seconds, every
    round timed on a CPU), priced before any is seen by the cost table (`chain_cost`, `tree_cost` in plain steps).
    The round with the most tokens per second runs; a row that went `PRICE_EXPLORE` rounds without a tree drafts
    one, so `tree[n]` follows the text.

    Branch sources (the datastore, a registered source) step aside per stretch: a source whose nodes in tree rounds
    get fewer tokens accepted (tokens only it proposed) than their verify cost (`NODE_COST` plain steps a node) is
    left out for `SOURCE_REST` rounds, then tried again.
    """

    def __init__(self, drafted_prior: float, tree_cost: float, chain_cost):
        self.chain = dict(CHAIN_PRIOR)
        self.tree = {n: drafted_prior + 0.5 * t for n, t in CHAIN_PRIOR.items()}
        self.tree_cost_prior, self.chain_cost_prior = tree_cost, chain_cost  # plain steps; chain_cost(k)
        self.unit: float | None = None  # seconds per plain step, as this row's rounds measure it
        self.seconds = {"tree": None, "chain": None}  # running seconds per prior plain step, by kind
        self.idle = 0  # rounds since the last tree round
        self.sources: dict[str, list[float]] = {}  # flag -> [running gain - cost per round, rounds resting]
        self.open: list[list] = []  # [n, branch, tokens it agreed with so far]: branches still agreeing

    def tree_price(self, extra: int) -> float:
        """A tree round's cost before it is seen, in plain steps: the budget's, plus `extra` nodes beyond it."""
        return self.tree_cost_prior + NODE_COST * extra

    def _cost(self, kind: str, prior: float) -> float:
        per_step = self.seconds[kind] if self.seconds[kind] is not None else self.unit
        return prior * (per_step if per_step is not None else 1.0)

    def wants_chain(self, n: int, k: int, tree_nodes: int) -> bool:
        """Whether a round whose longest match is `n` tokens (a chain of `k` tokens; 0: none) verifies the chain
        rather than a tree of the budget and `tree_nodes` nodes more."""
        n = min(n, 3)
        if self.idle >= PRICE_EXPLORE:
            return False
        chain = (1 + min(self.chain[n], k)) / self._cost("chain", self.chain_cost_prior(k))
        tree = (1 + self.tree[n]) / self._cost("tree", self.tree_price(tree_nodes))
        return chain > tree

    def observe(self, kind: str, n: int, branch: list[int], tokens: list[int], accepted: int, seconds: float | None,
                prior_cost: float) -> None:
        """A round: `kind` "chain" or "tree", its longest match `n`, the best branch `branch` (empty: none), the tokens
        it committed (`tokens`: accepted, then the bonus), its `accepted` nodes, its wall `seconds` (None: not
        timed) and its cost as priced (`prior_cost`, plain steps)."""
        n = min(n, 3)
        self._follow([n, list(branch), 0] if branch else None, tokens)
        if kind == "tree":
            self.tree[n] = _ema(self.tree[n], accepted)
            self.idle = 0
        else:
            self.idle += 1
        if seconds is not None and prior_cost > 0:
            per_step = seconds / prior_cost
            self.unit = per_step if self.unit is None else _ema(self.unit, per_step)
            old = self.seconds[kind]
            self.seconds[kind] = per_step if old is None else _ema(old, per_step)

    def _follow(self, new: list | None, tokens: list[int]) -> None:
        """Match the open branches (and `new`, this round's best branch) against the tokens this round committed;
        a branch that disagrees, or agreed to its end, updates `chain[n]` with the tokens it agreed with. A tree
        round commits what its own nodes got accepted, so a branch that agreed with all of it stays open until the
        next rounds show how far it would have gone."""
        still = []
        for entry in self.open + ([new] if new is not None else []):
            n, branch, agreed = entry
            for token in tokens:
                if agreed == len(branch) or branch[agreed] != token:
                    break
                agreed += 1
            done = agreed == len(branch) or agreed - entry[2] < len(tokens)
            if done:
                self.chain[n] = _ema(self.chain[n], agreed)
            else:
                entry[2] = agreed
                still.append(entry)
        self.open = still

    def source_open(self, flag: str) -> bool:
        """Whether the source flagged `flag` proposes nodes this round."""
        state = self.sources.get(flag)
        if state is None or state[1] <= 0:
            return True
        state[1] -= 1
        return False

    def observe_source(self, flag: str, nodes: int, accepted: int) -> None:
        """A tree round in which the source flagged `flag` had `nodes` nodes of its own in the tree and `accepted`
        of them were accepted. Its running gain starts at `SOURCE_PRIOR` tokens a round."""
        if not nodes:
            return
        state = self.sources.setdefault(flag, [SOURCE_PRIOR, 0])
        state[0] = _ema(state[0], accepted - NODE_COST * nodes)
        if state[0] < 0:
            state[0], state[1] = SOURCE_PRIOR, SOURCE_REST
