"""`generate()` for a left-padded batch: each row to its own end, padded as plain batched `generate` pads it.

Apart from the one-row loop (`generation.py`) because a batch is its own idea: a ragged session
(`session.DecodingSession`), rows that finish and leave it, a budget re-chosen for the rows left (`budget.BatchBudget`),
and the hand-over to transformers' own loop once no tree pays. `generation.treespark_decoding` calls
`batched_decoding` for any batch of more than one row.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from ..core.tree import TreePolicy
from ..sources.datastore import HEADER_TOKENS
from .budget import BatchBudget
from .generation_checks import check_batch, empty_cache
from .generation_output import RoundRecord, TreeSparkGenerateOutput, acceptance_stats, first_stop
from .session import DecodingSession


def _pad_token(generation_config: GenerationConfig) -> int:
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


@torch.no_grad()
def batched_decoding(model, drafter, input_ids: torch.Tensor, logits_processor: LogitsProcessorList,
                     stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig, policy: TreePolicy,
                     gate: float | None, datastore, sources: list, streamer, tree_record: bool, tree_timer,
                     model_kwargs: dict):
    """`treespark_decoding` for a left-padded batch of `B > 1` rows (`session.DecodingSession`).

    Each row stops at its own end (end-of-sequence, a stopping criterion, the length limit) and is padded with the
    pad token up to the longest row, as plain `generate` pads it; the batch ends when every row has ended. With
    `tree_budget="auto"` the budget is chosen for the number of unfinished rows (`budget.BatchBudget`), again each
    time rows finish and as the rows' acceptance corrects the drafter's profile; so is the threshold of the batch's
    drafter gate with `tree_gate="auto"` (`gate` None; a number is kept). When "auto" finds that no tree pays for
    the rows left (greedy without logits processors), transformers' own loop decodes them to their ends from the
    session's cache (`_finish_plain`; each plain step is recorded as a round of one token). With
    `return_dict_in_generate=True`: `rounds`, `acceptance_length` and `acceptance_by_depth` are per row (lists of
    B), `tree_budget` the budget of the first round (None where every row ended at its first token before "auto"
    chose one); no cache is returned (the batch's cache is ragged, and finished rows leave it).
    """
    mask = check_batch(input_ids, model_kwargs.get("attention_mask"), generation_config, streamer)
    rows = input_ids.shape[0]
    pad = _pad_token(generation_config)
    chooser = BatchBudget(model, drafter, policy)
    budget = None if chooser.needs_scores else chooser(rows)
    if budget == 0:  # no tree pays at this batch size: plain decoding, transformers' own loop
        return _plain_batch(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                            model_kwargs)

    def choose_from_scores(scores):
        chooser.from_scores(scores)
        return chooser(len(active))

    session = DecodingSession(model, drafter, policy, rows, logits_processor=logits_processor,
                             do_sample=bool(generation_config.do_sample), cache=empty_cache(model_kwargs),
                             timer=tree_timer, gate=gate if gate is not None else 0.0, sources=sources,
                             budget=budget,
                             choose_budget=choose_from_scores if budget is None else None)
    first_budget = budget
    logits = session.prefill(input_ids, mask).float()
    processed = logits_processor(input_ids, logits) if len(logits_processor) else logits
    first = torch.multinomial(torch.softmax(processed, dim=-1), 1) if generation_config.do_sample else \
        processed.argmax(dim=-1, keepdim=True)
    sequences = [torch.cat([input_ids[i:i + 1], first[i:i + 1]], dim=1) for i in range(rows)]
    pads = (mask == 0).sum(dim=1).tolist()
    records: list[list[RoundRecord]] = [[] for _ in range(rows)]
    active = [i for i in range(rows) if first_stop(stopping_criteria, sequences[i], 1) is None]
    if len(active) < rows:
        session.keep_rows([i for i in range(rows) if i in active])
    while active:
        if not chooser.needs_scores and session.choose_budget is None:
            budget = chooser(len(active))
            if budget == 0 and policy.auto and not session.walk_processed:
                # no tree pays for these rows any more: transformers' own loop from here (greedy, no processors)
                _finish_plain(model, session, active, sequences, pads, records, pad, stopping_criteria,
                              logits_processor, generation_config)
                break
            session.set_budget(budget)
        if gate is None and session.gate is not None:
            session.gate.threshold = chooser.gate_threshold(len(active), session.policy.budget)
        with tree_timer("round") if tree_timer is not None else nullcontext():
            rounds = session.step([sequences[i][0, pads[i]:] for i in active], [sequences[i] for i in active])
            if first_budget is None:
                first_budget = session.budget
            chooser.observe(session.budget, [rnd.tokens.shape[1] for rnd in rounds])  # the budget this round ran
            still = []
            for position, (i, rnd) in enumerate(zip(active, rounds, strict=True)):
                new_tokens = rnd.tokens
                sequences[i] = torch.cat([sequences[i], new_tokens], dim=1)
                stop = first_stop(stopping_criteria, sequences[i], new_tokens.shape[1])
                if stop is not None:
                    sequences[i] = sequences[i][:, : sequences[i].shape[1] - new_tokens.shape[1] + stop]
                    new_tokens = new_tokens[:, :stop]
                else:
                    still.append(position)
                records[i].append(RoundRecord.of(rnd, new_tokens[0].tolist(), tree_record))
            if len(still) < len(active):
                active = [active[p] for p in still]
                if active:
                    session.keep_rows(still)

    if datastore is not None:  # growing with use (`grow_tokens`): each row's output, padding excluded
        for i in range(rows):
            datastore.add(sequences[i][0, max(pads[i], input_ids.shape[1] - HEADER_TOKENS):].tolist())
    width = max(seq.shape[1] for seq in sequences)
    ids = torch.full((rows, width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for i, seq in enumerate(sequences):
        ids[i, :seq.shape[1]] = seq[0]
    if not generation_config.return_dict_in_generate:
        return ids
    stats = [acceptance_stats(r, session.policy.depth) for r in records]
    return TreeSparkGenerateOutput(sequences=ids, rounds=records, acceptance_length=[m for m, _ in stats],
                                   acceptance_by_depth=[d for _, d in stats], tree_budget=first_budget)


class _RowStops(StoppingCriteria):
    """Stopping for `_finish_plain`: each row is judged by the caller's criteria on its own sequence as plain
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


def _finish_plain(model, session: DecodingSession, active: list[int], sequences: list[torch.Tensor], pads: list[int],
                  records: list[list[RoundRecord]], pad: int, stopping_criteria: StoppingCriteriaList,
                  logits_processor: LogitsProcessorList, generation_config: GenerationConfig) -> None:
    """The unfinished rows `active` decoded to their ends by transformers' own loop, continuing from the session's
    cache (gathered into an ordinary left-padded cache, `DecodingSession.plain_inputs`): what "auto" does once no
    tree pays for the rows left (greedy without logits processors only: processors see the realigned padding).
    Appends each row's tokens to `sequences` and one record per token (a plain step) to `records`."""
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


def _plain_batch(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
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
