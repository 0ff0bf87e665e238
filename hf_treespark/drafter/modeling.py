"""TreeSparkDrafter: the DSpark parallel block drafter with a Markov head and a confidence head.

One forward pass drafts a block of `B` future tokens. The block `[x0, MASK, ..., MASK]` attends
bidirectionally to itself and, through KV injection, to projected hidden states of the target
model at every committed position (docs/method.md):

    ctx       = hidden_norm(fc(concat(target hidden states of `target_layer_ids`)))   [b, S, H]
    K, V      = [k_proj(ctx) ; k_proj(block)], [v_proj(ctx) ; v_proj(block)]          per layer
    h_k       = norm(block output at slot k - 1)                                         [b, B, H]
    U_k       = lm_head(h_k)[S]                                                          [b, B, |S|]
    p_k(.|y)  = softmax(U_k + W2(W1[y]))              Markov head, rank r, W2: r -> |S|
    c_k(y)    = sigmoid(w . [h_k ; W1[y]] + b)        confidence head

With `config.depth1_head` the first depth also reads the target features of the position before the anchor
directly, without attention (`Depth1Head`): `h_1 <- h_1 + out(x + mlp(x))`, `x = [norm(fc_1(f_{a-1})) ; e(x0) ;
h_1]`, before `U_1` and `c_1`. With `config.depth2_head` the second depth reads, besides, the parent `y` the tree put at
depth 1 (`Depth2Head`): its logits are computed per parent when the tree expands depth 2 (`depth2_logits`), from the
pass's `depth2_inputs`.

`S` is the draft vocabulary: the frequency-ranked target ids in the buffer `draft_vocab_ids`
(`config.draft_vocab_size`), or the whole target vocabulary. Drafted tokens are indices into `S`
until `draft_vocab_ids` maps them back to target ids; `W1` embeds any target id (a parent can be
any committed token). The token embeddings and the LM head are the target's, frozen and never
stored in the drafter's checkpoint: call `bind_target(target)` before use.

The drafter is split by idea: `modeling_block.py` (the decoder layers, attention and the context cache),
`modeling_heads.py` (Markov, confidence and depth-1 heads), `modeling_binding.py` (the target binding and the draft
vocabulary) and `modeling_io.py` (saving and loading). This file holds the drafter itself: its modules, its
feature standardisation and `forward`. Every name these files define for users is importable from here too.

These files import only torch, transformers and each other, `.configuration`, `.cpu_gemm` and `.datastore`, so
that `save_pretrained` can ship them as remote code: transformers copies every module that `modeling.py` imports
relatively, and `AutoModel.from_pretrained(dir, trust_remote_code=True)` works without the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from ..sources.datastore import Datastore
from .configuration import TreeSparkConfig
from .modeling_binding import DrafterBinding, draft_vocab_problem
from .modeling_block import (
    BlockTrainingMask,
    DrafterContextCache,
    TreeSparkAttention,
    TreeSparkDecoderLayer,
    TreeSparkMLP,
    TreeSparkRMSNorm,
    TreeSparkRotaryEmbedding,
    apply_rotary,
    block_training_attention,
    newest_rows,
    ragged_block_mask,
    rotate_half,
    training_block_mask,
)
from .modeling_heads import ConfidenceHead, Depth1Head, Depth2Head, DrafterHeads, MarkovHead
from .modeling_io import TENSOR_ALIGNMENT, DrafterSaving, nonfinite_tensors

__all__ = [
    "NEEDS_PACKAGE", "TENSOR_ALIGNMENT", "BlockTrainingMask", "ConfidenceHead", "Depth1Head", "Depth2Head",
    "DrafterContextCache", "MarkovHead", "TreeSparkAttention", "TreeSparkDecoderLayer", "TreeSparkDrafter",
    "TreeSparkDrafterOutput", "TreeSparkMLP", "TreeSparkPreTrainedModel", "TreeSparkRMSNorm",
    "TreeSparkRotaryEmbedding", "apply_rotary", "block_training_attention", "draft_vocab_problem", "nonfinite_tensors",
    "rotate_half",
]

NEEDS_PACKAGE = (
    "transformers' assisted decoding reached a TreeSpark drafter, which it cannot use (the drafter drafts trees "
    "from the target's hidden states). Install the package (pip install hf_treespark) and `import hf_treespark` "
    "before target.generate(..., assistant_model=drafter); without the package, add "
    "custom_generate=<this drafter's repo id or directory> and trust_remote_code=True to that call.")


@dataclass
class TreeSparkDrafterOutput(ModelOutput):
    """
    hidden_states: `[b, A * B, H]` normed block states `h_k`, block-major (anchor `a`, slot `k - 1`).
    depth_logits: `[b, A * B, V]` `U_k = lm_head(h_k)` in float32, when requested.
    depth2_inputs: with a depth-2 head, what it reads besides the parent (`DrafterHeads.depth2_logits`): the
        standardised target features before each anchor `[b, A, F]`, the anchor's embedding and the second slot's
        state `h_2` `[b, A, H]`. `depth_logits`' second depth is then `U_2` without the head.
    """

    hidden_states: torch.Tensor | None = None
    depth_logits: torch.Tensor | None = None
    depth2_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class TreeSparkPreTrainedModel(PreTrainedModel):
    config_class = TreeSparkConfig
    base_model_prefix = "treespark"
    supports_gradient_checkpointing = False
    _no_split_modules = ["TreeSparkDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "zero_init", False):
                module.weight.zero_()
            else:
                module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, TreeSparkRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, TreeSparkRotaryEmbedding):
            # A non-persistent buffer: from_pretrained materialises it empty and relies on this to fill it.
            module.inv_freq.copy_(module.compute_inv_freq(module.inv_freq.device))
        elif isinstance(module, TreeSparkDrafter):
            if module.mask_embedding is not None:
                module.mask_embedding.normal_(0.0, std)
            if module.feature_mean is not None:  # identity until set_feature_statistics
                module.feature_mean.zero_()
                module.feature_scale.fill_(1.0)


class TreeSparkDrafter(DrafterSaving, DrafterBinding, DrafterHeads, TreeSparkPreTrainedModel):
    """The DSpark drafter. See the module docstring for the formulas; the mixins hold saving and loading
    (`modeling_io`), the target binding and draft vocabulary (`modeling_binding`) and the heads' use
    (`modeling_heads`)."""

    def __init__(self, config: TreeSparkConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * config.target_hidden_size, hidden, bias=False)
        self.hidden_norm = TreeSparkRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(TreeSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TreeSparkRMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = TreeSparkRotaryEmbedding(config)
        self.markov_head = MarkovHead(config.target_vocab_size, config.markov_rank, config.draft_vocab_size)
        if config.draft_vocab_size is not None:  # saved with the weights: the ranking is part of the checkpoint
            self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.register_buffer("draft_vocab_ids", None)
        self.confidence_head = ConfidenceHead(hidden, config.markov_rank) if config.use_confidence_head else None
        width = config.num_target_features * config.target_hidden_size
        if config.normalize_features:  # set from training data by `set_feature_statistics`
            self.register_buffer("feature_mean", torch.zeros(width), persistent=True)
            self.register_buffer("feature_scale", torch.ones(width), persistent=True)
        else:
            self.register_buffer("feature_mean", None)
            self.register_buffer("feature_scale", None)
        self.anchor_proj = None
        if config.anchor_features:  # zero-initialised: starts as the KV-only drafter
            self.anchor_proj = nn.Linear(hidden, hidden, bias=False)
            self.anchor_proj.zero_init = True
        self.depth1_head = Depth1Head(config) if config.depth1_head else None
        self.depth2_head = Depth2Head(config) if config.depth2_head else None
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if config.mask_token_id is None else None
        self.datastore: Datastore | None = None  # the target's earlier outputs (`datastore.py`), saved beside it
        self.__dict__["_target_modules"] = None  # (embed_tokens, lm_head) of the bound target; not registered
        self.post_init()

    def __getattr__(self, name: str):
        # Only transformers' own (chain) assisted decoding asks a drafter for its generation_config: it is
        # reached when the hf_treespark package is not imported, or not installed (remote code).
        if name == "generation_config":
            raise AttributeError(NEEDS_PACKAGE)
        return super().__getattr__(name)

    # ----- pieces used by tree drafting and training ------------------------------------------
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """`ctx = hidden_norm(fc(features))`: `[b, s, n_layers * d_target] -> [b, s, H]` (features standardised
        first with `config.normalize_features`)."""
        return self.hidden_norm(self.fc(self._standardised(target_features)))

    def _standardised(self, target_features: torch.Tensor) -> torch.Tensor:
        dtype = self.fc.weight.dtype
        features = target_features.to(dtype)
        if self.feature_mean is not None:
            features = (features - self.feature_mean.to(dtype)) * self.feature_scale.to(dtype)
        return features

    @torch.no_grad()
    def set_feature_statistics(self, features: torch.Tensor, floor: float = 0.1) -> None:
        """Per-dimension mean and scale of target features `[n, n_layers * d_target]` (training positions),
        for `config.normalize_features`. A dimension's standard deviation is floored at `floor` times the
        median of its layer's, so near-constant dimensions are not blown up."""
        if self.feature_mean is None:
            raise ValueError("this drafter does not standardise its features (config.normalize_features=False)")
        features = features.reshape(-1, self.feature_mean.numel()).double()
        std = features.std(0)
        per_layer = std.view(self.config.num_target_features, -1)
        std = torch.maximum(per_layer, floor * per_layer.median(dim=1, keepdim=True).values).reshape(-1)
        self.feature_mean.copy_(features.mean(0).to(self.feature_mean.dtype))
        self.feature_scale.copy_((1.0 / std).to(self.feature_scale.dtype))

    def block_embeddings(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor_ids [b, A] -> embeddings of `[x0, MASK * (B - 1)]` per anchor, `[b, A * B, H]`."""
        embed, _, _ = self._target()
        b, a = anchor_ids.shape
        bsz = self.config.block_size
        dtype = self.fc.weight.dtype
        anchor = embed(anchor_ids).to(dtype)  # [b, A, H]
        if self.mask_embedding is None:
            mask = embed(torch.full_like(anchor_ids[:, :1], self.config.mask_token_id)).to(dtype)[:, :, None]
            mask = mask.expand(b, a, bsz - 1, -1)
        else:
            mask = self.mask_embedding.to(dtype).expand(b, a, bsz - 1, -1)
        return torch.cat([anchor[:, :, None], mask], dim=2).reshape(b, a * bsz, -1)

    def new_context_cache(self) -> DrafterContextCache:
        return DrafterContextCache(self.config.num_hidden_layers)

    # ----- forward ------------------------------------------------------------------------------
    def forward(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        target_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        context_cache: DrafterContextCache | None = None,
        context_valid: torch.Tensor | None = None,
        return_logits: bool = True,
        logit_slots: int | None = None,
    ) -> TreeSparkDrafterOutput:
        """Draft one block of `B` slots per anchor.

        Args:
            anchor_ids: `[b, A]` anchor tokens `x0` (last committed token, not yet seen by the target).
            anchor_positions: `[b, A]` sequence position of each anchor.
            target_features: `[b, s, n_layers * d_target]` target hidden states of context positions
                not yet in `context_cache` (concatenated over `target_layer_ids`).
            context_positions: `[b, s]` positions of those features (default: following the cache).
            context_cache: inference cache of projected context keys/values; the new context is
                appended to it. With a cache, every block sees the whole cached context (`A` must be 1).
            context_valid: `[b, s]` bool: which context positions exist (padding). Without a cache (training),
                block `a` sees the valid context positions `< anchor_positions[a]`; with one (a batch of rows
                with different context lengths), the valid ones join the cache's `valid` entries, and each
                block sees its row's valid entries only.
            return_logits: also compute `U_k` (`[b, A * B, |S|]`, float32).
            logit_slots: compute `U_k` for the first `logit_slots` depths of each block only
                (`[b, A * logit_slots, |S|]`): a tree that expands fewer depths needs no more.
        """
        b, num_anchors = anchor_ids.shape
        bsz = self.config.block_size
        block = self.block_embeddings(anchor_ids)
        block_pos = (anchor_positions[:, :, None] + torch.arange(bsz, device=anchor_ids.device)).reshape(b, -1)
        dtype = block.dtype
        block_rope = self.rotary_emb(block_pos, dtype)

        context = context_rope = None
        if target_features is not None and target_features.shape[1] > 0:
            context = self.project_context(target_features)
            if context_positions is None:
                start = context_cache.get_seq_length() if context_cache is not None else 0
                context_positions = torch.arange(start, start + context.shape[1], device=context.device)
                context_positions = context_positions.expand(b, -1)
            context_rope = self.rotary_emb(context_positions, dtype)

        if self.anchor_proj is not None:
            block = block + self._anchor_context(context, anchor_positions, context_cache, bsz, context_valid)

        attention_mask = None
        if context_cache is None:
            attention_mask = training_block_mask(anchor_positions, context_positions, context_valid, bsz)
        elif num_anchors != 1:
            raise ValueError("with a context cache the drafter drafts one block at a time (anchor_ids [b, 1])")
        elif context_valid is not None or context_cache.valid is not None:
            attention_mask = ragged_block_mask(context, context_valid, context_cache, bsz)

        for layer in self.layers:
            block = layer(block, block_rope, context, context_rope, attention_mask, context_cache)
        hidden = self.norm(block)
        depth2_inputs = None
        if self.depth1_head is not None or self.depth2_head is not None:
            before = self._standardised(self._features_before(hidden, anchor_positions, target_features,
                                                              context_cache, context_valid))
            embed, _, _ = self._target()
            anchor = embed(anchor_ids).to(hidden.dtype)
            if self.depth2_head is not None and bsz > 1:
                depth2_inputs = (before, anchor, hidden.view(b, num_anchors, bsz, -1)[:, :, 1])
            if self.depth1_head is not None:
                hidden = self._with_depth1_head(hidden, anchor, before)
        logits = None
        if return_logits:
            slots = bsz if logit_slots is None else min(logit_slots, bsz)
            if slots < bsz:  # [b, A * B, H] -> the first `slots` depths of each block
                hidden_slots = hidden.view(b, num_anchors, bsz, -1)[:, :, :slots].reshape(b, num_anchors * slots, -1)
            else:
                hidden_slots = hidden
            logits = self.depth_logits(hidden_slots)
        return TreeSparkDrafterOutput(hidden_states=hidden, depth_logits=logits, depth2_inputs=depth2_inputs)

    def _anchor_context(self, context, anchor_positions, context_cache, bsz: int,
                        context_valid: torch.Tensor | None = None) -> torch.Tensor:
        """`anchor_proj(ctx[a - 1])` for each anchor `a`, repeated over its `B` slots: `[b, A * B, H]`.

        With a cache, `ctx[a - 1]` is the newest context position (the last row of the new context, or the
        one the cache kept from the previous pass). Without one (training), context row `j` is position `j`;
        an anchor at position 0 has no context and gets zeros.
        """
        b, num_anchors = anchor_positions.shape
        hidden = self.config.hidden_size
        if context_cache is not None and context is not None:
            context_cache.last_context = newest_rows(context, context_valid, context_cache.last_context)
        newest = context_cache.last_context if context_cache is not None else context
        if newest is None:
            return torch.zeros(b, num_anchors * bsz, hidden, dtype=self.fc.weight.dtype, device=anchor_positions.device)
        if context_cache is not None:
            return self.anchor_proj(newest).expand(b, num_anchors * bsz, hidden)
        before = (anchor_positions - 1).clamp(min=0)
        rows = context.gather(1, before[:, :, None].expand(-1, -1, hidden))  # [b, A, H]
        rows = rows * (anchor_positions > 0)[:, :, None].to(rows.dtype)
        return self.anchor_proj(rows).repeat_interleave(bsz, dim=1)

