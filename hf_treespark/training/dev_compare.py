"""Two drafters on the development set: depth-1 accuracy per prompt, and their paired difference with its standard
error, clustered by prompt.

Development depth-1 accuracy is teacher-forced top-1 at depth 1 on every anchor of the references, as
`treespark train-depth1` and `distil` measure it (`depth1.reference_positions`, `Depth1Trainer.top1`): at each
response position `a` (from `max(prompt_len, 1)` to the second-last token) the drafter, reading the target's
features of the reference before `a`, predicts `argmax(U_1 + W2(W1[x_a]))` over its draft vocabulary, and is right
when that is `x_{a+1}`, the target's own greedy token.

The anchors of one prompt are correlated (one answer, one topic), so the uncertainty is computed over prompts:
with `h_i` hits and `n_i` anchors of prompt `i`, `m` prompts and accuracy `p = sum(h) / sum(n)`,

    SE(p) = sqrt(m / (m - 1) * sum_i (h_i - p * n_i)^2) / sum(n)

(the linearised ratio estimator, the cluster-robust standard error of a mean over anchors). The paired difference
`B - A` is the same ratio of the per-prompt differences `d_i = h_i^B - h_i^A`, so prompts that are hard for both
drafters cancel out of its error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..decoding.engine import target_features
from .data import ReferenceSequence, collate_references
from .depth1 import head_off


@torch.no_grad()
def depth1_hits(target, drafters: Sequence, references: list[ReferenceSequence], chunk: int = 96,
                heads_off: Sequence[bool] | None = None, progress: bool = False) -> list[list[tuple[int, int]]]:
    """`[drafter][reference] -> (hits, anchors)`: teacher-forced depth-1 top-1 of each of `drafters` (bound to
    `target`; `heads_off[k]`: drafter `k` with its depth-1 head off, `depth1.head_off`) on every anchor of each
    reference (see the module docstring). One target forward per reference serves every drafter that reads the same
    layers, and a drafter listed twice in the same state is measured once; anchors go through a drafter `chunk` at
    a time."""
    from tqdm.auto import tqdm

    device = next(target.parameters()).device
    heads_off = list(heads_off or [False] * len(drafters))
    results: list[list[tuple[int, int]]] = [[] for _ in drafters]
    for ref in tqdm(references, desc="depth-1 accuracy", disable=not progress):
        batch = {k: v.to(device) for k, v in collate_references([ref], pad_id=0).items()}
        ids = batch["input_ids"][0]
        anchors = torch.arange(max(ref.prompt_len, 1), len(ids) - 1, device=device)
        features, measured = {}, {}
        for k, drafter in enumerate(drafters):
            if (id(drafter), heads_off[k]) in measured:
                results[k].append(measured[id(drafter), heads_off[k]])
                continue
            layers = tuple(drafter.config.target_layer_ids)
            if layers not in features:
                features[layers] = target_features(target, list(layers), batch["input_ids"],
                                                   batch["attention_mask"])[0]
            with head_off(drafter) if heads_off[k] else nullcontext():
                hits = _hits(drafter, ids, anchors, features[layers], chunk)
            measured[id(drafter), heads_off[k]] = (hits, len(anchors))
            results[k].append((hits, len(anchors)))
    return results


def _hits(drafter, ids: torch.Tensor, anchors: torch.Tensor, features: torch.Tensor, chunk: int) -> int:
    """How many of `anchors` (`[A]`) the drafter's depth-1 argmax gets right on `ids` (`[T]`; target `features`
    `[1, T, n_layers * d]`)."""
    hits = 0
    for start in range(0, len(anchors), chunk):
        a = anchors[start:start + chunk]
        out = drafter(anchor_ids=ids[a][None], anchor_positions=a[None], target_features=features, logit_slots=1)
        logits = out.depth_logits.view(len(a), -1) + drafter.markov_bias(ids[a])  # [A, |S|]
        hits += int((drafter.to_target_ids(logits.argmax(-1)) == ids[a + 1]).sum())
    return hits


@dataclass(frozen=True)
class Estimate:
    """A ratio over anchors and its standard error clustered by prompt (both as fractions)."""

    value: float
    se: float


def clustered_ratio(numerators: Sequence[float], anchors: Sequence[int]) -> Estimate:
    """`sum(numerators) / sum(anchors)` and its standard error over prompts (the module docstring's formula):
    `numerators[i]` the hits (or paired hit differences) of prompt `i`, `anchors[i]` its anchors. The error is NaN
    for fewer than two prompts. Raises `ValueError` for no anchors or lists of other lengths."""
    if len(numerators) != len(anchors):
        raise ValueError(f"{len(numerators)} numerators for {len(anchors)} anchor counts")
    total = sum(anchors)
    if total <= 0:
        raise ValueError("no anchors: nothing to estimate")
    value = sum(numerators) / total
    m = len(anchors)
    if m < 2:
        return Estimate(value, math.nan)
    spread = sum((h - value * n) ** 2 for h, n in zip(numerators, anchors, strict=True))
    return Estimate(value, math.sqrt(m / (m - 1) * spread) / total)


@dataclass(frozen=True)
class PairedRow:
    """One line of the comparison: `kind` ("all" for every prompt), its prompts and anchors, A's and B's depth-1
    accuracy and the paired difference `B - A`, each with its clustered standard error."""

    kind: str
    prompts: int
    anchors: int
    a: Estimate
    b: Estimate
    diff: Estimate


def compare_depth1(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]],
                   kinds: dict[str, str] | None = None) -> list[PairedRow]:
    """The paired comparison of two drafters' per-prompt `(hits, anchors)`, keyed by prompt id: a row per kind of
    `kinds` (`{id: kind}`, in the order kinds first appear; None: no per-kind rows) and a last row, "all". Prompts
    without anchors are left out. Raises `ValueError` when the two hold other prompts or other anchor counts (they
    were measured on other references)."""
    if set(a) != set(b):
        raise ValueError(f"the two sets of per-prompt numbers hold other prompts ({len(set(a) ^ set(b))} differ)")
    if any(a[key][1] != b[key][1] for key in a):
        raise ValueError("the two sets of per-prompt numbers count other anchors for the same prompt")
    ids = [key for key in a if a[key][1] > 0]
    groups: dict[str, list[str]] = {}
    for key in ids if kinds else ():
        groups.setdefault(kinds.get(key, "?"), []).append(key)
    groups["all"] = ids
    rows = []
    for kind, keys in groups.items():
        anchors = [a[key][1] for key in keys]
        rows.append(PairedRow(kind, len(keys), sum(anchors), clustered_ratio([a[key][0] for key in keys], anchors),
                              clustered_ratio([b[key][0] for key in keys], anchors),
                              clustered_ratio([b[key][0] - a[key][0] for key in keys], anchors)))
    return rows


def markdown_table(rows: list[PairedRow], a_name: str = "A", b_name: str = "B") -> str:
    """`rows` as a markdown table, in percent (points for the difference), each `value ± standard error`, and the
    difference over its error (`z`)."""

    def cell(e: Estimate) -> str:
        return f"{100 * e.value:.2f} ± {100 * e.se:.2f}"

    lines = [f"| kind | prompts | anchors | {a_name}: depth-1 top-1 % | {b_name}: depth-1 top-1 % | "
             f"{b_name} − {a_name} (points) | z |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        z = r.diff.value / r.diff.se if r.diff.se > 0 else math.nan
        lines.append(f"| {r.kind} | {r.prompts} | {r.anchors:,} | {cell(r.a)} | {cell(r.b)} | {cell(r.diff)} | "
                     f"{z:.2f} |")
    return "\n".join(lines)
