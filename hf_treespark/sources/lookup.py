"""Lookup branches: continuations of the current suffix found earlier in the text, grafted into the tree.

Prompt lookup drafts for free where an answer copies its prompt or repeats itself; the learned
drafter wins elsewhere. Both kinds of candidate go into the one tree verified per round:

1. `lookup_continuations`: the longest suffix of the text so far (prompt and output; `n` tokens,
   `n = 3, 2, 1`) that also occurs earlier; the `L` tokens that followed its most recent occurrence
   form a branch. Further occurrences add branches when they continue differently (at most
   `tree.LOOKUP_BRANCHES`), longer matches first. A continuation that runs into the end of the text
   goes on as a repeat: the text from the occurrence to the suffix, `p` tokens, recurs with period
   `p` (a greedy loop does exactly that, and the most recent occurrence of a looping suffix is one
   period back, so without this its branch would stop after `p` tokens).
2. `graft_lookup`: each branch is a chain from the root. A lookup token that equals an existing child
   in the candidate pool IS that node (no duplicate siblings); otherwise it becomes a new node.

Scores. Global packing needs one comparable score per node: the sum of log-probabilities along the
path, as for drafted nodes. A lookup token has no drafter probability of its own, so it gets an
estimated probability of being the target's next token given its parent was, from the length `n` of
the match that found it (`LOOKUP_TOKEN_PROB`): `score = score(parent) + log p(n)`. A node that the
drafter also proposed keeps the larger of its two scores. Scores still never increase along a path
(`log p(n) < 0`, and the drafter's own scores do not), so the packed set stays prefix-closed. The
estimates are deliberately modest: a lookup node displaces a drafted one only where the match is
long or the drafter is unsure.

Budget. The tree budget `N` is the drafter's (the "auto" choice is made on the drafter's pool,
before grafting); a round whose branches add `m` new nodes packs `N + min(m, L)` nodes (`L` the
branch length, `tree_lookup`). Without that allowance a small budget (4 on a CPU) would cut every
branch after a few tokens, exactly where lookup pays (long copies), or displace the drafter's best
nodes; with it, a round with no match costs what it costs without lookup, and global packing still
decides which of the drafted and the looked-up nodes are verified.

Lookup-only rounds. When the suffix matches `LOOKUP_ROUND_NGRAM` tokens, the round verifies only the
branch of the longest, most recent such match (`L` tokens, as in other rounds) and skips the drafter pass
(`is_lookup_round`, `lookup_pool`). Measured on the target's own ShareGPT responses (training data and
the development set, 63k positions): after a 3-token match the branch's first token is the target's in
88% of positions and 4.6 tokens are accepted on average, against 55% / 1.8 after a 2-token match and
23% / 0.6 after a 1-token one; the drafter's depth-1 acceptance is 20-35%. On a 2-core CPU the drafter
pass and its tree cost about a fifth of a plain step, more than its nodes add after a strong match.
The threshold, the branch length and the single branch were chosen on development prompts (held-out
ShareGPT records the benchmark never selects, and code prompts of the training set), one run per
comparison: a 3-token threshold beat 2 and 1; branches of 7 tokens beat 10 and 16 (so a lookup-only round
keeps `L`, at most the drafter's depth); one branch was level with two or ahead.
After a lookup-only round whose whole branch was accepted (the text is copying, or looping), the next
lookup-only round's branch may run to `LOOKUP_LONG_TOKENS` tokens, deeper than the drafter's tree; the
first one that stops short goes back to `L`. Replayed as above (with the gate): 1.34x / 1.58x against
1.33x / 1.55x with 7-token branches that stop at the end of the text.
The target features committed by a lookup-only round reach the drafter with its next pass (the engine
keeps them pending), so its conditioning is the same as if it had run.

The drafter gate. With lookup on, a drafter pass has to earn its cost: it adds a pass and its tree's
nodes to the round. `DrafterGate` keeps a running mean of the drafted tokens each drafter round got
accepted (nodes only a lookup branch proposed do not count). While that mean is below the gate's
threshold, rounds that are not lookup-only skip the drafter too: they verify the longest, most recent
match's branch, `L` tokens after a 2-token match and `LOOKUP_WEAK_TOKENS` after a 1-token one
(`gated_branch_length`: the first token of a 2-token match's branch is the target's in 55% of positions,
of a 1-token one's in 23%), or the root alone (a plain step) when nothing matches.
After `DRAFTER_GATE_ROUNDS` such rounds the drafter drafts again, so the mean follows the text. The
threshold is what a drafter round costs beyond a plain step, in plain steps (`budget.gate_threshold`,
from this device's measured latency): a drafter that gets more drafted tokens accepted than that
pays for itself. On a 2-core CPU it is about 0.35 (the pass is a fifth of a step and a 2-node tree's
verify forward 1.17 steps); on a GPU it is small. How it was chosen: the drafter's trees and the lookup
branches were computed at every position of the target's float32 greedy answers to development prompts
(24 held-out ShareGPT records the benchmark never selects and 15 code prompts of the training set, 4,551
positions), and policies were replayed on them with this CPU's measured forward costs. With the shipped
drafter: the gate 1.33x / 1.55x plain decoding (prose / code), drafting in every round 1.26x / 1.41x,
prompt lookup 1.22x / 1.43x; the weak branch's length (3 to 5 tokens), the threshold (0.2 to 0.5) and
the retry interval (8 to 32 rounds) moved this by under 2%, and `L` tokens after a 2-token match rather
than 4 added about 0.01 tokens per round at the same speed. Measured on 6 of those prompts, one run:
the gate with the periodic and long branches 1.76x, drafting in every round 1.66x, prompt lookup 1.68x.
A drafter with a calibrated `acceptance_profile` whose drafted tokens accepted per round at the budget,
`tau(N) - 1`, reach the threshold keeps the gate open for good (`budget.gate_threshold` returns 0): the
running mean is noisy (a few misses in a row close it for `DRAFTER_GATE_ROUNDS` rounds), and for a drafter
that pays on average those closings cost more than they save. Measured when the retrained drafter
(`tau` 1.50 / 1.65 at N = 2 / 4, threshold 0.27) shipped, 20 MT-Bench prompts, one run, bf16: the running
gate accepted 1.57 tokens per round at 1.35x plain greedy, the gate held open 2.05 at 1.49x, the drafter
without lookup 1.68 at 1.34x. `tree_gate=0` drafts every round that is not lookup-only.

Lookup nodes are ordinary nodes for verification and the walk, so greedy decoding stays exact and
sampling stays distribution-preserving. Training is unchanged: lookup is an inference-time addition.
"""

