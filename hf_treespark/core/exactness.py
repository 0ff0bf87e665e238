"""Checking speculative output against plain greedy decoding.

In fp32/fp64 the rule is strict equality: any divergence fails. In half precision a multi-token (tree) forward and a
one-token forward round differently, so the two may pick different tokens where the target's
top logits are a floating-point near-tie. `check_greedy_equivalence` accepts a divergence only
there: at the first differing position, the target's logits for the two competing tokens must
lie within `atol + rtol * max|logit|`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EquivalenceReport:
    """ok: equal, or first divergence at a near-tie. position: index of the first differing token
    (None when equal). gap: |logit(reference token) - logit(other token)| there. tolerance: the bound used."""

    ok: bool
    position: int | None = None
    gap: float | None = None
    tolerance: float | None = None

    def __str__(self) -> str:
        if self.position is None:
            return "identical to plain greedy"
        verdict = "near-tie (allowed)" if self.ok else "NOT a near-tie: a bug"
        return f"first divergence at token {self.position}: logit gap {self.gap:.4g} vs tolerance " \
               f"{self.tolerance:.4g}, {verdict}"


def default_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance on logits: 0 for fp32/fp64 (exact), a few ulps of the dtype for half precision."""
    if dtype in (torch.float32, torch.float64):
        return 0.0
    return 8 * torch.finfo(dtype).eps


@torch.no_grad()
def check_greedy_equivalence(
    target, reference: torch.Tensor, candidate: torch.Tensor, atol: float | None = None, rtol: float | None = None
) -> EquivalenceReport:
    """Compare `candidate` with plain greedy `reference` (both `[1, seq]`, same prompt).

    At the first differing position `j`, run the target on `reference[:, :j]` and compare the
    logits of `reference[j]` and `candidate[j]`. Length differences count as a divergence at the
    shorter length (unless one ends at an EOS the other also produced, which equality covers).
    """
    ref, cand = reference[0], candidate[0]
    n = min(len(ref), len(cand))
    diff = (ref[:n] != cand[:n]).nonzero()
    if len(diff) == 0:
        if len(ref) == len(cand):
            return EquivalenceReport(ok=True)
        return EquivalenceReport(ok=False, position=n, gap=float("inf"), tolerance=0.0)
    j = int(diff[0, 0])
    logits = target(input_ids=reference[:, :j]).logits[0, -1].float()
    dtype = next(target.parameters()).dtype
    rtol = default_rtol(dtype) if rtol is None else rtol
    atol = 1e-2 if atol is None else atol
    gap = float((logits[ref[j]] - logits[cand[j]]).abs())
    tolerance = atol + rtol * float(logits.abs().max())
    strict = dtype in (torch.float32, torch.float64)  # full precision: any divergence is a bug
    return EquivalenceReport(ok=gap <= tolerance and not strict, position=j, gap=gap, tolerance=tolerance)
