"""Soft targets for the depth-1 head: the target's top-K next-token distribution at each position (HASS-style
distillation), recorded from the same target forward that gives the features, and the loss that mixes it with the
hard label.

    record   `top_k_targets(logits, k, draft_vocab_ids)`: the target's probabilities `p = softmax(z)` over its whole
             vocabulary (temperature 1), restricted to the draft vocabulary S where the drafter has one, and the K
             largest of them: `soft_ids` `[n, K]` int32, indices into S (the head's output space), and `soft_probs`
             `[n, K]` fp16, the true probabilities (their sum is the mass of the top K in S, at most 1)
    loss     `head_loss`: `(1 - W) * CE(logits, label) + W * soft_CE`, `soft_CE = -sum_k p^_k log q(id_k)` where
             `p^ = p / sum_k p` (the top K renormalised to sum 1) and `q = softmax(logits)` over S; `W = 0` is the
             hard loss itself, the same call bit for bit

Why the top K renormalised, not a KL over all of S: a position then stores 6 K bytes more (48 at K = 8, under 1%
of its 7 KB of features), against 2 |S| bytes for the whole distribution, and the target's mass beyond its top 8 is
small on its own text; renormalising makes the soft term a cross-entropy against a distribution (its minimum is
reached at `q(id_k) proportional to p_k`), whatever mass the top K leave out. Why mixed with the hard label: greedy
verification accepts exactly the target's argmax, the hard label; the soft term adds how the target ranks the
runners-up, which a tree of several branches per depth drafts too.

Positions with soft targets carry the two columns `SOFT_FIELDS`, and their shards' signature ends in `-soft{K}`
(`soft_signature`): shards extracted without them, or with another K, are refused by name (`check_soft_targets`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from ..arg_types import at_least, probability

SOFT_FIELDS = ("soft_ids", "soft_probs")
SOFT_BYTES = 6  # per recorded id: int32 index into S and fp16 probability
DEFAULT_SOFT_WEIGHT = 0.5  # --soft-weight when --soft-targets is given without it


# ----- recording ----------------------------------------------------------------------------------------------


@torch.no_grad()
def top_k_targets(logits: torch.Tensor, k: int,
                  draft_vocab_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The target's top-`k` next tokens in the draft vocabulary and their probabilities, from its `logits` `[n, V]`
    (any float dtype): `{"soft_ids": [n, k] int32 (indices into S, or target ids without a draft vocabulary),
    "soft_probs": [n, k] float16 (softmax over all V at temperature 1, not renormalised)}`, largest first.

    `draft_vocab_ids` `[|S|]`: the drafter's draft vocabulary (`drafter.draft_vocab_ids`), or None for all of V.
    Raises `ValueError` when `k` is larger than S."""
    z = logits.float()  # [n, V]
    normaliser = torch.logsumexp(z, dim=-1, keepdim=True)  # [n, 1]: log sum_v exp(z_v) over the whole vocabulary
    if draft_vocab_ids is not None:
        z = z[:, draft_vocab_ids.to(z.device)]  # [n, |S|]
    if k > z.shape[-1]:
        raise ValueError(f"--soft-targets {k} asks for more ids than the drafter's {z.shape[-1]}-token draft "
                         f"vocabulary holds: give at most {z.shape[-1]}")
    top, ids = z.topk(k, dim=-1)  # [n, k]
    return {"soft_ids": ids.to(torch.int32), "soft_probs": (top - normaliser).exp().to(torch.float16)}


def head_argmax_and_top_k(head, states: torch.Tensor, k: int, draft_vocab_ids: torch.Tensor | None = None,
                          chunk: int = 1024) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The target's LM `head` applied once to its final states `[n, d]`, in chunks of `chunk` rows: its argmax
    `[n]` (target ids) and, when `k > 0`, `top_k_targets` of the same logits (else `{}`)."""
    argmax, soft = [], []
    for i in range(0, max(len(states), 1), chunk):
        logits = head(states[i:i + chunk])  # [c, V]
        argmax.append(logits.argmax(-1))
        if k:
            soft.append(top_k_targets(logits, k, draft_vocab_ids))
    return torch.cat(argmax), {f: torch.cat([s[f] for s in soft]) for f in SOFT_FIELDS} if k else {}


# ----- which positions hold them --------------------------------------------------------------------------------


def soft_signature(signature: str, k: int) -> str:
    """A positions directory's `signature` for soft targets of `k` ids (`k = 0`: the signature itself)."""
    return f"{signature}-soft{k}" if k else signature


def signature_soft_targets(signature: str | None) -> int:
    """The K a `soft_signature` names (0: positions without soft targets)."""
    found = re.search(r"-soft(\d+)$", signature or "")
    return int(found.group(1)) if found else 0