from __future__ import annotations

import math

import torch

from ..core.tree import LOOKUP_BRANCHES, Candidates

MAX_NGRAM = 3
LOOKUP_TOKEN_PROB = {1: 0.3, 2: 0.5, 3: 0.6}  # per-token acceptance estimate by match length n
LOOKUP_ROUND_NGRAM = 3  # a match this long makes the round lookup-only (see "Lookup-only rounds")
LOOKUP_ROUND_BRANCHES = 1  # branches of a lookup-only round at most (the longest, most recent match)
LOOKUP_LONG_TOKENS = 16  # branch length of a lookup-only round after one accepted whole
LOOKUP_WEAK_TOKENS = 4  # branch length of a gated round after a 1-token match (see "The drafter gate")
DRAFTER_GATE_ROUNDS = 16  # a gated drafter drafts again after this many rounds without it
DRAFTER_GATE_SMOOTHING = 0.3  # weight of the newest drafter round in the gate's running mean


def lookup_continuations(history: torch.Tensor, length: int, max_ngram: int = MAX_NGRAM,
                         max_branches: int = LOOKUP_BRANCHES) -> list[tuple[list[int], int]]:
    """Branches `(tokens, n)` for the 1-D token `history` (its last token is the tree's root `x0`).

    For `n = max_ngram .. 1`: every earlier occurrence of the last `n` tokens, most recent first,
    proposes the `length` tokens that followed it, continued periodically past the end of the text
    (see item 1 above); a continuation that starts like one already found is skipped.
    """
    total = history.shape[0]
    branches: list[tuple[list[int], int]] = []
    starts: set[int] = set()
    for n in range(min(max_ngram, total - 1), 0, -1):
        windows = history.unfold(0, n, 1)[:-1]  # [total - n, n]: every earlier n-gram with a successor
        hits = (windows == history[total - n:]).all(dim=1).nonzero().flatten().tolist()
        for start in reversed(hits):
            follow = history[start + n: start + n + length].tolist()
            period = total - n - start  # from this occurrence to the suffix
            while len(follow) < length:  # past the end of the text: the repeat goes on
                follow.append(follow[len(follow) - period])
            if follow[0] in starts:
                continue
            starts.add(follow[0])
            branches.append((follow, n))
            if len(branches) == max_branches:
                return branches
    return branches


