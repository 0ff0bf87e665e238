"""One-forward tree verification: the tree attention mask, the acceptance walk, the cache commit.

The target sees `[x0] + packed nodes` in one forward with
`position_ids = past_len + depth` and a 4D mask letting every node attend to the committed
prefix and to its own root-to-node path.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList

from .tree import DraftTree

GROUPED_SDPA = "treespark_grouped_sdpa"


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    """transformers' sdpa attention, but grouped-query heads under a mask are computed without copying the cache.

    For several query tokens and a mask (a tree verify), stock sdpa repeats every cached key and value once per query
    head of its group (`repeat_kv`): a copy of the whole cache, per layer and forward, that grows with batch x
    context (measured: 13% of a 4-row, 3-token verify forward over 256 cached tokens of SmolLM2-135M on a 2-core
    CPU). Here the queries of each key/value head's group are stacked instead (`[b, kv_heads, groups * q, d]`) and
    the mask repeated per group (`q x kv` entries): the same products, no copy. What stock sdpa already does well
    (one query token, no mask, no grouping, biases, soft-capping) goes to it unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q, dim = query.shape
    plain = (groups == 1 or q == 1 or attention_mask is None or attention_mask.dim() != 4
             or attention_mask.shape[1] != 1 or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None or kwargs.get("output_attentions"))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    stacked = query.reshape(b, heads // groups, groups * q, dim)
    mask = _grouped_mask(attention_mask, key.shape[2], groups)
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None


_LAST_MASK = threading.local()  # the last mask `_grouped_mask` repeated, with its inputs (one per thread)


def _grouped_mask(mask: torch.Tensor, key_len: int, groups: int) -> torch.Tensor:
    """`mask[..., :key_len]` repeated once per query head of a group (`[b, 1, groups * q, key_len]`), made once per
    forward: every layer gets the same mask tensor, and repeating it once instead of 30 times took a tree verify of
    SmolLM2-135M from 46.2 to 45.6 ms (measured on the 2-core bf16 CPU). The cache holds the mask itself, so a new
    mask is never mistaken for it."""
    last = getattr(_LAST_MASK, "entry", None)
    if last is not None and last[0] is mask and last[1:4] == (mask._version, key_len, groups):
        return last[4]
    repeated = mask[:, :, :, :key_len].repeat(1, 1, groups, 1)
    _LAST_MASK.entry = (mask, mask._version, key_len, groups, repeated)
    return repeated


def register_sdpa_variant(name: str, attention) -> bool:
    """Register `attention` with transformers under `name`, masked as sdpa is; False where this transformers has no
    attention registry (the variant is then never used)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return True


_GROUPED_SDPA_REGISTERED = register_sdpa_variant(GROUPED_SDPA, grouped_sdpa_attention)


@contextmanager
def grouped_attention(model) -> Iterator[None]:
    """Within the block, a target loaded with sdpa attention uses `grouped_sdpa_attention` (the package's forwards
    only: prefill, verify, latency measurement); any other attention is left as it is."""
    config = getattr(model, "config", None)
    if not _GROUPED_SDPA_REGISTERED or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def tree_attention_mask(ancestors: torch.Tensor, prefix: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The verify forward's additive float mask `[b, 1, W, L + W]`: 0 where a node may attend, dtype-min elsewhere
    (a float mask works for both eager and sdpa attention; eager silently misreads bool masks). The one builder:
    every verify forward, for one row or a ragged batch, and the latency measurement's, uses it.

    `ancestors` `[b, W, W]` bool: node `i` may see node `j` (itself and its ancestors; `DraftTree.ancestors`, or
    `tree.stack_trees`'). `prefix`: the `L` cache entries before the tree; an int when every node sees all of
    them, or `[b, L]` bool (True: a real entry of the row's own text) for a ragged batch.
    """
    b, w, _ = ancestors.shape
    if isinstance(prefix, int):
        allowed_prefix = torch.ones(b, w, prefix, dtype=torch.bool, device=ancestors.device)
    else:
        allowed_prefix = prefix[:, None, :].expand(b, w, prefix.shape[1])
    allowed = torch.cat([allowed_prefix, ancestors], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ancestors.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def cache_kwarg(model) -> str:
    """The name under which `model.forward` takes its KV cache (`cache` in newer transformers)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def tree_position_ids(depths: torch.Tensor, past: int | torch.Tensor) -> torch.Tensor:
    """`[b, W]`: each node sits at its row's committed tokens (`past`: an int, or `[b]`) plus its depth
    (`depths` `[b, W]`)."""
    return past + depths if isinstance(past, int) else past[:, None] + depths


@dataclass
class Acceptance:
    """Result of the acceptance walk for each batch row.

    path: `[b, D + 1]` node indices of the accepted path from the root, padded with -1.
    num_accepted: `[b]` accepted non-root nodes.
    bonus: `[b]` the target's token after the last accepted node.
    tokens: `[b, D + 1]` committed tokens (accepted nodes then the bonus), padded with -1.
    scores: per committed token, the processed target scores it was chosen from (`[b, V]` each), or None.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor
    tokens: torch.Tensor
    scores: list[torch.Tensor] | None = None
    raw_logits: list[torch.Tensor] | None = None


def greedy_accept(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Vectorised greedy walk.

    `target[i] = argmax logits[i]` is the target's choice after node `i`'s path. A node is
    correct when its token equals its parent's target choice; it is accepted when it and all
    its ancestors are correct. Siblings carry distinct tokens, so the accepted set is one path.
    The bonus is the target's choice at the deepest accepted node.
    """
    # In float32, as plain decoding picks (transformers upcasts the step's logits): the same values, so the same
    # first maximum. `max(dim).indices` is that first maximum too (as `argmax`), and on a CPU it is the faster
    # kernel: over [17, 49152] bfloat16 logits, upcast and max 0.34 ms against 0.79 ms with `argmax` (and 1.7 ms
    # for a bfloat16 argmax), measured on the 2-core Intel bf16 machine.
    target = logits.float().max(dim=-1).indices  # [b, N + 1]
    parent_choice = target.gather(1, tree.parents.clamp(min=0))
    correct = (tree.tokens == parent_choice) | (tree.parents < 0)  # [b, N + 1]
    accepted = ~(tree.ancestors & ~correct[:, None, :]).any(dim=-1)  # [b, N + 1]
    depth = torch.where(accepted, tree.depths, -1)
    last = depth.argmax(dim=-1)  # deepest accepted node
    num_accepted = depth.max(dim=-1).values
    return _acceptance(tree, accepted, last, num_accepted, target.gather(1, last[:, None])[:, 0])


def _acceptance(tree, accepted, last, num_accepted, bonus) -> Acceptance:
    """Order the accepted nodes by depth (a path has one node per depth) into padded tensors."""
    b, n = tree.tokens.shape
    max_depth = int(tree.depths.max()) + 1
    device = tree.tokens.device
    path = torch.full((b, max_depth + 1), -1, dtype=torch.long, device=device)
    rows = torch.arange(b, device=device)[:, None].expand(b, n)
    node_ids = torch.arange(n, device=device).expand(b, n)
    path[rows[accepted], tree.depths[accepted]] = node_ids[accepted]
    tokens = torch.full_like(path, -1)
    tokens[:, :-1] = torch.where(path[:, 1:] >= 0, tree.tokens.gather(1, path[:, 1:].clamp(min=0)), -1)
    tokens.scatter_(1, num_accepted[:, None], bonus[:, None])
    return Acceptance(path=path, num_accepted=num_accepted, bonus=bonus, tokens=tokens)


def processed_accept(
    tree: DraftTree,
    logits: torch.Tensor,
    prefix_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
    keep_scores: bool = False,
) -> Acceptance:
    """Walk with logits processors applied to each path prefix, greedy or sampling (batch size 1).

    At the current node, process the target logits with the prefix `prefix_ids + path tokens`,
    pick the target token (argmax, or a sample of the processed distribution); if a child carries
    it, move there, else it is the bonus. Sampling this way draws each token from exactly the
    target's processed distribution, so the output is distributed as plain sampling.
    """
    if tree.tokens.shape[0] != 1:
        raise ValueError("processed_accept handles one sequence at a time")
    node, path_tokens = 0, []
    scores, raw = [], []
    children_of = tree.parents[0]
    while True:
        ids = torch.cat([prefix_ids, prefix_ids.new_tensor([path_tokens])], dim=1) if path_tokens else prefix_ids
        row = logits[:, node].float()
        processed = logits_processor(ids, row) if logits_processor else row
        if keep_scores:
            scores.append(processed)
            raw.append(row)
        if do_sample:
            choice = torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1)[0, 0]
        else:
            choice = processed[0].argmax()
        match = ((children_of == node) & (tree.tokens[0] == choice)).nonzero()
        if match.numel() == 0:
            break
        node = int(match[0, 0])
        path_tokens.append(int(choice))
    accepted = torch.zeros_like(tree.tokens, dtype=torch.bool)
    accepted[0, tree.ancestors[0, node]] = True
    num_accepted = tree.depths[:, node]
    result = _acceptance(tree, accepted, torch.tensor([node], device=logits.device), num_accepted, choice.view(1))
    if keep_scores:
        result.scores, result.raw_logits = scores, raw
    return result


def commit_cache(cache, past_len: int, keep: torch.Tensor) -> None:
    """Keep the chunk entries `keep` (`[b, m]` indices into the verified chunk, in order) and drop the rest.

    Every layer's keys/values `[b, heads, past_len + N + 1, dim]` become
    `[b, heads, past_len + m, dim]`: the kept entries move to the front of the chunk, in place, and
    the layer keeps a view of the first `past_len + m` entries (the committed prefix is not copied;
    the cache's next update concatenates onto that view, as it does every step).
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: TreeSpark needs a DynamicCache")
    index = past_len + keep  # [b, m]
    # The root alone, a lookup-only round's chain or the first nodes in order: the entries are where they belong
    # already, and only the rest is dropped (no gather, no copy).
    in_place = bool((keep == torch.arange(keep.shape[1], device=keep.device)).all())
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer":
            raise TypeError(f"unsupported cache layer {type(layer).__name__}: TreeSpark commits non-contiguous "
                            "tree entries and supports full-attention DynamicCache layers only")
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            if not in_place:
                idx = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                tensor[:, :, past_len:past_len + keep.shape[1]] = tensor.gather(2, idx)
            setattr(layer, name, tensor[:, :, :past_len + keep.shape[1]])
