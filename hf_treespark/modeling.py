"""TreeSparkDrafter: the DSpark parallel block drafter with a Markov head and a confidence head.

One forward pass drafts a block of `B` future tokens. The block `[x0, MASK, ..., MASK]` attends
bidirectionally to itself and, through KV injection, to projected hidden states of the target
model at every committed position (SPEC section 1):

    ctx       = hidden_norm(fc(concat(target hidden states of `target_layer_ids`)))   [b, S, H]
    K, V      = [k_proj(ctx) ; k_proj(block)], [v_proj(ctx) ; v_proj(block)]          per layer
    h_k       = norm(block output at slot k - 1)                                         [b, B, H]
    U_k       = lm_head(h_k)[S]                                                          [b, B, |S|]
    p_k(.|y)  = softmax(U_k + W2(W1[y]))              Markov head, rank r, W2: r -> |S|
    c_k(y)    = sigmoid(w . [h_k ; W1[y]] + b)        confidence head

With `config.depth1_head` the first depth also reads the target features of the position before the anchor
directly, without attention (`Depth1Head`): `h_1 <- h_1 + out(x + mlp(x))`, `x = [norm(fc_1(f_{a-1})) ; e(x0) ;
h_1]`, before `U_1` and `c_1`.

`S` is the draft vocabulary: the frequency-ranked target ids in the buffer `draft_vocab_ids`
(`config.draft_vocab_size`), or the whole target vocabulary. Drafted tokens are indices into `S`
until `draft_vocab_ids` maps them back to target ids; `W1` embeds any target id (a parent can be
any committed token). The token embeddings and the LM head are the target's, frozen and never
stored in the drafter's checkpoint: call `bind_target(target)` before use.

This file imports only torch, transformers and `.configuration`, so that `save_pretrained`
can ship it as remote code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration import TreeSparkConfig
from .cpu_gemm import is_packed, pack_linear_layers, weight_key
from .datastore import DATASTORE_FILE, Datastore

NEEDS_PACKAGE = (
    "transformers' assisted decoding reached a TreeSpark drafter, which it cannot use (the drafter drafts trees "
    "from the target's hidden states). Install the package (pip install hf_treespark) and `import hf_treespark` "
    "before target.generate(..., assistant_model=drafter); without the package, add "
    "custom_generate=<this drafter's repo id or directory> and trust_remote_code=True to that call.")


class TreeSparkRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class TreeSparkRotaryEmbedding(nn.Module):
    def __init__(self, config: TreeSparkConfig):
        super().__init__()
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """`theta ** (-2i / head_dim)`, `[head_dim / 2]` float32. Not saved: `_init_weights` recomputes it on load."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.rope_theta**exponents)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] -> cos, sin [b, 1, s, head_dim]."""
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # `.to(bfloat16)` rounds buffers; rotary needs float32
            inv_freq = self.compute_inv_freq(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)  # [b, s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, head_dim] rotated by the positions encoded in cos/sin [b, 1, s, head_dim]."""
    return x * cos + rotate_half(x) * sin


