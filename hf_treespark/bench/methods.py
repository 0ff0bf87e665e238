"""What the benchmark compares: the decoding methods, the drafter role each needs, and one method's totals on a suite.

A method is a name, a label for the tables and the `generate` kwargs that make it (plain greedy, transformers'
prompt lookup, a DSpark drafter in chain mode, a DSpark-trained drafter in tree mode, the TreeSpark drafter in chain
and tree mode, with lookup and the datastore, and a baseline TreeSpark drafter beside it). The defaults
(`treespark_datastore`, and `baseline_datastore` for another drafter) run with the per-call guard (`tree_guard`, on by
default), as a user's call does; `treespark_unguarded` is the defaults without it (what the guard costs or saves);
every ablation runs without it, so a hand-off to plain decoding never hides what they compare. They live apart from the
run so that the report (tables, one colour per method in the plots) can name them without importing the run.
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
        # another TreeSpark drafter (`--drafter baseline=PATH`, e.g. the one a new drafter replaces), side by side
        Method("baseline_chain", "baseline drafter, chain", "baseline",
               {"tree_chain": True, "tree_lookup": 0, "tree_datastore": False, "tree_guard": False}),
        Method("baseline_datastore", "baseline drafter + lookup + datastore", "baseline",
               {"tree_lookup": LOOKUP_TOKENS, "tree_datastore": True}),
    )
}
ROLES = ("treespark", "dspark", "dspark_tree", "baseline")
# run by default (the baseline's methods join them when a baseline drafter is given)
DEFAULT_METHODS = tuple(m for m in METHODS if METHODS[m].drafter != "baseline" and m != "treespark_unguarded")
# these share one tree budget
TREE_METHODS = ("dspark_tree", "treespark", "treespark_lookup", "treespark_datastore", "treespark_unguarded",
                "baseline_datastore")


class BenchmarkError(RuntimeError):
    """A speculative method's output differed from plain greedy decoding."""


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
            self.lookup_accepted += sum(r.lookup_accepted for r in rounds)
            self.datastore_accepted += sum(r.datastore_accepted for r in rounds)
            for r in rounds:
                for d in range(min(r.num_accepted, len(self.rounds_reaching_depth))):
                    self.rounds_reaching_depth[d] += 1
                if r.seconds is not None:
                    totals = self.round_kinds.setdefault(r.kind, [0, 0, 0, 0, 0.0])
                    for i, value in enumerate((1, r.tree_size, r.num_accepted, len(r.committed), r.seconds)):
                        totals[i] += value

    def finish(self, plain_tps: float | None) -> None:
        """The rates from the totals: tokens/s, speedup over `plain_tps`, acceptance length and its spread."""
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
