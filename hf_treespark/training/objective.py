"""The training objective: one drafter pass per batch, teacher-forced DSpark losses, TreeSpark replay.

`TrainingObjective` is an `nn.Module` around the drafter so that data parallelism (DDP through
accelerate) wraps the whole loss computation in one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.tree import TreePolicy, build_tree
from .losses import (
    confidence_loss,
    coverage_loss,
    depth_weights,
    l1_distribution_loss,
    reference_ce_loss,
    survival_loss,
)

LOSS_NAMES = ("ce", "l1", "conf", "surv", "cov")
LABELS = ("text", "target")  # what L_ce predicts: the sequence's next token, or the target's own argmax there


@dataclass
class LossConfig:
    """Coefficients and knobs of `L = a_ce L_ce + a_l1 L_l1 + a_conf L_conf + a_surv L_surv + a_cov L_cov`."""

    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0
    surv: float = 0.5
    cov: float = 0.5
    gamma: float = 4.0
    coverage_top_j: int = 8
    coverage_margin: float = 0.5
    coverage_cap: float = 2.0
    replay_anchors: int | None = None  # replay the tree from this many evenly spaced anchors per sequence (None: all)

    def __post_init__(self):
        if self.replay_anchors is not None and (not isinstance(self.replay_anchors, int) or self.replay_anchors < 1):
            raise ValueError(f"replay_anchors must be a positive number of anchors per sequence or None (all), "
                             f"got {self.replay_anchors!r}")

    def coefficient(self, name: str) -> float:
        return getattr(self, name)


def replay_losses(drafter, depth_logits: torch.Tensor, roots: torch.Tensor, reference_probs: torch.Tensor,
                  valid: torch.Tensor, policy: TreePolicy, weights: torch.Tensor, cfg: LossConfig,
                  draft_index: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Replay the deployed tree policy from each anchor and return the survival and coverage terms.

    depth_logits `[N, B, V]` (differentiable), roots `[N]` anchor tokens, reference_probs `[N, B, V]`
    (`q_k`, detached), valid `[N, B]` depths that have a reference token, weights `[B]` (`w_k`).
    Topology comes from `hf_treespark.core.tree.build_tree` on the detached logits (the inference code,
    discrete choices detached); the log-probabilities of the chosen candidates are then recomputed
    with gradient, so the Markov head learns on model-selected parent tokens. Both terms are summed
    depth by depth, so no `[N, C, V]` tensor is ever materialised.
    """
    tree = build_tree(depth_logits.detach(), drafter.markov_bias, roots, policy, drafter.draft_vocab_ids)
    cand = tree.candidates
    n, num_cand = cand.tokens.shape
    zero = depth_logits.new_zeros(())
    surv, cov = [zero, zero], [zero, zero]
    mass = torch.zeros(n, num_cand, device=roots.device)  # reference path mass per candidate
    for k, (parent_cand, parent_tok, child_ids) in enumerate(cand.expansions, start=1):
        num_parents, topk = child_ids.shape[1], child_ids.shape[2]
        logp = torch.log_softmax(depth_logits[:, k - 1, None, :].float() + drafter.markov_bias(parent_tok), -1)
        flat_ids = child_ids.reshape(n, -1)
        child_tok = cand.tokens.gather(1, flat_ids).view(n, num_parents, topk)
        if draft_index is not None:
            child_tok = draft_index[child_tok]
        child_logp = logp.gather(-1, child_tok)  # [N, P, k], differentiable
        q_k = reference_probs[:, k - 1]  # [N, V]
        parent_mass = torch.ones_like(parent_tok, dtype=mass.dtype) if k == 1 else mass.gather(1, parent_cand)
        child_mass = parent_mass[:, :, None] * q_k.gather(1, child_tok.reshape(n, -1)).view(n, num_parents, topk)
        mass.scatter_(1, flat_ids, child_mass.reshape(n, -1))
        valid_k = valid[:, k - 1]
        if cfg.surv > 0:
            packed = cand.packed.gather(1, flat_ids).view(n, num_parents, topk) & valid_k[:, None, None]
            num, den = survival_loss(child_logp, child_mass, packed)
            surv = [surv[0] + num, surv[1] + den]
        if cfg.cov > 0:
            top_probs, top_tokens = q_k.topk(cfg.coverage_top_j, dim=-1)  # [N, J]
            num, den = coverage_loss(
                logp.reshape(n * num_parents, -1),
                child_logp[:, :, -1].reshape(-1),  # the k-th best child: the local admission threshold
                top_tokens[:, None].expand(-1, num_parents, -1).reshape(n * num_parents, -1),
                top_probs[:, None].expand(-1, num_parents, -1).reshape(n * num_parents, -1),
                (weights[k - 1] * valid_k.float())[:, None].expand(-1, num_parents).reshape(-1),
                cfg.coverage_margin, cfg.coverage_cap,
            )
            cov = [cov[0] + num, cov[1] + den]
    terms = {}
    if cfg.surv > 0:
        terms["surv"] = tuple(surv)
    if cfg.cov > 0:
        terms["cov"] = tuple(cov)
    return terms