class DrafterContextCache:
    """Per-layer keys/values of the projected target context, `[b, kv_heads, S, head_dim]`.

    Only committed positions live here; the block's own keys/values are never cached. A batch whose rows have
    different context lengths (`batch.py`) keeps `valid` (`[b, S]` bool): which entries are real; the others
    (padding) are hidden from the block's attention. None: every entry is real.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.last_context: torch.Tensor | None = None  # `[b, 1, H]` projected context of the newest position
        self.last_features: torch.Tensor | None = None  # `[b, 1, F]` raw target features of the newest position
        self.valid: torch.Tensor | None = None

    def select(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Rebuild every layer from its entries `index` (`[b, S']`, per row); `valid` (`[b, S']`) says which of
        them are real (compaction, `batch.py`)."""
        self.valid = valid
        for i, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            if keys is not None:
                gather = index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
                self.keys[i], self.values[i] = keys.gather(2, gather), values.gather(2, gather)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (indices), in that order."""
        for i, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            if keys is not None:
                self.keys[i], self.values[i] = keys[rows], values[rows]
        for name in ("last_context", "last_features", "valid"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def crop(self, length: int) -> None:
        """Keep the first `length` context positions."""
        for i, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            if keys is not None:
                self.keys[i], self.values[i] = keys[..., :length, :], values[..., :length, :]

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer_idx] is not None:
            keys = torch.cat([self.keys[layer_idx], keys], dim=-2)
            values = torch.cat([self.values[layer_idx], values], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        return keys, values


@dataclass
class BlockTrainingMask:
    """Training attention of `A` blocks of `B` slots: each block sees the context positions `context`
    allows (`[b, 1, A * B, s]` bool, or None without context) and its own `B` slots, never another block."""

    context: torch.Tensor | None
    block_size: int


def block_training_attention(query, ctx_k, ctx_v, block_k, block_v, mask: BlockTrainingMask, groups: int):
    """`softmax(q k^T / sqrt(d)) v` over `[allowed context ; own block]` keys, for `[b, h, A * B, d]` queries.

    Equal to SDPA over `[context ; all blocks]` keys with the dense block-diagonal mask, without scoring
    each query against the `(A - 1) * B` keys of the other blocks (most of that product when `A * B`
    exceeds the context length, as in training). Keys and values have `h / groups` heads.
    """
    b, h, q, d = query.shape
    bsz = mask.block_size
    num_blocks = q // bsz
    scale = d ** -0.5
    block_k = block_k.repeat_interleave(groups, dim=1).view(b, h, num_blocks, bsz, d)
    block_v = block_v.repeat_interleave(groups, dim=1).view(b, h, num_blocks, bsz, d)
    scores = [(query.view(b, h, num_blocks, bsz, d) @ block_k.transpose(-1, -2)).view(b, h, q, bsz) * scale]
    if ctx_k is not None:
        ctx_k, ctx_v = ctx_k.repeat_interleave(groups, dim=1), ctx_v.repeat_interleave(groups, dim=1)
        ctx_scores = (query @ ctx_k.transpose(-1, -2)) * scale
        scores.insert(0, ctx_scores.masked_fill(~mask.context, float("-inf")))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)  # a block always sees itself: no empty row
    out = (probs[..., -bsz:].reshape(b, h, num_blocks, bsz, bsz) @ block_v).view(b, h, q, d)
    if ctx_k is not None:
        out = out + probs[..., :-bsz] @ ctx_v
    return out


class TreeSparkAttention(nn.Module):
    """Block queries over `[context ; block]` keys; no causal mask (the block is bidirectional)."""

    def __init__(self, config: TreeSparkConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = TreeSparkRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = TreeSparkRMSNorm(self.head_dim, config.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(
        self,
        block: torch.Tensor,  # [b, q, H]
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context: torch.Tensor | None,  # [b, s_new, H] projected context not yet in the cache
        context_rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: BlockTrainingMask | None,  # training's blocks; None: one block sees all context
        cache: DrafterContextCache | None,
    ) -> torch.Tensor:
        b, q, _ = block.shape
        query = self.q_norm(self.q_proj(block).view(b, q, self.num_heads, self.head_dim)).transpose(1, 2)
        query = apply_rotary(query, *block_rope)
        block_k, block_v = self._kv(block, *block_rope)
        if context is not None:
            ctx_k, ctx_v = self._kv(context, *context_rope)
            if cache is not None:
                ctx_k, ctx_v = cache.append(self.layer_idx, ctx_k, ctx_v)
        elif cache is not None and cache.keys[self.layer_idx] is not None:
            ctx_k, ctx_v = cache.keys[self.layer_idx], cache.values[self.layer_idx]
        else:
            ctx_k = ctx_v = None
        groups = self.num_heads // self.num_kv_heads
        if isinstance(attention_mask, BlockTrainingMask):  # training: many blocks, each sees only itself
            out = block_training_attention(query, ctx_k, ctx_v, block_k, block_v, attention_mask, groups)
        else:
            if ctx_k is not None:
                block_k = torch.cat([ctx_k, block_k], dim=-2)
                block_v = torch.cat([ctx_v, block_v], dim=-2)
            block_k = block_k.repeat_interleave(groups, dim=1)
            block_v = block_v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(query, block_k, block_v, attn_mask=attention_mask)  # [b, h, q, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, q, self.num_heads * self.head_dim))


class TreeSparkMLP(nn.Module):
    def __init__(self, config: TreeSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TreeSparkDecoderLayer(nn.Module):
    def __init__(self, config: TreeSparkConfig, layer_idx: int):
        super().__init__()
        self.self_attn = TreeSparkAttention(config, layer_idx)
        self.mlp = TreeSparkMLP(config)
        self.input_layernorm = TreeSparkRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = TreeSparkRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, block, block_rope, context, context_rope, attention_mask, cache) -> torch.Tensor:
        block = block + self.self_attn(
            self.input_layernorm(block), block_rope, context, context_rope, attention_mask, cache
        )
        return block + self.mlp(self.post_attention_layernorm(block))


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


class Depth1Head(nn.Module):
    """A context-free pathway into the first depth: `h_1 + out(x + mlp(x))`, `x = [norm(fc(f)) ; e ; h_1]`, from
    the raw target features `f` of the position before the anchor, the anchor's embedding `e` and the anchor
    slot's state `h_1`. `out` is zero-initialised: a drafter grown with the head starts as it was."""

    def __init__(self, config: TreeSparkConfig):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * config.target_hidden_size, hidden, bias=False)
        self.norm = TreeSparkRMSNorm(hidden, config.rms_norm_eps)
        self.up = nn.Linear(3 * hidden, config.depth1_head)
        self.down = nn.Linear(config.depth1_head, 3 * hidden)
        self.out = nn.Linear(3 * hidden, hidden)
        self.out.zero_init = True

    def forward(self, features: torch.Tensor, embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.norm(self.fc(features)), embedding, hidden], dim=-1)
        x = x + self.down(F.silu(self.up(x)))
        return hidden + self.out(x)


