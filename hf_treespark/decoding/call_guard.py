"""The per-call guard: a `generate` call at batch size 1 whose TreeSpark rounds commit tokens more slowly than
plain steps would is handed to transformers' own loop for the rest of the call. On by default (`tree_guard=True`).

TreeSpark pays when a round's accepted tokens outweigh its cost (a drafter pass, a tree, a verify forward of
`N + 1` tokens): on most text by far, but not on every prompt, every device or every drafter. The budget, the
drafter gate and lookup-only rounds choose what a round verifies; this guard asks one question more, with the
clock: are the rounds faster per committed token than plain steps, here and now?

    measure   the wall time and committed tokens of every round (the whole loop iteration: draft, verify, walk,
              commit, stopping criteria, streaming); the call's first `GUARD_SKIP` rounds are not judged (the first
              one chooses an "auto" budget from the whole candidate pool, and warms the caches)
    probe     after a stretch of `GUARD_WINDOW` judged rounds, `GUARD_PROBES` rounds verify the root alone: a plain
              step through the same loop (one target forward of one token, nothing drafted); the seconds of that
              forward alone are the plain pace of that moment
    judge     the stretch's seconds per committed token against its probes' (the same minute of a shared machine)
    confirm   a stretch slower by more than `GUARD_MARGIN` is judged again on a fresh stretch and fresh probes; the call
              is handed off only when `GUARD_CHECKS` judgements in a row find the rounds slower. A stretch that is
              faster puts the next check `GUARD_RECHECK` times as many rounds away (a long call is checked again)

Judging a stretch against the probes right after it (the same moment of a shared machine), and handing off only on
a second such judgement, leaves a slow moment no way to end a fast call; the measurements behind this shape and
its costs are in docs/design-notes.md ("The per-call guard").

A probe is not lost work: it commits its token, as plain decoding would; it costs what the rounds it replaces would
have gained. Only the probe's target forward is timed (`DecodingSession.step(probe=True)`, synchronised on CUDA): a
whole probe round carries this loop's own work beyond a plain step (the 4D mask, the walk, the commit, the drafter's
pending features). transformers' loop adds its own, smaller, work around the same forward (the logits processors,
the stopping criteria): the forward alone is the plain pace less that, within the margin.

A stretch that is faster beyond doubt skips its probes. On a CPU every round's verify forward is timed too (free
there; on CUDA it would need a synchronisation, so there the probes always run), and a forward of one token at the
same context costs at least `1 / GUARD_VERIFY_BOUND` of a verify forward of a tree: on the CPUs here a verify
forward of up to 17 tokens costs 1.0-1.6 plain steps, on a GPU about one. A stretch whose seconds per committed token
are below the median verify forward's over `GUARD_VERIFY_BOUND`, by the margin, is judged faster without probes
(`judgements` records it with None for the plain pace); any other stretch is probed as above.

The hand-off (`handoff.finish_plain`) continues from the session's cache, so the output is what plain decoding
gives: exact in greedy, distributed as the target in sampling. The round controller (`controller.py`) holds the
guard and asks it before every round.
"""

from __future__ import annotations

GUARD_SKIP = 1  # the call's first rounds, never judged
GUARD_WINDOW = 8  # judged TreeSpark rounds before the probes
GUARD_PROBES = 2  # root-only rounds that measure the plain pace
GUARD_MARGIN = 0.05  # TreeSpark must be this much slower per token than the probes to count as slower
GUARD_CHECKS = 2  # judgements in a row that must find the rounds slower before the call is handed off
GUARD_RECHECK = 8  # after a stretch found faster, the next one is this many times as long
GUARD_VERIFY_BOUND = 2.0  # a verify forward of the tree costs at most this many one-token forwards (see above)


def _pace(rounds: list[tuple[float, int]]) -> float | None:
    """Seconds per committed token over `rounds` (None when empty)."""
    return sum(s for s, _ in rounds) / sum(n for _, n in rounds) if rounds else None


