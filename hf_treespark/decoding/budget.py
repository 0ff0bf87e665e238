"""Hardware-aware tree budget: `tree_budget="auto"`, the batch's budget, and the drafter gate's threshold.

A round commits `tau(N)` tokens on average (acceptance length at budget `N`) and costs
`t_draft(N) + t_verify(N)` seconds, so the expected throughput is

    tokens/s(N) = tau(N) / (t_draft(N) + t_verify(N)).

The cost is this device's, measured once and cached by the calibration subpackage (`calibration/latency.py`, its
trust rules and its cache file; `calibration/measure.py` measures it: `treespark calibrate`, or the first `treespark
generate`) and handed to the controller as a cost table (`use_cost_table`, wired by `import hf_treespark`). Decoding
never measures and never imports calibration: without a measured table, "auto" uses
`fallback_budget` (for a calibrated drafter on a CPU, the budget its profile implies under
`DEFAULT_CPU_ROUND_COST`; else a small tree on CPUs, a large one on accelerators).

`tau(N)` comes from the drafter's measured `config.acceptance_profile` (`{N: tau}`, written by
`calibrate_acceptance`) when it has one, and otherwise from the drafter's own tree scores for the current
prompt: with scores `s_i`, the expected number of accepted nodes of the top-`N` tree is `sum_{i <= N} exp(s_i)`.
On a GPU verify latency is nearly flat in `N` and the best budget is large; on a small CPU it
grows with `N` from the start and the best budget is small.

The same table gives the drafter gate's threshold (`gate_threshold`, `lookup.DrafterGate`): what a
drafter round at budget `N` costs beyond a plain step (a 1-token forward, `verify[0]`), in plain steps.
A batch (`BatchBudget`) prices its rounds the same way, by its number of unfinished rows.
"""

from __future__ import annotations

import math

import torch

from ..core.tree import TreePolicy

FALLBACK_BUDGET = {"cpu": 4, "accelerator": 32}  # "auto" before this device's latency was measured
FALLBACK_GATE = {"cpu": 0.35, "accelerator": 0.1}  # the drafter gate's threshold, likewise
CANDIDATE_BUDGETS = (2, 4, 8, 16, 32, 64)  # the tree budgets calibration measures, and the ones "auto" chooses among
BATCH_SIZES = (2, 4, 8, 16)  # the batch sizes calibration measures (`BatchBudget`)
BATCH_VERIFY_TOKENS = 320  # a batch's candidate budgets keep its verify forward at most this many tokens
# The controller's defaults are data: each number below, what it is for and where it came from (machine, command,
# date) are in docs/design-notes.md ("Defaults and where they came from").
# A batch's tree must be predicted this much faster than plain steps (`BatchBudget`): the calibration prompts accept
# more than some suites.
BATCH_TREE_MARGIN = 1.1
# ... and what the batch's own rows accept corrects the profile as they decode (`BatchBudget.observe`): the profile
# counts as this many row-rounds of evidence against the rows' own.
BATCH_PRIOR_ROWS = 16
# What a round (drafter pass, tree, verify forward) costs in plain decoding steps, by budget, measured with the
# shipped drafter on this project's two kinds of 2-core CPU: "auto"'s cost model until this machine's own
# latency is measured and trusted (`default_round_cost`).
DEFAULT_CPU_ROUND_COST = {
    "float32": {2: 1.34, 4: 1.59, 8: 1.76, 16: 2.04, 32: 2.54, 64: 3.68},
    "bfloat16": {4: 1.25, 8: 1.36, 16: 1.58},
}

# A round's verify forward and drafter pass for a batch of `B` rows, in plain steps of `B` rows (`BatchBudget`):
# the shipped drafter on the AVX2-only AMD EPYC, float32, grouped-query verify attention, 256 cached tokens
# (`latency.measure_round_latency(batch=B)`; up to 4 rows a plain step costs what one row's does).
DEFAULT_CPU_BATCH_ROUND_COST = {
    "float32": {
        1: {"verify": {2: 1.07, 4: 1.21, 8: 1.32, 16: 1.56, 32: 1.98, 64: 2.94},
            "draft": {2: 0.21, 4: 0.27, 8: 0.38, 16: 0.34, 32: 0.36, 64: 0.36}},
        2: {"verify": {2: 1.13, 4: 1.32, 8: 1.53, 16: 2.01},
            "draft": {2: 0.25, 4: 0.3, 8: 0.41, 16: 0.43}},
        4: {"verify": {2: 1.33, 4: 1.62, 8: 1.98, 16: 3.02},
            "draft": {2: 0.28, 4: 0.39, 8: 0.49, 16: 0.47}},
        8: {"verify": {2: 1.39, 4: 1.72, 8: 2.44, 16: 3.53},
            "draft": {2: 0.33, 4: 0.42, 8: 0.57, 16: 0.6}},
        16: {"verify": {2: 1.63, 4: 2.07, 8: 3.13, 16: 5.12},
            "draft": {2: 0.4, 4: 0.52, 8: 0.7, 16: 0.74}},
    },
}