def check_soft_targets(held_signature: str | None, k: int, directory: str | Path) -> None:
    """Refuse, naming `directory` and what to do, positions of `held_signature` (their `progress.json`'s) when
    they hold soft targets of another K than `k` (0: none); nothing when the K agree."""
    had = signature_soft_targets(held_signature)
    if had == k:
        return
    if not had:
        raise ValueError(f"{directory} holds positions extracted without soft targets, so --soft-targets {k} has "
                         f"nothing to train on there: give a fresh --output-dir, or delete {directory} to extract "
                         "them again with soft targets")
    asked = f"--soft-targets {k}" if k else "no --soft-targets"
    raise ValueError(f"{directory} holds positions extracted with --soft-targets {had}, not {asked}: give "
                     f"--soft-targets {had} to resume that run, a fresh --output-dir, or delete {directory} to "
                     "extract again")


def check_soft_weight(held: float, weight: float, path: str | Path) -> None:
    """Refuse to resume the head checkpoint `path`, trained at soft weight `held` (0: the hard loss), at `weight`."""
    if held != weight:
        raise ValueError(f"{path} holds a head trained with --soft-weight {held:g}, not {weight:g}: give its "
                         "--soft-targets and --soft-weight to resume, another --output-dir, or delete it to train "
                         "from the start")


# ----- the loss -------------------------------------------------------------------------------------------------


def soft_cross_entropy(logits: torch.Tensor, soft_ids: torch.Tensor, soft_probs: torch.Tensor) -> torch.Tensor:
    """`mean_n -sum_k p^_k log q(id_k)`: the head's `logits` `[n, |S|]`, `q = softmax(logits)`; `soft_ids` `[n, K]`
    (indices into S), `soft_probs` `[n, K]` (the target's probabilities), renormalised here to `p^ = p / sum_k p`.
    A row whose recorded mass is 0 adds 0. Returns a float32 scalar."""
    p = soft_probs.float()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)  # [n, K], each row summing to 1
    log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, soft_ids.long())  # [n, K]
    return -(p * log_q).sum(-1).mean()


def head_loss(logits: torch.Tensor, labels: torch.Tensor, data: dict[str, torch.Tensor], rows: torch.Tensor,
              weight: float = 0.0) -> torch.Tensor:
    """The head's loss on `rows` of `data`: `(1 - weight) * CE(logits, labels) + weight * soft_cross_entropy`.

    `logits` `[n, |S|]`; `labels` `[n]`, indices into S (-100: outside S, ignored by the hard term); `data`'s
    `SOFT_FIELDS` (read only when `weight > 0`) at `rows`. `weight = 0` returns `F.cross_entropy(logits, labels,
    ignore_index=-100)` itself; `weight = 1` the soft term alone."""
    if not weight:
        return F.cross_entropy(logits, labels, ignore_index=-100)
    if SOFT_FIELDS[0] not in data:
        raise ValueError("--soft-weight needs positions with soft targets: extract them with --soft-targets K > 0")
    soft = soft_cross_entropy(logits, data["soft_ids"][rows].to(logits.device),
                              data["soft_probs"][rows].to(logits.device))
    if weight == 1:
        return soft
    return (1 - weight) * F.cross_entropy(logits, labels, ignore_index=-100) + weight * soft


# ----- the options ----------------------------------------------------------------------------------------------


def add_soft_arguments(p) -> None:
    """`--soft-targets K` and `--soft-weight W`, as `train-depth1` and `distil` take them."""
    p.add_argument("--soft-targets", type=at_least(0), default=0, metavar="K",
                   help="also record the target's top-K next tokens in the draft vocabulary and their probabilities at "
                        "each position, from the same target forward (6 K bytes more per stored position), and train "
                        "on them: loss (1 - W) * CE(label) + W * soft CE, where soft CE = -sum_k p_k log q(id_k) with "
                        "p the top K renormalised to sum 1 (HASS-style). Sensible: 8. 0 (default): off, the hard "
                        "label alone, as before")
    p.add_argument("--soft-weight", type=probability, metavar="W",
                   help=f"the soft loss's share W in [0, 1] with --soft-targets (default {DEFAULT_SOFT_WEIGHT}; 0: "
                        "the soft targets are recorded but the loss is the hard one; 1: the soft loss alone)")


def check_soft_arguments(args) -> None:
    """Refuse `--soft-weight` without `--soft-targets`; set `args.soft_weight` (its default with soft targets, 0
    without)."""
    if args.soft_weight is not None and not args.soft_targets:
        raise ValueError(f"--soft-weight {args.soft_weight:g} needs --soft-targets K > 0 (the soft targets it "
                         "weighs): give --soft-targets 8, or leave --soft-weight out")
    if args.soft_weight is None:
        args.soft_weight = DEFAULT_SOFT_WEIGHT if args.soft_targets else 0.0