def find_lookup_branches(history: torch.Tensor, length: int) -> list[tuple[list[int], int]]:
    """This round's branches for the 1-D unpadded text `history` (the root `x0` last); none when `length`
    is 0 (lookup off). Found before the drafter's pool is expanded, so the early stop
    (`tree.expand_tree`) knows how large the round's budget can grow (`max_extra_budget`)."""
    return lookup_continuations(history, length) if length > 0 else []


def is_lookup_round(branches: list[tuple[list[int], int]]) -> bool:
    """Whether this round skips the drafter: its longest match (branches come longest first) has at least
    `LOOKUP_ROUND_NGRAM` tokens (see "Lookup-only rounds")."""
    return bool(branches) and branches[0][1] >= LOOKUP_ROUND_NGRAM


def lookup_pool(root_tokens: torch.Tensor, branches: list[tuple[list[int], int]],
                length: int | None = None) -> Candidates:
    """The candidate pool of a round without a drafter pass (batch size 1, root `x0` = `root_tokens` `[1]`).

    Lookup-only round (`length=None`): the branches of matches of at least `LOOKUP_ROUND_NGRAM` tokens.
    Gated round (`length` given, `L`): the first branch (the longest, most recent match), cut to
    `gated_branch_length(n, L)` tokens; no branch leaves the pool empty (the round verifies the root
    alone). Every node is a lookup node, scored as in `graft_lookup`.
    """
    empty = Candidates(
        tokens=root_tokens.new_zeros(1, 0), parents=root_tokens.new_zeros(1, 0), depths=root_tokens.new_zeros(1, 0),
        scores=torch.zeros(1, 0, device=root_tokens.device), packed=None, node_index=None, expansions=[],
    )
    if length is not None:
        return graft_lookup(empty, [(tokens[:gated_branch_length(n, length)], n) for tokens, n in branches[:1]])
    strong = [(tokens, n) for tokens, n in branches if n >= LOOKUP_ROUND_NGRAM]
    return graft_lookup(empty, strong[:LOOKUP_ROUND_BRANCHES])


def gated_branch_length(n: int, length: int) -> int:
    """Tokens a gated round verifies after an `n`-token match: `L` (`length`) after 2 tokens or more,
    `LOOKUP_WEAK_TOKENS` (at most `L`) after 1 (see "The drafter gate")."""
    return length if n >= 2 else min(LOOKUP_WEAK_TOKENS, length)


class DrafterGate:
    """Whether this round runs the drafter (see "The drafter gate").

    `threshold`: drafted tokens a drafter round must get accepted on average to keep drafting; 0 never
    closes the gate. `gain` is the running mean (None before the first drafter round, which always drafts).
    """

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.gain: float | None = None
        self.idle = 0  # rounds since the drafter last drafted

    @property
    def is_open(self) -> bool:
        return (self.threshold <= 0 or self.gain is None or self.gain >= self.threshold
                or self.idle >= DRAFTER_GATE_ROUNDS)

    def skipped(self) -> None:
        """A round that is not lookup-only ran without the drafter."""
        self.idle += 1

    def drafted(self, accepted: int) -> None:
        """A drafter round got `accepted` drafted tokens accepted."""
        self.idle = 0
        self.gain = accepted if self.gain is None else (
            (1 - DRAFTER_GATE_SMOOTHING) * self.gain + DRAFTER_GATE_SMOOTHING * accepted)