# ----- the cost table: what this machine measured, handed to the controller -----------------------------------------
_COST_TABLE = None  # (target, drafter, policy, budgets, batch) -> latency table or None; set by `use_cost_table`


def use_cost_table(read) -> None:
    """Give the controller this machine's round costs: `read(target, drafter, policy, budgets, batch=1)` returns
    the measured latency table (`{"verify": {N: s}, "draft": {N: s}}`, `verify[0]` a plain step) or None.
    `import hf_treespark` passes `calibration.latency.cached_latency`, so decoding never imports calibration;
    None (or never called) leaves "auto" on the default table (`fallback_budget`, `default_batch_cost`)."""
    global _COST_TABLE
    _COST_TABLE = read


def measured_latency(target, drafter, policy: TreePolicy, budgets, batch: int = 1) -> dict | None:
    """This machine's round costs for `budgets` at `batch` rows from the cost table (`use_cost_table`), or None."""
    return None if _COST_TABLE is None else _COST_TABLE(target, drafter, policy, budgets, batch=batch)


def candidate_budgets(policy: TreePolicy, budgets=CANDIDATE_BUDGETS) -> tuple[int, ...]:
    """The budgets of `budgets` a tree of `policy` can fill (the policy's own budget when none fits)."""
    pool = policy.budget if policy.auto else policy.with_budget(max(budgets)).num_candidates
    return tuple(n for n in budgets if n <= pool) or (pool,)


def batch_budgets(policy: TreePolicy, batch: int) -> tuple[int, ...]:
    """The candidate budgets for `batch` rows: those whose verify forward holds at most `BATCH_VERIFY_TOKENS`
    tokens (`batch x (N + 1)`), and the smallest always."""
    budgets = candidate_budgets(policy)
    return tuple(n for n in budgets if batch * (n + 1) <= BATCH_VERIFY_TOKENS) or budgets[:1]


def measured_batch(batch: int) -> int:
    """The batch size whose latency prices `batch` rows: the next measured size up (`BATCH_SIZES`), at most the
    largest."""
    return 1 if batch <= 1 else min((b for b in BATCH_SIZES if b >= batch), default=BATCH_SIZES[-1])


def is_auto(budget) -> bool:
    return isinstance(budget, str) and budget == "auto"


def default_round_cost(target, budgets) -> dict[int, float] | None:
    """What a round costs in plain steps, by budget, on this kind of device before (or without) a trusted
    measurement of this machine: `DEFAULT_CPU_ROUND_COST` for a CPU in its dtype, for the budgets it has a
    figure for; None elsewhere."""
    param = next(target.parameters())
    table = DEFAULT_CPU_ROUND_COST.get(str(param.dtype).removeprefix("torch.")) if param.device.type == "cpu" else None
    costs = {n: table[n] for n in budgets if n in table} if table else {}
    return costs or None


def default_batch_cost(target, budgets, batch: int) -> dict[str, dict[int, float]] | None:
    """`{"verify": {N: r}, "draft": {N: r}}` for a round of `batch` rows (a measured size) in plain steps of that batch,
    on a CPU before (or without) a trusted measurement of this machine (`DEFAULT_CPU_BATCH_ROUND_COST`, float32's for
    another dtype); None elsewhere or without figures for these budgets."""
    param = next(target.parameters())
    if param.device.type != "cpu":
        return None
    tables = DEFAULT_CPU_BATCH_ROUND_COST.get(str(param.dtype).removeprefix("torch."),
                                              DEFAULT_CPU_BATCH_ROUND_COST["float32"])
    table = tables.get(batch)
    if not table:
        return None
    known = [n for n in budgets if n in table["verify"] and n in table["draft"]]
    return {part: {n: table[part][n] for n in known} for part in ("verify", "draft")} if known else None