@dataclass
class TreeSparkDrafterOutput(ModelOutput):
    """
    hidden_states: `[b, A * B, H]` normed block states `h_k`, block-major (anchor `a`, slot `k - 1`).
    depth_logits: `[b, A * B, V]` `U_k = lm_head(h_k)` in float32, when requested.
    """

    hidden_states: torch.Tensor | None = None
    depth_logits: torch.Tensor | None = None


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


class TreeSparkDrafter(TreeSparkPreTrainedModel):
    """The DSpark drafter. See the module docstring for the formulas."""

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
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if config.mask_token_id is None else None
        self.datastore: Datastore | None = None  # the target's earlier outputs (`datastore.py`), saved beside it
        self.__dict__["_target_modules"] = None  # (embed_tokens, lm_head) of the bound target; not registered
        self.post_init()

    # ----- binding to the target -------------------------------------------------------------
    def bind_target(self, target: nn.Module) -> TreeSparkDrafter:
        """Share `target`'s frozen token embeddings and LM head. Refuses a target that does not fit."""
        self.check_target(target)
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        bound = self.__dict__.get("_target_modules")
        if (bound is not None and bound[0] is embed and bound[1] is head
                and (bound[2] is head or bound[2].__dict__.get("source_key") == _head_source(head))):
            return self  # already bound to this target, unchanged: keep the draft head (and its packed copy)
        self.__dict__["_target_modules"] = (embed, head, self._draft_head(head))  # not registered: never saved
        return self

    def check_target(self, target: nn.Module) -> None:
        """Raise `ValueError` naming each mismatch between `target` and this drafter's config."""
        cfg = self.config
        tcfg = getattr(target, "config", None)
        tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError("the target has no input embeddings or no LM head; TreeSpark needs a causal LM target")
        problems = []
        if embed.weight.shape[0] != cfg.target_vocab_size or head.weight.shape[0] != cfg.target_vocab_size:
            problems.append(f"vocabulary size {head.weight.shape[0]} != drafter's target_vocab_size "
                            f"{cfg.target_vocab_size}")
        if embed.weight.shape[1] != cfg.target_hidden_size:
            problems.append(f"hidden size {embed.weight.shape[1]} != drafter's target_hidden_size "
                            f"{cfg.target_hidden_size}")
        num_layers = getattr(tcfg, "num_hidden_layers", None)
        if num_layers is not None and num_layers != cfg.target_num_hidden_layers:
            problems.append(f"{num_layers} layers != drafter's target_num_hidden_layers "
                            f"{cfg.target_num_hidden_layers}")
        if problems:
            name = cfg.target_name_or_path or "its training target"
            raise ValueError(f"This TreeSpark drafter was built for {name} and does not fit this target: "
                             + "; ".join(problems) + ". Load the drafter trained for this target.")

    def __getattr__(self, name: str):
        # Only transformers' own (chain) assisted decoding asks a drafter for its generation_config: it is
        # reached when the hf_treespark package is not imported, or not installed (remote code).
        if name == "generation_config":
            raise AttributeError(NEEDS_PACKAGE)
        return super().__getattr__(name)

    def __getstate__(self) -> dict:
        # A copy (`copy.deepcopy`) or a pickle (`torch.save`) leaves the target's embeddings and LM head out:
        # they are the target's, and `generate()` (or `bind_target`) binds the copy again.
        state = super().__getstate__().copy()
        state["_target_modules"] = None
        return state

    @property
    def draft_vocab_size(self) -> int:
        """How many tokens the drafter can propose (the width of `U_k` and of the Markov correction)."""
        return self.config.proposal_vocab_size

    @torch.no_grad()
    def full_vocabulary(self) -> TreeSparkDrafter:
        """Propose from the whole target vocabulary again (the inverse of `restrict_vocabulary`, for training).

        The Markov head's `W2` rows of the ids outside the draft vocabulary start at zero (no parent
        correction), as a fresh drafter's do; the kept rows are unchanged.
        """
        if self.draft_vocab_ids is None:
            return self
        w2 = self.markov_head.markov_w2
        full = nn.Linear(w2.in_features, self.config.target_vocab_size, bias=False).to(w2.weight.device,
                                                                                      w2.weight.dtype)
        full.weight.zero_()
        full.weight[self.draft_vocab_ids] = w2.weight
        full.zero_init = True
        self.markov_head.markov_w2 = full
        self.register_buffer("draft_vocab_ids", None)
        self.config.draft_vocab_size = None
        if self.is_bound:
            embed, head, _ = self.__dict__["_target_modules"]
            self.__dict__["_target_modules"] = (embed, head, self._draft_head(head))
        return self

    @torch.no_grad()
    def restrict_vocabulary(self, token_ids) -> TreeSparkDrafter:
        """Propose only `token_ids` (target ids, most useful first) from now on; no retraining needed.

        Keeps the rows of the Markov head's `W2` (and, through `draft_vocab_ids`, of the target's LM
        head) for those ids. A drafter that is already restricted can only be narrowed to a subset.
        """
        ids = _token_id_tensor(token_ids)
        problem = draft_vocab_problem(ids, self.config.target_vocab_size)
        if problem is not None:
            raise ValueError(f"restrict_vocabulary: token_ids are not a draft vocabulary ({problem}); give distinct "
                             f"target ids in [0, {self.config.target_vocab_size})")
        current = (torch.arange(self.config.target_vocab_size) if self.draft_vocab_ids is None
                   else self.draft_vocab_ids.cpu())
        position = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long)
        position[current] = torch.arange(len(current))
        if bool((position[ids] < 0).any()):
            raise ValueError(f"restrict_vocabulary: every id must lie in the drafter's current vocabulary "
                             f"(target ids in [0, {self.config.target_vocab_size}))")
        rows = position[ids].to(self.markov_head.markov_w2.weight.device)
        w2 = self.markov_head.markov_w2
        new_w2 = nn.Linear(w2.in_features, ids.numel(), bias=False).to(device=w2.weight.device, dtype=w2.weight.dtype)
        new_w2.weight.copy_(w2.weight[rows])
        new_w2.zero_init = True
        self.markov_head.markov_w2 = new_w2
        self.register_buffer("draft_vocab_ids", ids.to(w2.weight.device), persistent=True)
        self.config.draft_vocab_size = ids.numel()
        self.config.tree_topk = min(self.config.tree_topk, ids.numel())
        if self.is_bound:
            embed, head, _ = self.__dict__["_target_modules"]
            self.__dict__["_target_modules"] = (embed, head, self._draft_head(head))
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """`nn.Module` loading (`load_state_dict`, a training checkpoint): refuse a damaged `draft_vocab_ids`
        before any weight is copied."""
        ids = state_dict.get(prefix + "draft_vocab_ids")
        problem = None if ids is None else draft_vocab_problem(ids, self.config.target_vocab_size)
        if problem is not None:
            raise ValueError(f"the state dict's {prefix}draft_vocab_ids is damaged ({problem}); nothing was loaded")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def to_target_ids(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> target token ids (the identity without one)."""
        return draft_tokens if self.draft_vocab_ids is None else self.draft_vocab_ids[draft_tokens]

    @property
    def is_bound(self) -> bool:
        return self.__dict__.get("_target_modules") is not None

    def _target(self) -> tuple[nn.Module, nn.Module, torch.Tensor]:
        """`(embed_tokens, lm_head, LM-head rows of the draft vocabulary [|S|, H])` of the bound target."""
        if not self.is_bound:
            raise RuntimeError("The drafter is not bound to a target: call drafter.bind_target(target) first "
                               "(generate() does this for you).")
        return self.__dict__["_target_modules"]

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

    def _draft_head(self, head: nn.Module) -> nn.Module:
        """The target's LM head over `S`: `head` itself, or a frozen `nn.Linear` of its rows for `S`
        (packed for the CPU, `hf_treespark.cpu_gemm`, when `head` is)."""
        if self.draft_vocab_ids is None:
            return head
        rows = head.weight.detach()[self.draft_vocab_ids]
        # Built on the meta device and given the rows: no random initialisation, so binding (the first
        # generate() of a process) draws nothing from the global random generator that sampling uses.
        draft = nn.Linear(rows.shape[1], rows.shape[0], bias=head.bias is not None, device="meta")
        draft.weight = nn.Parameter(rows, requires_grad=False)
        if head.bias is not None:
            draft.bias = nn.Parameter(head.bias.detach()[self.draft_vocab_ids], requires_grad=False)
        draft.source_key = _head_source(head)  # rebuilt when the head changes
        if is_packed(head):
            pack_linear_layers(draft)
        return draft

    def depth_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`U_k = lm_head(h_k)[S]` in float32: `[..., H] -> [..., |S|]` (only the draft vocabulary's rows)."""
        _, _, draft_head = self._target()
        return draft_head(hidden.to(draft_head.weight.dtype)).float()

    def markov_bias(self, parent_tokens: torch.Tensor) -> torch.Tensor:
        """`W2(W1[y])` in float32: parent target ids `[...] -> [..., |S|]`."""
        return self.markov_head(parent_tokens).float()

    def confidence(self, hidden: torch.Tensor, parent_tokens: torch.Tensor) -> torch.Tensor:
        """`c_k(y) = sigmoid(w . [h_k ; W1[y]] + b)`: hidden [..., H], parent_tokens [...] -> [...] in (0, 1)."""
        return torch.sigmoid(self.confidence_logit(hidden, parent_tokens))

    def confidence_logit(self, hidden: torch.Tensor, parent_tokens: torch.Tensor) -> torch.Tensor:
        if self.confidence_head is None:
            raise ValueError("this drafter has no confidence head (config.use_confidence_head=False)")
        return self.confidence_head(hidden, self.markov_head.markov_w1(parent_tokens))

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
            attention_mask = self._training_mask(anchor_positions, context_positions, context_valid)
        elif num_anchors != 1:
            raise ValueError("with a context cache the drafter drafts one block at a time (anchor_ids [b, 1])")
        elif context_valid is not None or context_cache.valid is not None:
            attention_mask = self._ragged_mask(context, context_valid, context_cache, bsz)

        for layer in self.layers:
            block = layer(block, block_rope, context, context_rope, attention_mask, context_cache)
        hidden = self.norm(block)
        if self.depth1_head is not None:
            hidden = self._with_depth1_head(hidden, anchor_ids, anchor_positions, target_features, context_cache,
                                            context_valid)
        logits = None
        if return_logits:
            slots = bsz if logit_slots is None else min(logit_slots, bsz)
            if slots < bsz:  # [b, A * B, H] -> the first `slots` depths of each block
                hidden_slots = hidden.view(b, num_anchors, bsz, -1)[:, :, :slots].reshape(b, num_anchors * slots, -1)
            else:
                hidden_slots = hidden
            logits = self.depth_logits(hidden_slots)
        return TreeSparkDrafterOutput(hidden_states=hidden, depth_logits=logits)

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
            context_cache.last_context = _newest_rows(context, context_valid, context_cache.last_context)
        newest = context_cache.last_context if context_cache is not None else context
        if newest is None:
            return torch.zeros(b, num_anchors * bsz, hidden, dtype=self.fc.weight.dtype, device=anchor_positions.device)
        if context_cache is not None:
            return self.anchor_proj(newest).expand(b, num_anchors * bsz, hidden)
        before = (anchor_positions - 1).clamp(min=0)
        rows = context.gather(1, before[:, :, None].expand(-1, -1, hidden))  # [b, A, H]
        rows = rows * (anchor_positions > 0)[:, :, None].to(rows.dtype)
        return self.anchor_proj(rows).repeat_interleave(bsz, dim=1)

    def _with_depth1_head(self, hidden, anchor_ids, anchor_positions, target_features, context_cache,
                          context_valid) -> torch.Tensor:
        """`hidden` `[b, A * B, H]` with each block's anchor slot passed through `depth1_head`.

        The features of the position before anchor `a`: without a cache (training), row `a - 1` of
        `target_features` (zeros for an anchor at position 0); with one, the newest new row (the newest valid one
        per row with `context_valid`), kept in the cache for a pass that brings no new context.
        """
        b, num_anchors = anchor_ids.shape
        width = self.depth1_head.fc.in_features
        have_new = target_features is not None and target_features.shape[1] > 0
        if context_cache is not None:
            if have_new:
                context_cache.last_features = _newest_rows(target_features, context_valid,
                                                           context_cache.last_features)
            before = context_cache.last_features
            if before is None:
                before = hidden.new_zeros(b, 1, width)
        elif have_new:
            index = (anchor_positions - 1).clamp(min=0)
            before = target_features.gather(1, index[:, :, None].expand(-1, -1, width))
            before = before * (anchor_positions > 0)[:, :, None].to(before.dtype)
        else:
            before = hidden.new_zeros(b, num_anchors, width)
        embed, _, _ = self._target()
        blocks = hidden.view(b, num_anchors, self.config.block_size, -1)
        first = self.depth1_head(self._standardised(before), embed(anchor_ids).to(hidden.dtype), blocks[:, :, 0])
        return torch.cat([first[:, :, None], blocks[:, :, 1:]], dim=2).view_as(hidden)

    def _ragged_mask(self, context, context_valid, context_cache: DrafterContextCache, bsz: int) -> torch.Tensor:
        """A batch of rows with different context lengths: `context_cache.valid` extended by the new context's
        `context_valid` (`[b, s]`), as the `[b, 1, 1, S + B]` bool mask of every block slot (a slot sees the real
        context entries and its whole block)."""
        b = context_valid.shape[0] if context_valid is not None else context_cache.valid.shape[0]
        device = context_cache.valid.device if context_cache.valid is not None else context_valid.device
        if context is not None:
            new = (context_valid if context_valid is not None
                   else torch.ones(b, context.shape[1], dtype=torch.bool, device=device))
            old = context_cache.valid
            if old is None:
                old = torch.ones(b, context_cache.get_seq_length(), dtype=torch.bool, device=device)
            context_cache.valid = torch.cat([old, new.bool()], dim=1)
        block = torch.ones(b, bsz, dtype=torch.bool, device=device)
        return torch.cat([context_cache.valid, block], dim=1)[:, None, None, :]

    def _training_mask(self, anchor_positions, context_positions, context_valid) -> BlockTrainingMask:
        """Block `a` sees context positions `< anchor_positions[a]` (and valid) and its own `B` slots."""
        bsz = self.config.block_size
        sees_ctx = None
        if context_positions is not None:
            q_anchor = anchor_positions.repeat_interleave(bsz, dim=1)  # [b, A * B]
            sees_ctx = context_positions[:, None, :] < q_anchor[:, :, None]  # [b, A * B, s]
            if context_valid is not None:
                sees_ctx = sees_ctx & context_valid[:, None, :]
            sees_ctx = sees_ctx[:, None]
        return BlockTrainingMask(sees_ctx, bsz)

    # ----- saving and loading -------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, dtype: torch.dtype | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a model card (`README.md`) when the directory has none and the
        drafter's datastore (`datastore.safetensors`) when it carries one.

        `push_to_hub=True` saves, then uploads what was written and the card (`card.save_and_push`).
        The weights are written in `dtype`; by default in the dtype they were loaded from (a bfloat16
        checkpoint loaded as float32 is saved as bfloat16 again) when that loses nothing, else in the
        model's own dtype.
        """
        try:
            from hf_treespark import card
        except ImportError:  # loaded as remote code, without the package: no card, no custom_generate/
            card = None
        if card is not None and kwargs.pop("push_to_hub", False):
            return card.save_and_push(self, save_directory, *args, dtype=dtype, **kwargs)
        dtype = dtype or self._lossless_stored_dtype()
        os.makedirs(save_directory, exist_ok=True)
        if card is not None:
            card.write_custom_generate(save_directory)
            card.write_card(save_directory, self)
        if self.datastore is not None:
            self.datastore.save(save_directory)
        if dtype is None or dtype == self.dtype:
            return super().save_pretrained(save_directory, *args, **kwargs)
        # Swap every weight for a `dtype` copy while saving (config.json records it too), then put the
        # original tensors back: the drafter in memory is not rounded.
        params = [p for p in self.parameters() if p.is_floating_point()]
        originals = [p.data for p in params]
        try:
            for p in params:
                p.data = p.data.to(dtype)
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            for p, data in zip(params, originals, strict=True):
                p.data = data
            self.config.dtype = self.dtype

    def push_to_hub(self, repo_id: str, *, acceptance_table: str | None = None, **options):
        """Upload the drafter as `treespark push` does (`hf_treespark.card.push_drafter`): its TreeSpark model card,
        the weights, remote code, `custom_generate/` and the datastore. `options` are `PushToHubMixin.push_to_hub`'s
        (`commit_message`, `private`, `token`, `revision`, `create_pr`, `commit_description`, `max_shard_size`,
        `tags`); `acceptance_table` is a measured table for a new card, as for `treespark push`."""
        try:
            from hf_treespark.card import push_drafter
        except ImportError:  # loaded as remote code, without the package: transformers' own upload
            return super().push_to_hub(repo_id, **options)
        return push_drafter(self, repo_id, acceptance_table=acceptance_table, **options)

    def _lossless_stored_dtype(self) -> torch.dtype | None:
        """The dtype of the checkpoint this drafter was loaded from, if every weight is still exact in it."""
        stored = self.__dict__.get("_stored_dtype")
        if stored is None or stored == self.dtype:
            return None
        exact = all(torch.equal(p, p.to(stored).to(p.dtype)) for p in self.parameters() if p.is_floating_point())
        return stored if exact else None

    # ----- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing checkpoints with missing, unexpected or misshaped weights."""
        want_info = kwargs.pop("output_loading_info", False)
        name = os.fspath(pretrained_model_name_or_path)
        if name.startswith((os.sep, ".", "~")) and not os.path.isdir(os.path.expanduser(name)):
            raise OSError(f"No TreeSpark drafter directory at {name!r}: check the path (a Hub repo id looks like "
                          "'org/name').")
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  **kwargs)
        except Exception as err:  # corrupted safetensors raise their own error types
            raise OSError(f"Could not load a TreeSpark drafter from {pretrained_model_name_or_path!r}: {err}") from err
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise OSError(f"Refusing the TreeSpark drafter checkpoint at {pretrained_model_name_or_path!r}: it does "
                          f"not match its config ({bad}). The file is incomplete or from another model.")
        weights = _weights_path(name, kwargs)
        problem = None if model.draft_vocab_ids is None else draft_vocab_problem(model.draft_vocab_ids,
                                                                                 model.config.target_vocab_size)
        if problem is not None:
            raise OSError(f"Refusing the TreeSpark drafter checkpoint {weights}: its draft_vocab_ids buffer is "
                          f"damaged ({problem}): the file was cut or edited. Use an intact copy of the drafter.")
        nonfinite = nonfinite_tensors(model)
        if nonfinite:
            raise ValueError(f"Refusing the TreeSpark drafter checkpoint {weights}: NaN or inf values in "
                             f"{', '.join(nonfinite)}. Training diverged or the file was damaged: retrain the "
                             "drafter, or re-save it from a copy whose weights are finite.")
        model.__dict__["_stored_dtype"] = _stored_dtype(pretrained_model_name_or_path, kwargs)
        model.datastore = _load_datastore(pretrained_model_name_or_path, kwargs, model.config)
        _align_tensors(model)
        return (model, info) if want_info else model


