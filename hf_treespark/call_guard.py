"""The per-call guard: a `generate` call at batch size 1 whose TreeSpark rounds commit tokens more slowly than
plain steps would is handed to transformers' own loop for the rest of the call.

TreeSpark pays when a round's accepted tokens outweigh its cost (a drafter pass, a tree, a verify forward of
`N + 1` tokens): on most text by far, but not on every prompt, every device or every drafter. The budget, the
drafter gate and lookup-only rounds choose what a round verifies; this guard asks one question more, with the
clock, once the call has had time to show its pace: are the rounds faster per committed token than plain steps?

    measure   the wall time and committed tokens of every round (the whole loop iteration: draft, verify, walk,
              commit, stopping criteria, streaming)
    probe     after `GUARD_WINDOW` rounds, `GUARD_PROBES` rounds verify the root alone: a plain step through the same
              loop (one target forward of one token, nothing drafted), whose seconds per token are the plain pace
    judge     after every later round, the seconds per committed token of all the call's TreeSpark rounds so far
              against the plain pace; slower by more than `GUARD_MARGIN` (noise on a shared CPU) hands off

The judgement is on the whole call so far, not on its recent rounds: text has stretches where little is accepted,
and a hand-off is for good. Judged on the last 8 rounds instead, the guard handed off on most bench prompts and
cost 10-20% of the defaults' speed (10 prompts per suite, six suites, bf16, 2026-12-03: 1.52x / 1.74x / 1.98x
plain on MT-Bench / HumanEval / ShareGPT against 1.66x / 1.98x / 1.96x unguarded).

It is off by default (`tree_guard=True` turns it on): judged on the whole call it was level with the unguarded
defaults on HumanEval and the copy suite but still handed off on math prompts where the defaults ran at 1.8x plain
(8 prompts per suite, same machine and day: 2.00x / 2.40x / 1.48x against 2.01x / 2.43x / 1.80x; on MT-Bench 1.55x
against 1.26x, a run where plain's own pace moved by a third). The probes and the first rounds, from which the first
judgement is made, are too few to tell a slow call from a slow start.

A probe is not lost work: it commits its token, as plain decoding would. It costs what the rounds it replaces would
have gained, about one percent of a 128-token call where TreeSpark runs at twice plain. A probe round carries this
loop's own overhead beyond transformers' (the 4D mask, the walk, the commit), so the plain pace it measures is a
little slow: the guard hands off only where TreeSpark is clearly slower than plain decoding.

The hand-off (`hand_off`) continues from the session's cache, as the batched loop does (`generation_batch`), so the
output is what plain decoding gives: exact in greedy, distributed as the target in sampling.
"""

from __future__ import annotations

import time

import torch

GUARD_WINDOW = 8  # TreeSpark rounds before the probes and the first judgement
GUARD_PROBES = 2  # root-only rounds that measure the plain pace
GUARD_MARGIN = 0.05  # TreeSpark must be this much slower per token than the probes to hand off


class CallGuard:
    """The guard's state for one call. The loop asks `probing` before each round (True: verify the root alone),
    reports each round with `observe(seconds, tokens)`, and hands off once `should_hand_off` is True.

    `clock` is the time source (`time.perf_counter`; tests pass their own)."""

    def __init__(self, window: int = GUARD_WINDOW, probes: int = GUARD_PROBES, margin: float = GUARD_MARGIN,
                 clock=time.perf_counter):
        self.window, self.probes, self.margin, self.clock = window, probes, margin, clock
        self.rounds: list[tuple[float, int]] = []  # (seconds, tokens) of TreeSpark rounds
        self.probe_rounds: list[tuple[float, int]] = []  # (seconds, tokens) of root-only rounds
        self.handed_off = False

    @property
    def probing(self) -> bool:
        """Whether the next round is a probe (the root alone)."""
        return len(self.rounds) >= self.window and len(self.probe_rounds) < self.probes

    def observe(self, seconds: float, tokens: int, probe: bool) -> None:
        """A round of `seconds` that committed `tokens` (a probe if `probe`)."""
        (self.probe_rounds if probe else self.rounds).append((seconds, max(tokens, 1)))

    @property
    def plain_seconds_per_token(self) -> float | None:
        """The plain pace the probes measured (None before they ran)."""
        if len(self.probe_rounds) < self.probes or not self.probe_rounds:
            return None
        return sum(s for s, _ in self.probe_rounds) / sum(n for _, n in self.probe_rounds)

    @property
    def seconds_per_token(self) -> float | None:
        """The pace of all the call's TreeSpark rounds so far (None before there are `window` of them)."""
        if len(self.rounds) < self.window:
            return None
        return sum(s for s, _ in self.rounds) / sum(n for _, n in self.rounds)

    @property
    def should_hand_off(self) -> bool:
        plain, ours = self.plain_seconds_per_token, self.seconds_per_token
        return plain is not None and ours is not None and ours > plain * (1 + self.margin)


def resolve_guard(tree_guard, guardable: bool) -> CallGuard | None:
    """`tree_guard` (True, False (the default), or a `CallGuard`) as the call's guard; None where the call cannot hand
    off (`guardable` False: scores or logits are returned, or the prompt is left-padded)."""
    if isinstance(tree_guard, CallGuard):
        return tree_guard if guardable else None
    if not isinstance(tree_guard, bool):
        raise ValueError(f"tree_guard={tree_guard!r} is invalid: use True (hand a call whose rounds are slower than "
                         "plain steps to transformers' loop), False, or a hf_treespark.call_guard.CallGuard")
    return CallGuard() if tree_guard and guardable else None


def hand_off(model, session, ids, logits_processor, stopping_criteria, generation_config, streamer):
    """The rest of the call in transformers' own loop, from the session's cache (every committed token but the last,
    as plain decoding holds it); returns the whole sequence `[1, T]`. The streamer gets the new tokens and its end."""
    out = type(model)._sample(model, ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                              generation_config=generation_config, synced_gpus=False, streamer=streamer,
                              attention_mask=torch.ones_like(ids), use_cache=True,
                              **{session.cache_kw: session.cache})
    return getattr(out, "sequences", out)
