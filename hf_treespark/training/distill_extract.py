"""Distillation's extraction: the positions of any text labelled by the target's own teacher-forced argmax.

`distil_batch` runs B windows (right-padded) through the target in one forward: the features at
`drafter.config.target_layer_ids` and the label `argmax lm_head(h_final[a])`; then drafter passes, the depth-1 head
off, give the anchor-slot state `h_1`. Out come `depth1.FIELDS`: features at `a - 1` and `h_1` in bf16, `x_a`, the
label (and, with `soft_k`, the target's top-K from the same logits: `soft_targets.SOFT_FIELDS`).
`distil_to_shards` stores them within a position budget (`treespark distil --max-disk-gb`); `distill_stream.py`
trains on them as they come.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from itertools import islice

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..decoding.engine import feature_indices, last_logits_only, select_features, synchronised_clock
from . import soft_targets as soft
from .depth1 import FIELDS, SHARD_POSITIONS, PositionShards, head_off
from .distill_sources import TextSequence


def position_bytes(drafter, soft_k: int = 0) -> int:
    """Bytes of one stored position: features and `h_1` in bf16, token and label as int64, and `soft_k` soft
    targets (an int32 id and an fp16 probability each)."""
    config = drafter.config
    return (2 * config.num_target_features * config.target_hidden_size + 2 * config.hidden_size + 16
            + soft.SOFT_BYTES * soft_k)


def _tick(seconds: dict | None, phase: str, since: float, device: torch.device) -> float:
    now = synchronised_clock(device)
    if seconds is not None:
        seconds[phase] = seconds.get(phase, 0.0) + now - since
    return now


ANCHORS = ("agreeing", "all")


@torch.no_grad()
def distil_batch(target, drafter, sequences: list[TextSequence], chunk: int = 96, pieces_per_pass: int = 4,
                 seconds: dict | None = None, anchors: str = "agreeing", soft_k: int = 0) -> dict[str, torch.Tensor]:
    """The labelled positions of `sequences`, row by row: `{"features": [n, n_layers * d_target] bf16 (at a - 1),
    "hidden": [n, H] bf16 (h_1, the head off), "token": [n] (x_a), "label": [n] (the target's argmax at a)}`, and
    with `soft_k > 0` `{"soft_ids", "soft_probs"}` `[n, soft_k]`: the target's top-K at `a` in the draft vocabulary
    (`soft_targets.top_k_targets`), from the logits that give the label.

    `anchors="agreeing"` keeps only the anchors whose token is the target's own argmax at the position before
    (`x_a = argmax p(. | x_..a-1)`), as every anchor at inference is (an accepted token or the target's bonus); "all"
    keeps every labelled position. One target forward over the right-padded batch, then drafter passes of
    `pieces_per_pass` pieces of at most `chunk` anchors of one row each, under autocast to the target's precision
    when it is half (a drafter runs in its target's dtype at inference; measured on the bf16 machine: 1.7x faster
    than float32, `h_1` within 0.3%, below its bf16 storage's rounding). `seconds`, if given, adds the wall time of
    each phase (`target`, `drafter`)."""
    if anchors not in ANCHORS:
        raise ValueError(f"anchors={anchors!r}: use one of {', '.join(ANCHORS)}")
    device = next(target.parameters()).device
    clock = time.perf_counter()
    width = max(len(s.input_ids) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention, labelled = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for row, s in enumerate(sequences):
        ids[row, :len(s.input_ids)] = torch.tensor(s.input_ids)
        attention[row, :len(s.input_ids)] = 1
        labelled[row, :len(s.input_ids)] = torch.tensor(s.labelled)
    if ids.numel() and (ids.min() < 0 or ids.max() >= target.config.vocab_size):
        bad = next(s.id for s in sequences if not all(0 <= t < target.config.vocab_size for t in s.input_ids))
        raise ValueError(f"{bad} holds token ids outside the target's vocabulary (0..{target.config.vocab_size - 1}): "
                         "was it tokenised for another target?")
    ids, attention, labelled = ids.to(device), attention.to(device), labelled.to(device)
    out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True, use_cache=False,
                 **last_logits_only(target))
    features = select_features(out.hidden_states, feature_indices(drafter.config.target_layer_ids))
    head = target.get_output_embeddings()
    if anchors == "agreeing":  # the argmax one position earlier too: whether the anchor's token is the target's
        needed = labelled | F.pad(labelled[:, 1:], (0, 1))
    else:
        needed = labelled
    rows, cols = needed.nonzero(as_tuple=True)  # row-major, positions ascending
    argmax = torch.full_like(ids, -1)
    picked, top = soft.head_argmax_and_top_k(head, out.hidden_states[-1][rows, cols], soft_k, drafter.draft_vocab_ids)
    argmax[rows, cols] = picked  # top: rows of `needed`, row-major
    if anchors == "agreeing":
        labelled = labelled & F.pad(argmax[:, :-1] == ids[:, 1:], (1, 0))
    rows, cols = labelled.nonzero(as_tuple=True)
    label = argmax[rows, cols]
    top = {k: v[(needed.flatten().cumsum(0) - 1).view_as(ids)[rows, cols]] for k, v in top.items()}  # [n, K] each
    clock = _tick(seconds, "target", clock, device)
    half = features.dtype if features.dtype in (torch.bfloat16, torch.float16) else None
    with torch.autocast(device.type, dtype=half, enabled=half is not None):  # the target's precision, as at inference
        hidden = _anchor_states(drafter, ids, features, labelled, chunk, pieces_per_pass)
    _tick(seconds, "drafter", clock, device)
    return {"features": features[rows, cols - 1].to(torch.bfloat16), "hidden": hidden.to(torch.bfloat16),
            "token": ids[rows, cols], "label": label, **top}


def _anchor_states(drafter, ids: torch.Tensor, features: torch.Tensor, labelled: torch.Tensor, chunk: int,
                   pieces_per_pass: int) -> torch.Tensor:
    """`h_1` `[n, H]` of every labelled anchor (row-major), the depth-1 head off. A pass stacks pieces of rows
    (padded with their first anchor), each seeing its row's features before the pass's last anchor."""
    pieces = []
    for row in range(len(ids)):
        anchors = labelled[row].nonzero().squeeze(1)
        pieces += [(row, anchors[s:s + chunk]) for s in range(0, len(anchors), chunk)]
    states, was_training = [], drafter.training
    drafter.eval()
    try:
        with head_off(drafter):
            for i in range(0, len(pieces), pieces_per_pass):
                group = pieces[i:i + pieces_per_pass]
                width = max(len(a) for _, a in group)
                positions = torch.stack([torch.cat([a, a[:1].expand(width - len(a))]) for _, a in group])  # [g, w]
                rows = torch.tensor([row for row, _ in group], device=ids.device)
                out = drafter(anchor_ids=ids[rows[:, None], positions], anchor_positions=positions,
                              target_features=features[rows, :int(positions.max())], return_logits=False)
                first = out.hidden_states.view(len(group), width, drafter.config.block_size, -1)[:, :, 0]
                states += [first[j, :len(a)] for j, (_, a) in enumerate(group)]
    finally:
        drafter.train(was_training)
    return torch.cat(states) if states else features.new_zeros(0, drafter.config.hidden_size)


def _batched(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def distil_to_shards(target, drafter, sequences: Iterable[TextSequence], shards: PositionShards, max_positions: int,
                     batch_size: int = 8, shard_positions: int = SHARD_POSITIONS, progress: bool = True,
                     anchors: str = "agreeing", soft_k: int = 0) -> dict:
    """Store the positions distilled from `sequences` in `shards`, up to `max_positions` in all, going on after the
    sequences done (`references_done` counts sequences here; the one cut at the limit counts as done); with the
    target's top-`soft_k` soft targets when `soft_k > 0`."""
    state = shards.progress()
    fields = FIELDS + (soft.SOFT_FIELDS if soft_k else ())
    columns, pending, done = {k: [] for k in fields}, 0, state["references_done"]
    batches = _batched(islice(sequences, done, None), batch_size)
    bar = tqdm(total=max_positions, initial=state["positions"], unit="position", desc="distilling positions",
               disable=not progress)
    while state["positions"] + pending < max_positions:
        batch = next(batches, None)
        if batch is None:
            break
        room = max_positions - state["positions"] - pending
        for k, v in distil_batch(target, drafter, batch, anchors=anchors, soft_k=soft_k).items():
            columns[k].append(v[:room].cpu())
        pending, done = pending + len(columns["label"][-1]), done + len(batch)
        bar.update(len(columns["label"][-1]))
        if pending >= shard_positions:
            state, columns, pending = shards.write(columns, state, done), {k: [] for k in fields}, 0
    if pending:
        state = shards.write(columns, state, done)
    bar.close()
    return state