class BatchBudget:
    """The budget and the drafter gate's threshold for a batch (`session.py`), by the number of unfinished rows `B`.

    Budget (`tree_budget="auto"`; a fixed budget stays as given): the one with the most committed tokens per
    second, `tau(N) / cost_B(N)` (`cost_B(N)`: a round of `B` rows at budget `N`, drafter pass included, in plain
    steps of `B` rows), or 0 (plain decoding) when none beats a plain step by `BATCH_TREE_MARGIN`. A verify
    forward of `B x (N + 1)` tokens costs more the larger `B` (on a CPU a plain step of many rows is already
    compute-bound), so the budget shrinks as the batch grows and grows again as rows finish. `cost_B`: this
    device's latency measured for `B` rows (`calibrate_latency(batch=B)`, `treespark calibrate --batch-sizes`),
    rounded up to a measured size
    (`measured_batch`), else `default_batch_cost`. `tau(N)`: the drafter's `batch_acceptance_profile` (rounds of a
    batch, lookup and datastore branches within the `N` nodes; `calibrate_batch_acceptance`), else its
    `acceptance_profile`, else (`needs_scores`) the first drafter pool's scores, averaged over rows.

    Correction (`observe`): the profile was measured on calibration prompts, and a batch's own rows may accept
    less (or more). Each round's committed tokens per row correct it: `tau(N) = 1 + s (tau_profile(N) - 1)`, `s`
    the rows' drafted tokens per round (beyond the bonus) over the profile's at the budgets they ran, the profile
    counting as `BATCH_PRIOR_ROWS` row-rounds. A batch whose rows accept too little for its tree falls back to
    plain steps within a few rounds.

    Gate (`gate_threshold`): one drafter pass serves every row, and the rows' lookup and datastore branches are
    verified with or without it, so the pass has to earn its own cost: the batch's drafter gate (one
    `lookup.DrafterGate` shared by the rows) stays open while the drafted tokens accepted per row and drafter
    round reach `t_draft_B(N) / t_plain_B`, the pass in plain steps of the batch. Measured with the shipped drafter
    (4 rows, 8 MT-Bench and 8 HumanEval prompts, float32, 2-core CPU): the pass is 0.3 plain steps and adds
    0.07-0.15 accepted tokens per row to the lookup and datastore branches; rounds without it ran 1.03-1.14x faster.
    """

    def __init__(self, target, drafter, policy: TreePolicy):
        self.target, self.drafter, self.policy = target, drafter, policy
        profile = (getattr(drafter.config, "batch_acceptance_profile", None)
                   or getattr(drafter.config, "acceptance_profile", None))
        self.acceptance = profile_acceptance(profile, candidate_budgets(policy)) if profile else None
        self.chosen: dict[int, int] = {}  # by batch size
        self._costs: dict[int, dict | None] = {}  # round_cost by batch size: read once per generate call
        # the rows' drafted tokens committed (beyond each round's bonus), the profile's prediction for the same
        # rounds, and their number (`observe`)
        self.accepted, self.predicted, self.row_rounds = 0.0, 0.0, 0

    @property
    def scale(self) -> float:
        """`s`: the rows' drafted tokens per round over the profile's, the profile counting as `BATCH_PRIOR_ROWS`
        row-rounds (1 before any round)."""
        if not self.row_rounds or self.predicted <= 0:
            return 1.0
        prior = BATCH_PRIOR_ROWS * self.predicted / self.row_rounds
        return (self.accepted + prior) / (self.predicted + prior)

    def observe(self, budget: int, tokens: list[int]) -> None:
        """One round of the batch at `budget`: `tokens`, each row's committed tokens (bonus included). Only "auto"
        with a profile at that budget learns from it (a fixed budget stays; plain steps tell nothing)."""
        if not self.policy.auto or self.acceptance is None or budget not in self.acceptance or not tokens:
            return
        self.accepted += sum(count - 1 for count in tokens)
        self.predicted += len(tokens) * (self.acceptance[budget] - 1)
        self.row_rounds += len(tokens)
        self.chosen.clear()

    @property
    def needs_scores(self) -> bool:
        return self.policy.auto and self.acceptance is None

    def from_scores(self, scores: torch.Tensor) -> None:
        """`tau(N)` from a drafter pool's scores (`[b, C]`), averaged over its rows (`score_acceptance`)."""
        rows = [score_acceptance(row, candidate_budgets(self.policy)) for row in scores]
        self.acceptance = {n: sum(r[n] for r in rows) / len(rows) for n in rows[0]}
        self.chosen.clear()

    def round_cost(self, batch: int) -> dict[str, dict[int, float]] | None:
        """`{"verify": {N: r}, "draft": {N: r}}`: a round's parts for `batch` rows in plain steps of `batch` rows,
        measured, else the default; None without either. Read once per batch size (the latency cache is a file)."""
        if batch not in self._costs:
            self._costs[batch] = self._round_cost(batch)
        return self._costs[batch]

    def _round_cost(self, batch: int) -> dict[str, dict[int, float]] | None:
        size = measured_batch(batch)
        budgets = batch_budgets(self.policy, size)
        latency = measured_latency(self.target, self.drafter, self.policy, budgets, batch=size)
        if latency is not None:
            step = latency["verify"][0]
            return {part: {n: latency[part][n] / step for n in budgets} for part in ("verify", "draft")}
        return default_batch_cost(self.target, budgets, size)

    def __call__(self, batch: int) -> int:
        if not self.policy.auto:
            return self.policy.budget
        if batch not in self.chosen:
            self.chosen[batch] = self._choose(batch)
        return self.chosen[batch]

    def _choose(self, batch: int) -> int:
        costs = self.round_cost(batch)
        if not costs or self.acceptance is None:  # an accelerator without a measurement: the batch-1 default
            return fallback_budget(self.target, self.policy, self.drafter)
        tau = {n: 1 + self.scale * (self.acceptance[n] - 1) for n in costs["verify"] if n in self.acceptance}
        rate = {0: BATCH_TREE_MARGIN} | {n: tau[n] / (costs["verify"][n] + costs["draft"][n]) for n in tau}
        return max(rate, key=lambda n: (rate[n], -n))

    def gate_threshold(self, batch: int, budget: int) -> float:
        """The batch's drafter gate threshold at `budget`: the drafter pass in plain steps of `batch` rows
        (`FALLBACK_GATE` without a cost for it)."""
        costs = self.round_cost(batch)
        if not costs or not costs["draft"]:
            return FALLBACK_GATE["cpu" if next(self.target.parameters()).device.type == "cpu" else "accelerator"]
        n = min(costs["draft"], key=lambda b: (abs(b - budget), b))
        return costs["draft"][n]