class CallGuard:
    """The guard's state for one call. The loop asks `probing` before each round (True: verify the root alone),
    reports each round with `observe(seconds, tokens, probe)` (a probe's `seconds` its target forward's), and hands
    off once `should_hand_off` is True.

    `rounds` and `probe_rounds` keep every `(seconds, tokens)` observed; `judgements` every `(seconds per token of
    the stretch, of its probes)` judged so far (the second None where the stretch was faster beyond doubt, judged
    without probes from its rounds' `verify_seconds`)."""

    def __init__(self, window: int = GUARD_WINDOW, probes: int = GUARD_PROBES, margin: float = GUARD_MARGIN,
                 checks: int = GUARD_CHECKS, skip: int = GUARD_SKIP, recheck: int = GUARD_RECHECK,
                 verify_bound: float = GUARD_VERIFY_BOUND):
        self.window, self.probes, self.margin, self.checks, self.skip, self.recheck = (
            window, probes, margin, checks, skip, recheck)
        self.verify_bound = verify_bound
        self.rounds: list[tuple[float, int]] = []  # (seconds, tokens) of TreeSpark rounds
        self.probe_rounds: list[tuple[float, int]] = []  # (seconds, tokens) of root-only rounds
        self.judgements: list[tuple[float, float | None]] = []
        self._stretch: list[tuple[float, int]] = []  # judged rounds since the last judgement
        self._stretch_probes: list[tuple[float, int]] = []
        self._stretch_verify: list[float | None] = []  # the stretch's verify forwards' seconds (None: not timed)
        self._stretch_length = window  # judged rounds before the next probes
        self._slower = 0  # judgements in a row that found the rounds slower

    @property
    def probing(self) -> bool:
        """Whether the next round is a probe (the root alone)."""
        return (not self.should_hand_off and len(self._stretch) >= self._stretch_length
                and len(self._stretch_probes) < self.probes)

    def observe(self, seconds: float, tokens: int, probe: bool, verify_seconds: float | None = None) -> None:
        """A round of `seconds` that committed `tokens` (a probe if `probe`, `seconds` then its forward's);
        `verify_seconds`: a TreeSpark round's verify forward alone, where it was timed."""
        entry = (seconds, max(tokens, 1))
        if probe:
            self.probe_rounds.append(entry)
            self._stretch_probes.append(entry)
            if len(self._stretch_probes) >= self.probes:
                self._judge(_pace(self._stretch_probes))
            return
        self.rounds.append(entry)
        if len(self.rounds) > self.skip:
            self._stretch.append(entry)
            self._stretch_verify.append(verify_seconds)
            if len(self._stretch) >= self._stretch_length and self._faster_beyond_doubt():
                self._judge(None)

    def _faster_beyond_doubt(self) -> bool:
        """Whether the stretch commits tokens faster than plain steps could, by its own verify forwards: a plain
        step costs at least the median verify forward over `verify_bound`."""
        if self.probes == 0 or None in self._stretch_verify:
            return False
        plain_at_least = sorted(self._stretch_verify)[len(self._stretch_verify) // 2] / self.verify_bound
        return _pace(self._stretch) * (1 + self.margin) < plain_at_least

    def _judge(self, plain: float | None) -> None:
        """Judge the stretch against the plain pace `plain` (its probes'; None: faster beyond doubt)."""
        ours = _pace(self._stretch)
        self.judgements.append((ours, plain))
        slower = plain is not None and ours > plain * (1 + self.margin)
        self._slower = self._slower + 1 if slower else 0
        self._stretch_length = self.window if slower else len(self._stretch) * self.recheck
        self._stretch, self._stretch_probes, self._stretch_verify = [], [], []

    @property
    def should_hand_off(self) -> bool:
        return self._slower >= self.checks


def resolve_guard(tree_guard, guardable: bool) -> CallGuard | None:
    """`tree_guard` (True (the default), False, or a `CallGuard`) as the call's guard; None where the call cannot hand
    off (`guardable` False: scores or logits are returned, or the prompt is left-padded)."""
    if isinstance(tree_guard, CallGuard):
        return tree_guard if guardable else None
    if not isinstance(tree_guard, bool):
        raise ValueError(f"tree_guard={tree_guard!r} is invalid: use True (hand a call whose rounds are slower than "
                         "plain steps to transformers' loop), False, or a hf_treespark.decoding.call_guard.CallGuard")
    return CallGuard() if tree_guard and guardable else None
