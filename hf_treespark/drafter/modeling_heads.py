"""The drafter's heads: what turns a block state `h_k` into a distribution over the next token and a bet on it.

    p_k(.|y)  = softmax(U_k + W2(W1[y]))              Markov head, rank r, W2: r -> |S|
    c_k(y)    = sigmoid(w . [h_k ; W1[y]] + b)        confidence head
    h_1      <- h_1 + out(x + mlp(x)),  x = [norm(fc_1(f_{a-1})) ; e(x0) ; h_1]      depth-1 head (optional)
    h_2(y)    = h_2 + out(x + mlp(x)),  x = [norm(fc_2(f_{a-1})) ; e(x0) ; e(y) ; h_2]   depth-2 head (optional)

The block drafts all `B` depths at once, so depth `k` cannot see which token the tree put at depth `k - 1`.
The Markov head puts that parent `y` back as a low-rank logit correction, and the confidence head scores
`(h_k, y)` so the tree policy knows which branches are worth their verification cost. `W1` embeds any target id (a
parent can be any committed token); `W2` has one row per draft-vocabulary token. The depth-1 head gives the first
depth the target features of the position before the anchor directly, without attention.

`DrafterHeads` is the drafter's side of them (mixed into `TreeSparkDrafter`): `U_k` from the bound target's
LM head, the Markov bias, the confidence, and the depth-1 pass. This file imports only torch and the drafter's
own modules: it ships beside `modeling.py` as remote code.

The depth-2 head gives the second depth what the Markov head's low-rank bias only approximates: the parent `y` the
tree put at depth 1, read together with the target features before the anchor and the slot's state. Its logits are
`lm_head(h_2(y))[S] + W2(W1[y])`, one full row per depth-2 parent (`tree.expand_tree`'s `parent_logits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration import TreeSparkConfig
from .modeling_block import DrafterContextCache, TreeSparkRMSNorm, newest_rows


class MarkovHead(nn.Module):
    """Low-rank parent-token correction: `bias(y) = W2(W1[y])`, `W1: [V, r]`, `W2: [|S|, r]`."""

    def __init__(self, vocab_size: int, rank: int, proposal_vocab_size: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, proposal_vocab_size or vocab_size, bias=False)
        self.markov_w2.zero_init = True  # W2 = 0: training starts from the pure parallel drafter

    def forward(self, parent_tokens: torch.Tensor) -> torch.Tensor:
        """parent_tokens [...] (target ids) -> logit correction [..., |S|]."""
        return self.markov_w2(self.markov_w1(parent_tokens))


class ConfidenceHead(nn.Module):
    """`c_k(y) = sigmoid(w . [h_k ; W1[y]] + b)`; `forward` returns the logit (before the sigmoid)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: torch.Tensor, parent_embedding: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], parent_embedding [..., r] -> confidence logit [...]."""
        return self.proj(torch.cat([hidden, parent_embedding.to(hidden.dtype)], dim=-1)).squeeze(-1)


class FeatureHead(nn.Module):
    """What the depth heads share: `fc` and `norm` over the raw target features of the position before the anchor, and
    a residual MLP over the `parts` concatenated `H`-wide inputs (`up`, `down`) into a zero-initialised `out`."""

    def __init__(self, config: TreeSparkConfig, parts: int, width: int):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * config.target_hidden_size, hidden, bias=False)
        self.norm = TreeSparkRMSNorm(hidden, config.rms_norm_eps)
        self.up = nn.Linear(parts * hidden, width)
        self.down = nn.Linear(width, parts * hidden)
        self.out = nn.Linear(parts * hidden, hidden)
        self.out.zero_init = True

    def update(self, hidden: torch.Tensor, features: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """`hidden + out(x + mlp(x))`, `x = [norm(fc(features)) ; *inputs ; hidden]` (leading shapes broadcast)."""
        parts = (self.norm(self.fc(features)), *inputs, hidden)
        shape = torch.broadcast_shapes(*(t.shape for t in parts))
        x = torch.cat([t.expand(shape) for t in parts], dim=-1)
        x = x + self.down(F.silu(self.up(x)))
        return hidden.expand(shape) + self.out(x)


class Depth1Head(FeatureHead):
    """A context-free pathway into the first depth: `h_1 + out(x + mlp(x))`, `x = [norm(fc(f)) ; e ; h_1]`, from
    the raw target features `f` of the position before the anchor, the anchor's embedding `e` and the anchor
    slot's state `h_1`. `out` is zero-initialised: a drafter grown with the head starts as it was."""

    def __init__(self, config: TreeSparkConfig):
        super().__init__(config, 3, config.depth1_head)

    def forward(self, features: torch.Tensor, embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.update(hidden, features, embedding)


class Depth2Head(FeatureHead):
    """The second depth given its parent `y`: `h_2(y) = h_2 + out(x + mlp(x))`, `x = [norm(fc(f)) ; e(x0) ; e(y) ;
    h_2]`, from the raw target features `f` of the position before the anchor, the embeddings of the anchor and of
    the parent, and the slot's state `h_2`. `out` is zero-initialised: a drafter grown with it drafts as before."""

    def __init__(self, config: TreeSparkConfig):
        super().__init__(config, 4, config.depth2_head)

    def forward(self, features: torch.Tensor, anchor: torch.Tensor, parent: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        """`[..., F]`, `[..., H]` x 3 -> `h_2(y)` `[..., H]` (the leading shapes broadcast)."""
        return self.update(hidden, features, anchor, parent)


class DrafterHeads:
    """The heads as `TreeSparkDrafter` uses them. Mixed into the drafter, which holds `markov_head`,
    `confidence_head`, `depth1_head`, `depth2_head`, the feature standardisation `_standardised` and the bound target's
    `_target()` (`modeling_binding.DrafterBinding`)."""

    def depth_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`U_k = lm_head(h_k)[S]` in float32: `[..., H] -> [..., |S|]` (only the draft vocabulary's rows)."""
        _, _, draft_head = self._target()
        return draft_head(hidden.to(draft_head.weight.dtype)).float()

    def markov_bias(self, parent_tokens: torch.Tensor) -> torch.Tensor:
        """`W2(W1[y])` in float32: parent target ids `[...] -> [..., |S|]`."""
        return self.markov_head(parent_tokens).float()

    def markov_bias_rows(self, parent_tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`markov_bias` on some rows of `W2` only, in float32: parent target ids `[b, P]` and draft-vocabulary rows
        `[b, M]` -> `[b, P, M]` (a tree's shortlist, `tree.expand_tree`: `M` rows read instead of `|S|`)."""
        head = self.markov_head
        return torch.matmul(head.markov_w1(parent_tokens), head.markov_w2.weight[rows].transpose(1, 2)).float()

    def confidence(self, hidden: torch.Tensor, parent_tokens: torch.Tensor) -> torch.Tensor:
        """`c_k(y) = sigmoid(w . [h_k ; W1[y]] + b)`: hidden [..., H], parent_tokens [...] -> [...] in (0, 1)."""
        return torch.sigmoid(self.confidence_logit(hidden, parent_tokens))

    def confidence_logit(self, hidden: torch.Tensor, parent_tokens: torch.Tensor) -> torch.Tensor:
        if self.confidence_head is None:
            raise ValueError("this drafter has no confidence head (config.use_confidence_head=False)")
        return self.confidence_head(hidden, self.markov_head.markov_w1(parent_tokens))

    def depth2_logits(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], parent_tokens: torch.Tensor,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
        """The second depth's logits given each parent, in float32: `lm_head(h_2(y))[S] + W2(W1[y])`.

        `inputs`: a pass's `TreeSparkDrafterOutput.depth2_inputs` (standardised features before the anchor `[b, A, F]`,
        the anchor's embedding and the slot's state `[b, A, H]`); `parent_tokens` `[b, P]` target ids, with `A = 1`
        (every parent of one block) or `A = P` (one parent per block) -> `[b, P, |S|]`. With `rows` (`[b, M]`
        draft-vocabulary entries, a tree's shortlist) only those entries: `[b, P, M]`, reading `M` rows of the LM
        head and of `W2` instead of all `|S|` (27 MB per round in bf16 for the shipped vocabulary).
        """
        features, anchor, hidden = inputs
        embed, _, draft_head = self._target()
        state = self.depth2_head(features, anchor, embed(parent_tokens).to(hidden.dtype), hidden)
        if rows is None:
            return self.depth_logits(state) + self.markov_bias(parent_tokens)
        weight = draft_head.weight[rows]  # [b, M, H]
        logits = torch.matmul(state.to(weight.dtype), weight.transpose(1, 2))
        if draft_head.bias is not None:
            logits = logits + draft_head.bias[rows][:, None, :]
        return logits.float() + self.markov_bias_rows(parent_tokens, rows)

    def _features_before(self, hidden: torch.Tensor, anchor_positions: torch.Tensor,
                         target_features: torch.Tensor | None, context_cache: DrafterContextCache | None,
                         context_valid: torch.Tensor | None) -> torch.Tensor:
        """The raw target features of the position before each anchor, `[b, A, F]` (what the depth heads read).

        Without a cache (training), row `a - 1` of `target_features` (zeros for an anchor at position 0); with one,
        the newest new row (the newest valid one per row with `context_valid`), kept in the cache for a pass that
        brings no new context.
        """
        b, num_anchors = anchor_positions.shape
        width = self.config.num_target_features * self.config.target_hidden_size
        have_new = target_features is not None and target_features.shape[1] > 0
        if context_cache is not None:
            if have_new:
                context_cache.last_features = newest_rows(target_features, context_valid, context_cache.last_features)
            before = context_cache.last_features
            return hidden.new_zeros(b, 1, width) if before is None else before
        if have_new:
            index = (anchor_positions - 1).clamp(min=0)
            before = target_features.gather(1, index[:, :, None].expand(-1, -1, width))
            return before * (anchor_positions > 0)[:, :, None].to(before.dtype)
        return hidden.new_zeros(b, num_anchors, width)

    def _with_depth1_head(self, hidden: torch.Tensor, anchor: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """`hidden` `[b, A * B, H]` with each block's anchor slot passed through `depth1_head`, which reads the anchors'
        embeddings `anchor` `[b, A, H]` and the standardised features before them, `before` (`_features_before`)."""
        b, num_anchors = anchor.shape[:2]
        blocks = hidden.view(b, num_anchors, self.config.block_size, -1)
        first = self.depth1_head(before, anchor, blocks[:, :, 0])
        return torch.cat([first[:, :, None], blocks[:, :, 1:]], dim=2).view_as(hidden)
