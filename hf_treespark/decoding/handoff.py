"""The rest of a call in transformers' own loop: plain steps from the decoding session's cache.

The round controller (`controller.py`) hands rows over when TreeSpark rounds stop paying: one row whose rounds the
per-call guard found slower than plain steps, a batch for which "auto" finds no tree pays (from the start, or for
the rows left). transformers' `_sample` continues from the session's cache, so the output is what plain decoding
gives: exact in greedy, distributed as the target in sampling. Each plain step is recorded as a round of one token.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from .generation_output import RoundRecord, TreeSparkGenerateOutput
from .session import DecodingSession


def pad_token(generation_config: GenerationConfig) -> int:
    """The id plain `generate` pads finished rows with (its pad token, else its first end-of-sequence token)."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    if pad is None:
        raise ValueError("a batch whose rows may end at different lengths needs a pad token: set "
                         "generation_config.pad_token_id (or pass pad_token_id=...), as plain batched generate does.")
    return int(pad.flatten()[0]) if isinstance(pad, torch.Tensor) else int(pad)


class _RowStops(StoppingCriteria):
    """Stopping for `finish_plain`: each row is judged by the caller's criteria on its own sequence as plain
    `generate` holds it (its prompt's padding, its own length: the realigned rows are at different lengths), and
    the number of tokens it had when it stopped is kept (`stopped`)."""

    def __init__(self, criteria: StoppingCriteriaList, sequences: list[torch.Tensor], width: int):
        self.criteria, self.sequences, self.width = criteria, sequences, width
        self.stopped: list[int | None] = [None] * len(sequences)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids.shape[1] - self.width
        for i, seq in enumerate(self.sequences):
            if self.stopped[i] is None and self.criteria(torch.cat([seq, input_ids[i:i + 1, self.width:]], 1),
                                                         None).any():
                self.stopped[i] = new
        return torch.tensor([s is not None for s in self.stopped], dtype=torch.bool, device=input_ids.device)


def finish_plain(model, session: DecodingSession, active: list[int], sequences: list[torch.Tensor], pads: list[int],
                 records: list[list[RoundRecord]], stopping_criteria: StoppingCriteriaList,
                 logits_processor: LogitsProcessorList, generation_config: GenerationConfig, streamer=None) -> None:
    """The unfinished rows `active` decoded to their ends by transformers' own loop, continuing from the session's
    cache. Appends each row's tokens to `sequences` (`[1, T_i]`, left padding `pads[i]` included) and one record per
    token (a plain step) to `records`.

    One unpadded row (the per-call guard's hand-off) continues as it is, its `streamer` fed and ended by
    transformers' loop. Rows of a batch are gathered into an ordinary left-padded cache first
    (`DecodingSession.plain_inputs`), each judged by the caller's stopping criteria on its own sequence (`_RowStops`):
    greedy without logits processors only (processors would see the realigned padding)."""
    if len(active) == 1 and not pads[active[0]] and session.ragged.valid is None:
        i = active[0]
        start = sequences[i].shape[1]
        out = type(model)._sample(model, sequences[i], logits_processor=logits_processor,
                                  stopping_criteria=stopping_criteria, generation_config=generation_config,
                                  synced_gpus=False, streamer=streamer, attention_mask=torch.ones_like(sequences[i]),
                                  use_cache=True, **{session.cache_kw: session.cache})
        sequences[i] = getattr(out, "sequences", out)
        records[i].extend(RoundRecord.plain_step(token) for token in sequences[i][0, start:].tolist())
        return
    pad = pad_token(generation_config)
    ids, mask, positions = session.plain_inputs([sequences[i][0, pads[i]:] for i in active], pad)
    width = ids.shape[1]
    stops = _RowStops(stopping_criteria, [sequences[i] for i in active], width)
    out = type(model)._sample(model, ids, logits_processor=logits_processor,
                              stopping_criteria=StoppingCriteriaList([stops]), generation_config=generation_config,
                              synced_gpus=False, streamer=None, attention_mask=mask, use_cache=True,
                              position_ids=positions, **{session.cache_kw: session.cache})
    out = getattr(out, "sequences", out)
    for row, i in enumerate(active):
        count = stops.stopped[row] if stops.stopped[row] is not None else out.shape[1] - width
        new_tokens = out[row:row + 1, width:width + count]
        sequences[i] = torch.cat([sequences[i], new_tokens], dim=1)
        records[i].extend(RoundRecord.plain_step(token) for token in new_tokens[0].tolist())


def plain_batch(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """A batch decoded by transformers' own sampling loop (plain greedy or sampling): what "auto" does where no
    tree budget beats a plain step. With `return_dict_in_generate=True`, no rounds (a plain step commits one token
    per forward: acceptance 1) and `tree_budget` 0."""
    out = type(model)._sample(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                              generation_config=generation_config, synced_gpus=False, streamer=None, **model_kwargs)
    if not generation_config.return_dict_in_generate:
        return out
    rows, depth = input_ids.shape[0], drafter.config.block_size
    return TreeSparkGenerateOutput(sequences=out.sequences, rounds=[[] for _ in range(rows)],
                                   acceptance_length=[1.0] * rows, acceptance_by_depth=[[0.0] * depth] * rows,
                                   tree_budget=0, cache=getattr(out, "past_key_values", None))
