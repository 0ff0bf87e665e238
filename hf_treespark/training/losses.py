"""Drafter training objectives (docs/method.md). Each returns `(numerator, denominator)`.

Every loss is a weighted sum divided by the sum of its valid weights. Returning the two parts
lets data-parallel training all-reduce the denominators before dividing (`normalise`), so the
result equals the loss over the global batch.

Shapes: `M` is the number of (anchor, depth) rows, `V` the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def depth_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """`w_k = exp(-(k - 1) / gamma)` for `k = 1..B`, `[B]`."""
    k = torch.arange(1, block_size + 1, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def reference_ce_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
    """`L_ce = sum_k w_k * CE(p_k(. | y_{k-1}), y_k) / sum_k w_k`.

    logits `[M, V]` (teacher-forced `U_k + W2(W1[y_{k-1}])`), targets `[M]`, weights `[M]` (0 = invalid row).
    """
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    return (weights * ce).sum(), weights.sum()


def l1_distribution_loss(logits: torch.Tensor, reference_probs: torch.Tensor, weights: torch.Tensor):
    """`L_l1 = sum_k w_k * || softmax(logits_k) - q_k ||_1 / sum_k w_k`.

    logits `[M, V]`, reference_probs `[M, V]` (target distributions, no gradient), weights `[M]`.
    """
    l1 = (torch.softmax(logits.float(), dim=-1) - reference_probs).abs().sum(-1)
    return (weights * l1).sum(), weights.sum()


def confidence_loss(confidence_logits: torch.Tensor, logits: torch.Tensor, reference_probs: torch.Tensor,
                    weights: torch.Tensor):
    """`L_conf = sum_k w_k * BCE(c_k(y_{k-1}), stopgrad(1 - 0.5 * ||p_k - q_k||_1)) / sum_k w_k`.

    The target `1 - TV(p_k, q_k)` is the probability that one-step rejection sampling accepts.
    confidence_logits `[M]` (before the sigmoid), logits `[M, V]`, reference_probs `[M, V]`, weights `[M]`.
    """
    with torch.no_grad():
        overlap = 1.0 - 0.5 * (torch.softmax(logits.float(), -1) - reference_probs).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), overlap.clamp(0.0, 1.0), reduction="none")
    return (weights * bce).sum(), weights.sum()


def survival_loss(child_logp: torch.Tensor, path_mass: torch.Tensor, packed: torch.Tensor):
    """`L_surv = - sum_{n packed} m(n) * log p_{d(n)}(token(n) | token(parent(n))) / sum_{n packed} m(n)`.

    child_logp `[...]` differentiable log-probabilities of the replayed candidates, path_mass `[...]`
    the detached reference path mass `m(n) = m(parent) * q_{d(n)}(token(n))`, packed `[...]` bool
    (only edges kept by global packing count). No depth decay.
    """
    mass = (path_mass * packed).detach()
    return -(mass * child_logp).sum(), mass.sum()


def coverage_loss(parent_logp: torch.Tensor, threshold: torch.Tensor, top_tokens: torch.Tensor,
                  top_probs: torch.Tensor, depth_weight: torch.Tensor, margin: float, cap: float):
    """Capped coverage hinge on every expanded parent.

    For parent `p` expanding into depth `k` with local admission threshold `t_p` (its `k`-th best
    child log-prob, detached) and the target's top-`J` tokens `v` under `q_k`:
    `h(v) = min(cap, max(0, margin + t_p - log p_k(v | token(p))))`,
    `L_cov = sum_p w_k sum_v q_k(v) h(v) / sum_p w_k sum_v q_k(v)` (bounded by `cap`).

    parent_logp `[P, V]` differentiable, threshold `[P]`, top_tokens/top_probs `[P, J]`,
    depth_weight `[P]` (`w_k`, 0 for invalid parents).
    """
    logp_v = parent_logp.gather(-1, top_tokens)  # [P, J]
    hinge = (margin + threshold.detach()[:, None] - logp_v).clamp(min=0.0, max=cap)
    weight = (depth_weight[:, None] * top_probs).detach()
    return (weight * hinge).sum(), weight.sum()


def normalise(numerator: torch.Tensor, denominator: torch.Tensor, reduce_fn=None, world_size: int = 1):
    """`numerator / global denominator`, scaled so data-parallel gradient averaging yields the global loss.

    `reduce_fn` sums a tensor over ranks (e.g. `accelerator.reduce(x, "sum")`). With DDP each rank's
    gradient is averaged over `world_size` ranks, hence the factor.
    """
    denominator = denominator.detach()
    if reduce_fn is not None and world_size > 1:
        denominator = reduce_fn(denominator)
        return numerator * world_size / denominator.clamp(min=1e-12)
    return numerator / denominator.clamp(min=1e-12)
