"""The drafter's block: `B` slots that attend bidirectionally to themselves and to the target's context.

A block `[x0, MASK, ..., MASK]` runs through Qwen3-style decoder layers (RMSNorm, rotary positions, grouped-query
attention with per-head q/k norms, a SiLU-gated MLP). Its keys and values are those of the block itself,
preceded by those of the projected target context (KV injection): every block slot sees every committed position
it is allowed to, and no causal mask applies inside the block.

Inference drafts one block per row against `DrafterContextCache`, which keeps the context's keys and values of
every layer, so each round projects only the positions committed since the last one. Training drafts many blocks
per sequence in one pass (`BlockTrainingMask`): block `a` sees the context before its anchor and its own slots,
never another block; `block_training_attention` computes exactly that without scoring the other blocks' keys.

This file imports only torch and `.configuration`: it ships beside `modeling.py` as remote code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .configuration import TreeSparkConfig


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
    different context lengths (`decoding/session.py`) keeps `valid` (`[b, S]` bool): which entries are real; the others
    (padding) are hidden from the block's attention. None: every entry is real.

    Each layer's entries sit at the start of a preallocated buffer with room to grow (`with_block`): a pass writes
    the new context and then its block's keys/values in place after them and attends over one view, instead of
    copying the whole context twice a layer (appending, then joining the block). Measured on the 2-core bf16 CPU, a
    pass over 170 context positions copied 0.9 ms of its 7.4 ms this way, over 500 (a pasted document) 3-5 ms.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers  # see `_room`
        self.last_context: torch.Tensor | None = None  # `[b, 1, H]` projected context of the newest position
        self.last_features: torch.Tensor | None = None  # `[b, 1, F]` raw target features of the newest position
        self.valid: torch.Tensor | None = None

    def select(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Rebuild every layer from its entries `index` (`[b, S']`, per row); `valid` (`[b, S']`) says which of
        them are real (compaction, `decoding/session.py`)."""
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
        """Add new context entries `[b, kv_heads, s, head_dim]` to a layer; returns all its entries."""
        return self.with_block(layer_idx, keys, values, None, None)

    def with_block(self, layer_idx: int, keys: torch.Tensor | None, values: torch.Tensor | None,
                   block_keys: torch.Tensor | None, block_values: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's entries with the new context `keys`/`values` appended (kept) and the block's own keys/values
        after them (not kept: the next pass writes over them), as views of the layer's buffer: `[b, kv_heads, S + s
        + B, head_dim]`. Either pair may be None."""
        new = [t for t in (keys, block_keys) if t is not None]
        length = self.get_layer_length(layer_idx)
        if not new:
            return self.keys[layer_idx], self.values[layer_idx]
        added = keys.shape[-2] if keys is not None else 0
        end = length + added + (block_keys.shape[-2] if block_keys is not None else 0)
        buf_k, buf_v = self._room(layer_idx, end, new[0])
        for start, k, v in ((length, keys, values), (length + added, block_keys, block_values)):
            if k is not None:
                buf_k[:, :, start: start + k.shape[-2]] = k
                buf_v[:, :, start: start + k.shape[-2]] = v
        self.keys[layer_idx], self.values[layer_idx] = buf_k[:, :, :length + added], buf_v[:, :, :length + added]
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def get_layer_length(self, layer_idx: int) -> int:
        keys = self.keys[layer_idx]
        return 0 if keys is None else keys.shape[-2]

    def _room(self, layer_idx: int, needed: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers, `[b, kv_heads, capacity >= needed, head_dim]`, holding its entries at their start: the
        current ones while `keys[layer_idx]` is still their view (`crop` keeps it one; `select` and `keep_rows` make
        new tensors), else new ones, twice as large as needed, with the entries copied in."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        buffers = self._buffers[layer_idx]
        if buffers is not None:
            buf_k = buffers[0]
            is_view = keys is None or (keys.data_ptr() == buf_k.data_ptr() and keys.stride() == buf_k.stride()
                                       and keys.shape[:2] == buf_k.shape[:2] and keys.dtype == buf_k.dtype)
            if (is_view and buf_k.shape[-2] >= needed and buf_k.shape[:2] == like.shape[:2]
                    and buf_k.dtype == like.dtype and buf_k.device == like.device):
                return buffers
        b, heads, _, dim = like.shape
        buf_k = like.new_empty(b, heads, max(2 * needed, 64), dim)
        buf_v = torch.empty_like(buf_k)
        if keys is not None:
            buf_k[:, :, :keys.shape[-2]] = keys
            buf_v[:, :, :keys.shape[-2]] = values
        self._buffers[layer_idx] = (buf_k, buf_v)
        return buf_k, buf_v


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



def training_block_mask(anchor_positions: torch.Tensor, context_positions: torch.Tensor | None,
                        context_valid: torch.Tensor | None, block_size: int) -> BlockTrainingMask:
    """Block `a` sees context positions `< anchor_positions[a]` (and valid) and its own `B` slots.

    anchor_positions `[b, A]`, context_positions `[b, s]` (None: no context), context_valid `[b, s]` bool or None.
    """
    sees_ctx = None
    if context_positions is not None:
        q_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [b, A * B]
        sees_ctx = context_positions[:, None, :] < q_anchor[:, :, None]  # [b, A * B, s]
        if context_valid is not None:
            sees_ctx = sees_ctx & context_valid[:, None, :]
        sees_ctx = sees_ctx[:, None]
    return BlockTrainingMask(sees_ctx, block_size)


def ragged_block_mask(context: torch.Tensor | None, context_valid: torch.Tensor | None,
                      context_cache: DrafterContextCache, block_size: int) -> torch.Tensor:
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
    block = torch.ones(b, block_size, dtype=torch.bool, device=device)
    return torch.cat([context_cache.valid, block], dim=1)[:, None, None, :]


def newest_rows(new: torch.Tensor, valid: torch.Tensor | None, previous: torch.Tensor | None) -> torch.Tensor:
    """The newest row of `new` (`[b, s, d] -> [b, 1, d]`, left-padded); a row whose newest column is padding
    (`valid`, no new context for it) keeps `previous`."""
    newest = new[:, -1:]
    if valid is not None and previous is not None:
        newest = torch.where(valid[:, -1:, None], newest, previous)
    return newest


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
        ctx_k, ctx_v = self._kv(context, *context_rope) if context is not None else (None, None)
        groups = self.num_heads // self.num_kv_heads
        if isinstance(attention_mask, BlockTrainingMask):  # training: many blocks, each sees only itself
            if cache is not None and ctx_k is not None:
                ctx_k, ctx_v = cache.append(self.layer_idx, ctx_k, ctx_v)
            out = block_training_attention(query, ctx_k, ctx_v, block_k, block_v, attention_mask, groups)
        else:
            if cache is not None:  # [cached context ; new context ; block], written in place (`with_block`)
                block_k, block_v = cache.with_block(self.layer_idx, ctx_k, ctx_v, block_k, block_v)
            elif ctx_k is not None:
                block_k, block_v = torch.cat([ctx_k, block_k], dim=-2), torch.cat([ctx_v, block_v], dim=-2)
            # Grouped-query attention without repeating the keys: each key/value head's query heads are stacked
            # (`[b, kv_heads, groups * q, hd]`), the same products as repeating every key and value `groups` times.
            grouped = query.reshape(b, self.num_kv_heads, groups * q, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, block_k, block_v, attn_mask=attention_mask)
            out = out.view(b, self.num_heads, q, self.head_dim)
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