def fallback_budget(target, policy: TreePolicy, drafter=None) -> int:
    """The budget "auto" uses without this device's (trusted) latency: for a drafter with a calibrated
    `acceptance_profile` on a CPU, the best under `default_round_cost`; else small on CPUs (verify cost grows
    with `N` from the start), large on accelerators (nearly flat in `N`)."""
    profile = getattr(getattr(drafter, "config", None), "acceptance_profile", None)
    costs = default_round_cost(target, candidate_budgets(policy)) if profile else None
    if costs:
        acceptance = profile_acceptance(profile, sorted(costs))
        return max(costs, key=lambda n: (acceptance[n] / costs[n], -n))
    device = next(target.parameters()).device
    return min(FALLBACK_BUDGET["cpu" if device.type == "cpu" else "accelerator"], policy.budget)


def gate_threshold(target, drafter, policy: TreePolicy) -> float:
    """The drafter gate's threshold for this device (`lookup.DrafterGate`): `(t_draft(N) + t_verify(N)) /
    t_verify(0) - 1`, the extra cost of a drafter round at the policy's budget (the smallest measured one
    while "auto" is undecided) over a plain step, in plain steps; without this device's (trusted) latency,
    `FALLBACK_GATE`. Either way 0 (the gate stays open) when the drafter's calibrated acceptance profile gets
    at least that many drafted tokens accepted at that budget. Never measures."""
    budgets = candidate_budgets(policy)
    latency = measured_latency(target, drafter, policy, budgets)
    if latency is None:
        device = next(target.parameters()).device
        n = fallback_budget(target, policy, drafter) if policy.auto else policy.budget
        costs = default_round_cost(target, [n])
        threshold = costs[n] - 1.0 if costs else FALLBACK_GATE["cpu" if device.type == "cpu" else "accelerator"]
    else:
        n = min(budgets) if policy.auto else min(budgets, key=lambda b: (abs(b - policy.budget), b))
        threshold = max(0.0, (latency["draft"][n] + latency["verify"][n]) / latency["verify"][0] - 1.0)
    profile = getattr(drafter.config, "acceptance_profile", None)
    if profile and profile_acceptance(profile, [n])[n] - 1.0 >= threshold:
        return 0.0  # its calibrated rounds pay for themselves: draft every round (see lookup.py, "The drafter gate")
    return threshold