def max_extra_budget(branches: list[tuple[list[int], int]], length: int) -> int:
    """The most nodes `branches` can add to the round's budget: `min(their tokens, L)` (see "Budget")."""
    return min(sum(len(tokens) for tokens, _ in branches), length)


def add_lookup_branches(pool: Candidates, branches: list[tuple[list[int], int]], length: int
                        ) -> tuple[Candidates, int]:
    """This round's lookup step: `(pool with the branches grafted in, extra budget)`.

    `branches` from `find_lookup_branches`; `length`: `L` tokens per branch. The extra budget is
    `min(new nodes, L)` (see "Budget" above); no branch leaves the pool unchanged.

    With the early stop, a drafted candidate that could not have been packed may be missing from the
    pool; a branch through it then adds it as a lookup node (the verified tree may hold it where the
    full pool would have merged it). Verification does not depend on how a node got into the tree.
    """
    if not branches:
        return pool, 0
    grafted = graft_lookup(pool, branches)
    return grafted, min(int(grafted.lookup[0].sum()), length)


def graft_lookup(pool: Candidates, branches: list[tuple[list[int], int]]) -> Candidates:
    """`pool` (batch size 1) with the lookup branches merged in; `Candidates.lookup` flags new nodes."""
    nodes = []
    for branch, n in branches:
        step = math.log(LOOKUP_TOKEN_PROB[min(n, MAX_NGRAM)])
        for depth, token in enumerate(branch):
            nodes.append((len(nodes) - 1 if depth else -1, token, step))
    return graft_nodes(pool, nodes, "lookup")


def graft_nodes(pool: Candidates, nodes: list[tuple[int, int, float]], source: str) -> Candidates:
    """`pool` (batch size 1) with `nodes` merged in: `(parent, token, log_step)`, `parent` -1 for the root or the
    index of an earlier node of the list. A node whose token equals a child its parent already has IS that child
    (its score the larger of the two); the others are new candidates, scored `score(parent) + log_step` and
    flagged in `Candidates.flags[source]` (a source's flag name: "lookup", "retrieved" for the datastore, a
    registered source's name); nodes an earlier source added keep their flag."""
    if not nodes:
        return pool
    tokens, parents = pool.tokens[0].tolist(), pool.parents[0].tolist()
    depths, scores = pool.depths[0].tolist(), pool.scores[0].tolist()
    flags = {name: flag[0].tolist() for name, flag in pool.flags.items()}
    flags.setdefault(source, [False] * len(tokens))
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    where = []  # pool index of each of `nodes`
    for parent, token, step in nodes:
        at = -1 if parent < 0 else where[parent]
        score = (scores[at] if at >= 0 else 0.0) + step
        node = child.get((at, token))
        if node is None:
            node = len(tokens)
            child[(at, token)] = node
            tokens.append(token)
            parents.append(at)
            depths.append((depths[at] if at >= 0 else 0) + 1)
            scores.append(score)
            for name, flag in flags.items():
                flag.append(name == source)
        else:
            scores[node] = max(scores[node], score)
        where.append(node)
    like = pool.tokens
    return Candidates(
        tokens=torch.tensor([tokens], dtype=like.dtype, device=like.device),
        parents=torch.tensor([parents], dtype=pool.parents.dtype, device=like.device),
        depths=torch.tensor([depths], dtype=pool.depths.dtype, device=like.device),
        scores=torch.tensor([scores], dtype=pool.scores.dtype, device=like.device),
        packed=None, node_index=None, expansions=pool.expansions,
        flags={name: torch.tensor([flag], dtype=torch.bool, device=like.device) for name, flag in flags.items()},
    )
