"""What the benchmark compares: the decoding methods, the drafter role each needs, and one method's totals on a suite.

A method is a name, a label for the tables and the `generate` kwargs that make it (plain greedy, transformers'
prompt lookup, a DSpark drafter in chain mode, a DSpark-trained drafter in tree mode, the TreeSpark drafter in chain
and tree mode, with lookup and the datastore, and a baseline TreeSpark drafter beside it). The defaults
(`treespark_datastore`, and `baseline_datastore` for another drafter) run with the per-call guard (`tree_guard`, on by
default), as a user's call does; `treespark_unguarded` is the defaults without it (what the guard costs or saves),
`treespark_priced` the defaults, guard included, with the round pricer (`tree_gate="price"`: what pricing each
round costs or saves); those two run only when `--methods` names them (`OPT_IN_METHODS`). Every other ablation runs
without the guard, so a hand-off to plain decoding never hides what they compare. They live apart from the run so
that the report (tables, one colour per method in the plots) can name them without importing the run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PROMPT_LOOKUP_TOKENS = 10
LOOKUP_TOKENS = 7  # tokens per lookup branch for "TreeSpark + lookup" (the drafter's block size)


@dataclass(frozen=True)
class Method:
    """A decoding method: which drafter it uses (None: no drafter) and its generate kwargs."""

    name: str
    label: str
    drafter: str | None
    kwargs: dict = field(default_factory=dict)


METHODS = {
    m.name: m
    for m in (
        Method("plain", "plain greedy", None),
        Method("prompt_lookup", "prompt lookup", None, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
        Method("dspark", "DSpark (chain)", "dspark",
               {"tree_chain": True, "tree_lookup": 0, "tree_datastore": False, "tree_guard": False}),
        Method("dspark_tree", "DSpark + Tree", "dspark_tree",
               {"tree_lookup": 0, "tree_datastore": False, "tree_guard": False}),
        Method("treespark_chain", "TreeSpark drafter, chain", "treespark",
               {"tree_chain": True, "tree_lookup": 0, "tree_datastore": False, "tree_guard": False}),
        Method("treespark", "TreeSpark", "treespark",
               {"tree_lookup": 0, "tree_datastore": False, "tree_guard": False}),
        Method("treespark_lookup", "TreeSpark + lookup", "treespark",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": False, "tree_guard": False}),
        Method("treespark_datastore", "TreeSpark + lookup + datastore", "treespark",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": True}),
        # the defaults without the per-call guard (`tree_guard`, on by default): what the guard costs or saves
        Method("treespark_unguarded", "TreeSpark + lookup + datastore, no guard", "treespark",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": True, "tree_guard": False}),
        # the defaults with the round pricer (`tree_gate="price"`: each round, the best lookup branch alone or the
        # drafter's tree, whichever is priced faster): the A/B of pricing each round
        Method("treespark_priced", "TreeSpark + lookup + datastore, priced rounds", "treespark",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": True, "tree_gate": "price"}),
        # the defaults with one source switched off (the guard on, as in the defaults): what each source pays for
        Method("treespark_no_datastore", "TreeSpark + lookup, guarded (datastore off)", "treespark",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": False}),
        Method("treespark_no_lookup", "TreeSpark + datastore, guarded (lookup off)", "treespark",
               {"tree_lookup": 0, "tree_datastore": True}),
        # another TreeSpark drafter (`--drafter baseline=PATH`, e.g. the one a new drafter replaces), side by side
        Method("baseline_chain", "baseline drafter, chain", "baseline",
               {"tree_chain": True, "tree_lookup": 0, "tree_datastore": False, "tree_guard": False}),
        Method("baseline_datastore", "baseline drafter + lookup + datastore", "baseline",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": True}),
    )
}
ROLES = ("treespark", "dspark", "dspark_tree", "baseline")
# the defaults' A/B variants: run only when `--methods` names them
OPT_IN_METHODS = ("treespark_unguarded", "treespark_priced", "treespark_no_datastore", "treespark_no_lookup")
# run by default (the baseline's methods join them when a baseline drafter is given)
DEFAULT_METHODS = tuple(m for m in METHODS if METHODS[m].drafter != "baseline" and m not in OPT_IN_METHODS)
# these share one tree budget
TREE_METHODS = ("dspark_tree", "treespark", "treespark_lookup", "treespark_datastore", "treespark_unguarded",
                "treespark_priced", "treespark_no_datastore", "treespark_no_lookup", "baseline_datastore")
# the round phases of the loop itself (`engine.PhaseTimer`); every other phase is a branch source's proposals, timed
# under the source's name ("datastore", a registered source's)
LOOP_PHASES = ("draft", "tree", "verify", "walk", "commit", "round")


class BenchmarkError(RuntimeError):
    """A speculative method's output differed from plain greedy decoding."""