class TrainingObjective(nn.Module):
    """Computes every loss term's `(numerator, denominator)` for a batch of reference sequences."""

    def __init__(self, drafter, loss_config: LossConfig, policy: TreePolicy, labels: str = "text"):
        super().__init__()
        if labels not in LABELS:
            raise ValueError(f"labels={labels!r}: use one of {', '.join(LABELS)}")
        self.labels = labels
        self.drafter = drafter
        draft_index = None
        if drafter.draft_vocab_ids is not None:  # target id -> column of the draft vocabulary, -1 outside it
            ids = drafter.draft_vocab_ids
            draft_index = torch.full((drafter.config.target_vocab_size,), -1, dtype=torch.long, device=ids.device)
            draft_index[ids] = torch.arange(ids.numel(), device=ids.device)
        self.register_buffer("draft_index", draft_index, persistent=False)
        self.loss_config = loss_config
        self.policy = policy

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: torch.Tensor,
                target_features: torch.Tensor, reference_hidden: torch.Tensor, anchors: torch.Tensor,
                anchor_valid: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """
        input_ids/attention_mask `[b, T]`, lengths `[b]`; target_features `[b, T, n_layers * d]`;
        reference_hidden `[b, T, d]` the target's final (normed) hidden states, so that
        `q_j = softmax(lm_head(reference_hidden[j]))` predicts token `j + 1`; anchors `[b, A]`
        positions `a` (anchor token `x_a`, context `< a`), anchor_valid `[b, A]`.

        With a draft vocabulary `S` every distribution lives on `S`: `p_k` is the drafter's softmax over
        `S` and `q_k` the target's softmax over the LM-head rows of `S` (renormalised on `S`; the mass
        outside it, 0.2% of response tokens at |S| = 16,384, is dropped), so `L_l1`, `L_conf`, `L_surv`
        and `L_cov` compare distributions the drafter can actually match. `L_ce` skips the rows whose
        reference token lies outside `S` (the drafter cannot propose it; at inference such a round commits
        the target's bonus token). Cost: the LM-head work of every term shrinks by `V / |S|`.

        `labels="target"` trains `L_ce` towards `argmax q_k` instead of the sequence's token `y_k` (the parents
        stay the sequence's tokens, teacher-forced): the target's own choice at each position of a text it did not
        write. On the target's greedy answers the two labels agree.
        """
        cfg = self.loss_config
        drafter = self.drafter
        bsz = drafter.config.block_size
        b, num_anchors = anchors.shape
        t_len = input_ids.shape[1]
        device = input_ids.device
        offsets = torch.arange(bsz + 1, device=device)
        pos = anchors[:, :, None] + offsets  # [b, A, B + 1]: positions of y_0..y_B
        valid = (pos[:, :, 1:] < lengths[:, None, None]) & anchor_valid[:, :, None]  # [b, A, B]
        tokens = input_ids.gather(1, pos.clamp(max=t_len - 1).reshape(b, -1)).view(b, num_anchors, bsz + 1)

        out = drafter(anchor_ids=tokens[:, :, 0], anchor_positions=anchors, target_features=target_features,
                      context_positions=torch.arange(t_len, device=device).expand(b, -1),
                      context_valid=attention_mask.bool(), return_logits=True)
        hidden = out.hidden_states.view(b, num_anchors, bsz, -1)
        depth_logits = out.depth_logits.view(b, num_anchors, bsz, -1)  # U_k

        with torch.no_grad():  # reference distributions q_k: target logits at position a + k - 1
            # once per position (the blocks of nearby anchors overlap), then gathered per (anchor, depth)
            ref_pos = pos[:, :, :-1].clamp(max=t_len - 1).reshape(b, -1)
            position_probs = torch.softmax(drafter.depth_logits(reference_hidden), -1)  # [b, T, |S|]
            reference_probs = position_probs.gather(1, ref_pos[:, :, None].expand(-1, -1, position_probs.shape[-1]))
            reference_probs = reference_probs.view(b, num_anchors, bsz, -1)
            del position_probs

        w = depth_weights(bsz, cfg.gamma, device)
        row_w = (w * valid.float()).reshape(-1)  # [M]
        parents = tokens[:, :, :-1]
        logits = depth_logits + drafter.markov_bias(parents)  # teacher-forced p_k(. | y_{k-1})
        vocab = logits.shape[-1]
        flat_logits, flat_q = logits.reshape(-1, vocab), reference_probs.reshape(-1, vocab)
        targets, ce_w = tokens[:, :, 1:].reshape(-1), row_w
        if self.labels == "target":  # the target's most likely token (on S), teacher-forced: already a column of S
            targets = flat_q.argmax(-1)
        elif self.draft_index is not None:  # columns of S; rows whose token lies outside S leave L_ce
            targets = self.draft_index[targets]
            ce_w = row_w * (targets >= 0).float()
            targets = targets.clamp(min=0)
        losses = {
            "ce": reference_ce_loss(flat_logits, targets, ce_w),
            "l1": l1_distribution_loss(flat_logits, flat_q, row_w),
        }
        if drafter.confidence_head is not None and cfg.conf > 0:
            conf_logits = drafter.confidence_logit(hidden, parents).reshape(-1)
            losses["conf"] = confidence_loss(conf_logits, flat_logits, flat_q, row_w)
        if cfg.surv > 0 or cfg.cov > 0:
            # The replay's per-parent Markov rows dominate a step's cost: `replay_anchors` thins them
            # (both terms are normalised by their own mass, so thinning changes variance, not scale).
            keep = torch.arange(num_anchors, device=device)
            if cfg.replay_anchors is not None and cfg.replay_anchors < num_anchors:
                keep = torch.linspace(0, num_anchors - 1, cfg.replay_anchors, device=device).round().long().unique()
            r = keep.numel()
            losses.update(replay_losses(
                drafter, depth_logits[:, keep].reshape(b * r, bsz, vocab), tokens[:, keep, 0].reshape(-1),
                reference_probs[:, keep].reshape(b * r, bsz, vocab), valid[:, keep].reshape(b * r, bsz),
                self.policy, w, cfg, self.draft_index,
            ))
        return losses