def _newest_rows(new: torch.Tensor, valid: torch.Tensor | None, previous: torch.Tensor | None) -> torch.Tensor:
    """The newest row of `new` (`[b, s, d] -> [b, 1, d]`, left-padded); a row whose newest column is padding
    (`valid`, no new context for it) keeps `previous`."""
    newest = new[:, -1:]
    if valid is not None and previous is not None:
        newest = torch.where(valid[:, -1:, None], newest, previous)
    return newest


def _token_id_tensor(token_ids) -> torch.Tensor:
    """`token_ids` (a sequence, numpy array or tensor of integer ids) as a flat CPU long tensor; `TypeError` for
    anything else (strings, floats, bools)."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"restrict_vocabulary: token_ids must be a list of integer token ids, got "
                        f"{type(token_ids).__name__} {token_ids!r:.40}")
    try:
        ids = torch.as_tensor(token_ids)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is not None and ids.numel() == 0:
        return ids.to(torch.long).flatten().cpu()  # `[]` is float32 to torch
    if ids is None or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"restrict_vocabulary: token_ids must be integer token ids, got {token_ids!r:.60}")
    return ids.to(torch.long).flatten().cpu()


def nonfinite_tensors(model: nn.Module, limit: int = 8) -> list[str]:
    """The floating-point tensors of `model`'s state dict that hold NaN or inf, each as `"name (n NaN, m inf)"`;
    at most `limit` named, then how many more."""
    found = []
    for key, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            found.append(f"{key} ({', '.join(f'{n} {what}' for n, what in ((nan, 'NaN'), (inf, 'inf')) if n)})")
    return found if len(found) <= limit else [*found[:limit], f"{len(found) - limit} more tensors"]


def draft_vocab_problem(ids: torch.Tensor, vocab_size: int) -> str | None:
    """What makes `ids` unfit as a draft vocabulary of a target with `vocab_size` ids (integer dtype, at least
    one id, every id in `[0, vocab_size)`, no id twice), or None when it is fit."""
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        return f"dtype {ids.dtype}, not integer ids"
    ids = ids.flatten()
    if ids.numel() == 0:
        return "no ids"
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        return f"id {low if low < 0 else high} outside the target's vocabulary [0, {vocab_size})"
    unique = torch.unique(ids)
    if unique.numel() != ids.numel():
        counts = torch.bincount(ids.cpu())
        return f"id {int(counts.argmax())} appears {int(counts.max())} times"
    return None


TENSOR_ALIGNMENT = 64  # bytes: what torch's CPU allocator gives every fresh tensor


@torch.no_grad()
def _align_tensors(model: nn.Module) -> None:
    """Copy each CPU parameter and buffer that does not start on a `TENSOR_ALIGNMENT` boundary into fresh storage.

    Weights read from a safetensors file can sit at any 4-byte offset of it, and BLAS kernels round
    differently at different alignments (a linear layer's output moved by an ulp): a reloaded drafter
    would not compute bit for bit what it computed when it was saved. Aligned, it does.
    """
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.device.type == "cpu" and tensor.data_ptr() % TENSOR_ALIGNMENT:
                tensor.data = tensor.data.clone()


def _head_source(head: nn.Module) -> tuple:
    """What a draft head copied from `head` depends on: its weight (as it is now) and whether it is packed."""
    return weight_key(head.weight), is_packed(head)


def _hub_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                   "subfolder", "proxies") if k in kwargs}


def _weights_path(name: str, kwargs: dict) -> str:
    """The weights file of a local checkpoint (`model.safetensors`, or the index of its shards); else `name`."""
    if not os.path.isdir(name):
        return name
    single = os.path.join(name, kwargs.get("subfolder") or "", "model.safetensors")
    index = single + ".index.json"
    return index if not os.path.isfile(single) and os.path.isfile(index) else single


def _load_datastore(name, kwargs: dict, config: TreeSparkConfig) -> Datastore | None:
    """The drafter's `datastore.safetensors` (a directory's or a Hub repo's), or None where it has none. A damaged
    file or one built for another vocabulary raises `DatastoreError` naming it."""
    if os.path.isdir(name):
        path = os.path.join(name, kwargs.get("subfolder") or "", DATASTORE_FILE)
        path = path if os.path.isfile(path) else None
    else:
        from transformers.utils import cached_file

        try:
            path = cached_file(name, DATASTORE_FILE, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False, **_hub_kwargs(kwargs))
        except OSError:
            path = None
    if path is None:
        return None
    return Datastore.load(path, vocab_size=config.target_vocab_size, grow_tokens=config.datastore_grow_tokens)


def _stored_dtype(name, kwargs: dict) -> torch.dtype | None:
    """The weights' dtype recorded in a checkpoint's `config.json` (`dtype`, formerly `torch_dtype`), if any."""
    try:
        config_dict, _ = TreeSparkConfig.get_config_dict(name, **_hub_kwargs(kwargs))
    except (OSError, ValueError):
        return None
    value = config_dict.get("dtype") or config_dict.get("torch_dtype")
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