COMMITTED_BINS = ((1, 1), (2, 3), (4, 6), (7, 10), (11, None))  # tokens a round committed, grouped (`chain_rounds`)


def committed_bin(committed: int) -> str:
    """The `COMMITTED_BINS` label ("1", "2-3", ..., "11+") of a round that committed `committed` tokens."""
    for low, high in COMMITTED_BINS:
        if high is None or committed <= high:
            return f"{low}+" if high is None else str(low) if low == high else f"{low}-{high}"
    raise AssertionError("unreachable")


@dataclass
class MethodResult:
    """Totals of one method on one suite (`rounds_reaching_depth`: one count per depth up to the deepest drafter's
    block size)."""

    suite: str
    method: str
    label: str
    prompts: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    committed_after_prefill: int = 0
    rounds_reaching_depth: list[int] = field(default_factory=list)
    rounds: int = 0
    round_tokens: int = 0  # tokens the rounds committed (new tokens less the prefill's, one per prompt)
    bonus_tokens: int = 0  # the target's own token after each round's accepted path (a plain step's after a hand-off)
    accepted_nodes: int = 0  # accepted nodes, whoever proposed them: `round_tokens = accepted_nodes + bonus_tokens`
    lookup_accepted: int = 0  # accepted tokens that only a lookup branch had proposed
    datastore_accepted: int = 0  # accepted tokens that only the datastore had proposed
    exact: int = 0
    tokens_per_second: float | None = None
    speedup: float | None = None
    acceptance_length: float | None = None
    acceptance_by_depth: list[float] | None = None
    prompt_acceptance: list[float] = field(default_factory=list)  # each prompt's own acceptance length
    acceptance_sd: float | None = None  # standard deviation of `prompt_acceptance` (the prompt-to-prompt spread)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # a drafter method's round phases (`PhaseTimer`)
    # a drafter method's rounds by kind (`engine.ROUND_KINDS`): [rounds, verified nodes, accepted nodes, committed
    # tokens, seconds] summed
    round_kinds: dict[str, list[float]] = field(default_factory=dict)
    # rounds that verify one lookup chain (a drafter method's lookup-only rounds; prompt lookup's rounds that had a
    # candidate) by tokens committed (`COMMITTED_BINS`): {bin: [rounds, verified nodes, seconds]} summed
    chain_rounds: dict[str, list[float]] = field(default_factory=dict)
    # where a drafter method's tokens come from (`finish`): fractions of `round_tokens` that were "bonus" tokens and
    # accepted nodes only "lookup" or only the "datastore" proposed, and the rest of the accepted nodes ("drafter")
    token_shares: dict[str, float] | None = None
    # where its time goes (`finish`): fractions of `seconds` in the "drafter" pass (`draft` + `tree` phases), each
    # branch source's proposals ("sources": {phase: fraction}), the "verify" forward and the "rest" (walk, commit,
    # prefill, the loop, plain steps after a hand-off); they add up to 1
    time_shares: dict | None = None

    def add(self, new_tokens: int, seconds: float, forwards: int, rounds, phases: dict | None = None) -> None:
        """One prompt's generate call: `new_tokens` generated in `seconds` with `forwards` target forward calls (the
        prefill's included); `rounds` the drafter's rounds (None: a method without one); `phases` the seconds of
        each round phase (`engine.PhaseTimer.seconds`), if timed."""
        for phase, spent in (phases or {}).items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + spent
        self.prompts += 1
        self.new_tokens += new_tokens
        self.seconds += seconds
        self.target_forwards += forwards
        self.committed_after_prefill += new_tokens - 1
        if self.method != "plain" and forwards > 1:
            self.prompt_acceptance.append((new_tokens - 1) / (forwards - 1))
        if rounds is not None:
            self.rounds += len(rounds)
            self.round_tokens += sum(len(r.committed) for r in rounds)
            self.accepted_nodes += sum(r.num_accepted for r in rounds)
            self.bonus_tokens += sum(len(r.committed) - r.num_accepted for r in rounds)
            self.lookup_accepted += sum(r.lookup_accepted for r in rounds)
            self.datastore_accepted += sum(r.datastore_accepted for r in rounds)
            for r in rounds:
                for d in range(min(r.num_accepted, len(self.rounds_reaching_depth))):
                    self.rounds_reaching_depth[d] += 1
                if r.seconds is not None:
                    totals = self.round_kinds.setdefault(r.kind, [0, 0, 0, 0, 0.0])
                    for i, value in enumerate((1, r.tree_size, r.num_accepted, len(r.committed), r.seconds)):
                        totals[i] += value
                    if r.kind == "lookup":
                        self.add_chain_round(len(r.committed), r.tree_size, r.seconds)

    def add_chain_round(self, committed: int, nodes: int, seconds: float) -> None:
        """One round that verified a lookup chain of `nodes` tokens and committed `committed` tokens in `seconds`."""
        totals = self.chain_rounds.setdefault(committed_bin(committed), [0, 0, 0.0])
        for i, value in enumerate((1, nodes, seconds)):
            totals[i] += value

    def finish(self, plain_tps: float | None) -> None:
        """The rates from the totals: tokens/s, speedup over `plain_tps`, acceptance length and its spread, and a
        drafter method's `token_shares` and `time_shares`."""
        self.tokens_per_second = self.new_tokens / self.seconds if self.seconds else None
        if plain_tps and self.tokens_per_second:
            self.speedup = self.tokens_per_second / plain_tps
        verify_forwards = self.target_forwards - self.prompts  # every prompt's prefill produces one token
        if self.method != "plain" and verify_forwards > 0:
            self.acceptance_length = self.committed_after_prefill / verify_forwards
        if self.rounds:
            self.acceptance_by_depth = [n / self.rounds for n in self.rounds_reaching_depth]
        if len(self.prompt_acceptance) >= 2:
            self.acceptance_sd = statistics.stdev(self.prompt_acceptance)
        if self.round_tokens:
            drafter = self.accepted_nodes - self.lookup_accepted - self.datastore_accepted
            counts = {"bonus": self.bonus_tokens, "lookup": self.lookup_accepted,
                      "datastore": self.datastore_accepted, "drafter": drafter}
            self.token_shares = {key: n / self.round_tokens for key, n in counts.items()}
        if self.phase_seconds and self.seconds:
            phases = self.phase_seconds
            shares = {"drafter": (phases.get("draft", 0.0) + phases.get("tree", 0.0)) / self.seconds,
                      "sources": {name: spent / self.seconds for name, spent in phases.items()
                                  if name not in LOOP_PHASES},
                      "verify": phases.get("verify", 0.0) / self.seconds}
            shares["rest"] = 1.0 - shares["drafter"] - sum(shares["sources"].values()) - shares["verify"]
            self.time_shares = shares