def profile_acceptance(profile: dict, budgets) -> dict[int, float]:
    """Acceptance length at each budget, interpolated from a measured `{N: tau}` profile.

    Linear in `log(1 + N)` between measured budgets, through `tau(0) = 1` (the bonus token
    alone), and flat beyond the largest measured budget (no extrapolated gains).
    """
    points = sorted((int(n), float(t)) for n, t in profile.items())
    points = [(0, 1.0)] + [p for p in points if p[0] > 0]
    out = {}
    for n in budgets:
        if n >= points[-1][0]:
            out[n] = points[-1][1]
            continue
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if n0 <= n <= n1:
                w = (math.log1p(n) - math.log1p(n0)) / (math.log1p(n1) - math.log1p(n0))
                out[n] = t0 + w * (t1 - t0)
                break
    return out


def score_acceptance(scores: torch.Tensor, budgets) -> dict[int, float]:
    """Expected acceptance length from the drafter's own path log-probabilities (root excluded).

    The top-`N` packed tree is the `N` best-scoring candidates, and a node is accepted with the
    probability of its whole path, so `tau(N) = 1 + sum of the N largest exp(scores)`.
    """
    mass = scores.detach().float().exp().sort(descending=True).values.cumsum(0)
    return {n: 1.0 + float(mass[min(n, mass.numel()) - 1]) for n in budgets}


def choose_budget(acceptance: dict[int, float], latency: dict) -> tuple[int, dict[int, float]]:
    """The budget with the most expected committed tokens per second, and each budget's rate."""
    rate = {n: acceptance[n] / (latency["verify"][n] + latency["draft"][n]) for n in acceptance}
    best = max(rate, key=lambda n: (rate[n], -n))
    return best, rate


def auto_budget(target, drafter, policy: TreePolicy, first_tree_scores: torch.Tensor | None = None,
                budgets=CANDIDATE_BUDGETS) -> int | None:
    """Pick the budget for this device, target and drafter (see the module docstring); never measures.

    Uses the cached latency (`fallback_budget` when there is none) and the drafter's acceptance
    profile, or else the candidate pool's scores `first_tree_scores`; None when it needs those scores.
    """
    budgets = candidate_budgets(policy, budgets)
    latency = measured_latency(target, drafter, policy, budgets)
    if latency is None:
        return fallback_budget(target, policy, drafter)
    profile = getattr(drafter.config, "acceptance_profile", None)
    if profile:
        acceptance = profile_acceptance(profile, budgets)
    elif first_tree_scores is not None:
        acceptance = score_acceptance(first_tree_scores, budgets)
    else:
        return None
    best, _ = choose_budget(acceptance, latency)
    return best


def round_prices(target, drafter, policy: TreePolicy, node_cost: float) -> tuple[float, float, object]:
    """`(drafted, tree_cost, chain_cost)` for one row at the policy's budget `N`, before its rounds are seen:
    the drafted tokens a tree round gets accepted (`tau(N) - 1` from the drafter's acceptance profile, else 0.8),
    a tree round's cost (drafter pass and verify forward) and `chain_cost(k)`, a chain of `k` lookup tokens' (a
    verify forward of `k + 1` tokens), in plain steps. This machine's measured costs (the cost table) where it
    has them, else the default table, else a plain step plus `node_cost` a node."""
    n = policy.budget
    profile = getattr(drafter.config, "acceptance_profile", None)
    drafted = profile_acceptance(profile, [n])[n] - 1.0 if profile else 0.8
    budgets = candidate_budgets(policy)
    latency = measured_latency(target, drafter, policy, budgets)
    if latency is not None:
        step = latency["verify"][0]
        near = min(budgets, key=lambda b: (abs(b - n), b))
        verify = sorted((int(b), s / step) for b, s in latency["verify"].items())

        def chain_cost(k: int) -> float:  # linear between measured verify forwards
            for (b0, c0), (b1, c1) in zip(verify, verify[1:], strict=False):
                if b0 <= k <= b1:
                    return c0 + (c1 - c0) * (k - b0) / (b1 - b0)
            return verify[-1][1] + node_cost * (k - verify[-1][0])

        return drafted, (latency["draft"][near] + latency["verify"][near]) / step, chain_cost
    costs = default_round_cost(target, [n])
    tree = costs[n] if costs else 1.0 + 0.3 + node_cost * n
    return drafted, tree, lambda k: 1.0 + node_cost * k
