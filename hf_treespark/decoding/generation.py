"""`generate()`'s TreeSpark loop, for every batch size, and a `CandidateGenerator` for custom loops.

`treespark_decoding` has the signature of a transformers `custom_generate` callable: `generate()` prepares the
generation config, logits processors and stopping criteria, then calls it (see `integration.py`). It prefills, then
drives a `session.DecodingSession` of `B >= 1` rows a round at a time (draft, verify in one target forward, accept,
commit), asking the round controller (`controller.RoundController`) before each round what it runs, and does what
`generate` promises around that: stopping criteria inside a round, each row to its own end, streaming and scores
(one row), per-round records.

Around it, one module per idea: what a call accepts (`generation_checks.py`), what it returns
(`generation_output.py`), the speed decisions (`controller.py`), and the rest of a call in transformers' own loop
(`handoff.py`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator

from ..core.tree import DraftTree, TreePolicy, pack_tree
from ..sources.base import build_sources
from ..sources.datastore import HEADER_TOKENS
from ..sources.lookup import add_lookup_branches, find_lookup_branches, max_extra_budget
from .controller import RoundController
from .engine import draft_pool
from .generation_checks import (
    check_arguments,
    check_batch,
    check_supported,
    empty_cache,
    left_padding,
    resolve_datastore,
    resolve_policy,
    resolve_sources,
)
from .generation_output import RoundRecord, TreeSparkGenerateOutput, acceptance_stats, first_stop
from .handoff import finish_plain, pad_token, plain_batch
from .session import DecodingSession


def _pick(processed: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The next token of each row `[B, 1]` from processed scores `[B, V]`: a sample, or the argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1)
    return processed.argmax(dim=-1, keepdim=True)


def _commit(rounds, active: list[int], sequences: list[torch.Tensor], stopping_criteria: StoppingCriteriaList):
    """Append each active row's round tokens to its sequence (`sequences[i]`, `[1, T_i]`), cut where a stopping
    criterion is met inside the round. Returns `(committed, still)`: each row's tokens kept (`[1, k]`), and the
    positions (among `active`) of the rows that go on."""
    committed, still = [], []
    for position, (i, rnd) in enumerate(zip(active, rounds, strict=True)):
        new_tokens = rnd.tokens
        sequences[i] = torch.cat([sequences[i], new_tokens], dim=1)
        stop = first_stop(stopping_criteria, sequences[i], new_tokens.shape[1])
        if stop is not None:
            sequences[i] = sequences[i][:, : sequences[i].shape[1] - new_tokens.shape[1] + stop]
            new_tokens = new_tokens[:, :stop]
        else:
            still.append(position)
        committed.append(new_tokens)
    return committed, still


def _padding(input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig, streamer):
    """`(mask, pad, pads)`: a batch's attention mask (`[B, T]`, checked: `check_batch`), the token that pads rows that
    end early, and each row's left padding; for one row `(None, None, [left padding])`: the target sees the unpadded
    prompt, processors and stopping criteria the padded sequence, as in plain decoding."""
    if input_ids.shape[0] == 1:
        return None, None, [left_padding(attention_mask, input_ids)]
    mask = check_batch(input_ids, attention_mask, generation_config, streamer)
    return mask, pad_token(generation_config), (mask == 0).sum(dim=1).tolist()


@torch.no_grad()
def treespark_decoding(
    model,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    treespark_drafter=None,
    treespark_streamer=None,
    tree_budget: int | None = None,
    tree_topk: int | None = None,
    tree_depth: int | None = None,
    tree_frontier: int | None = None,
    tree_chain: bool = False,
    tree_lookup: int | None = None,
    tree_gate: float | str = "auto",
    tree_datastore=None,
    tree_sources: dict | None = None,
    tree_record: bool = False,
    tree_timer=None,
    tree_guard=True,
    **model_kwargs,
):
    """The TreeSpark decoding loop (a transformers `custom_generate` callable), for `B >= 1` left-padded rows.

    Returns `[B, prompt + new]` token ids, each row stopped at its own end (end-of-sequence, a stopping criterion,
    the length limit) and padded with the pad token up to the longest row, as plain `generate` pads it; or a
    `TreeSparkGenerateOutput` with `return_dict_in_generate=True`. For one row its `cache` (`past_key_values`) is
    the target's cache of every token but the last, as plain decoding returns it (left padding excluded), and
    `rounds`, `acceptance_length`, `acceptance_by_depth` describe the row; for a batch they are per row (lists of
    B), no cache is returned (the batch's cache is ragged, and finished rows leave it), and `tree_budget` is the
    budget of the first round (None where every row ended at its first token before "auto" chose one).
    Attentions, hidden states and `inputs_embeds` are refused (`check_arguments`); streamers, scores and logits
    need one row (`check_batch`).

    `tree_record=True` stores each round's tree in its record. `tree_gate`: the drafter gate's threshold with
    lookup on (`controller.resolve_gate`). `tree_timer` (an `engine.PhaseTimer`) sums the wall time of each round
    phase (`treespark bench --profile`). `tree_guard` (one row, on by default): a call whose rounds commit tokens
    more slowly than plain steps, judged twice in a row against root-only probe rounds, goes on in transformers' own
    loop (`call_guard.py`; not with scores, logits or padding); False drafts to the end. A batch with
    `tree_budget="auto"` goes on in transformers' loop once no tree pays for its rows left (greedy, no processors).
    """
    drafter = treespark_drafter
    check_arguments(generation_config, model_kwargs)
    check_supported(model, drafter, input_ids, generation_config)
    policy = resolve_policy(drafter, tree_budget, tree_topk, tree_depth, tree_frontier, tree_chain, tree_lookup)
    datastore = resolve_datastore(drafter, tree_datastore)
    sources = build_sources(drafter, {"datastore": datastore, **resolve_sources(tree_sources)})
    streamer, rows = treespark_streamer, input_ids.shape[0]
    want_scores, want_logits = bool(generation_config.output_scores), bool(generation_config.output_logits)
    do_sample = bool(generation_config.do_sample)
    mask, pad, pads = _padding(input_ids, model_kwargs.get("attention_mask"), generation_config, streamer)
    keep_scores = want_scores or want_logits
    controller = RoundController(model, drafter, policy, rows, tree_gate, tree_guard,
                                 guardable=not keep_scores and not pads[0],
                                 walk_processed=do_sample or len(logits_processor) > 0)
    if controller.plain_from_start:  # no tree pays at this batch size: transformers' own loop
        return plain_batch(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                           model_kwargs)
    session = DecodingSession(model, drafter, controller.policy, rows, logits_processor=logits_processor,
                              do_sample=do_sample, keep_scores=keep_scores, cache=empty_cache(model_kwargs),
                              timer=tree_timer, gate=controller.gate, sources=sources, budget=controller.budget,
                              choose_budget=controller.choose_from_scores if controller.awaiting_scores else None,
                              pricer=controller.pricer)

    if streamer is not None:
        streamer.put(input_ids.cpu())
    # Prefill: the first token comes from the prompts' forward, as in plain decoding.
    logits = (session.prefill(input_ids, mask) if rows > 1 else session.prefill(input_ids[:, pads[0]:])).float()
    processed = logits_processor(input_ids, logits) if len(logits_processor) else logits
    first = _pick(processed, do_sample)
    scores = [processed] if want_scores else []
    raw_logits = [logits] if want_logits else []
    if streamer is not None:
        streamer.put(first.cpu())
    sequences = [torch.cat([input_ids[i:i + 1], first[i:i + 1]], dim=1) for i in range(rows)]
    records: list[list[RoundRecord]] = [[] for _ in range(rows)]
    active = [i for i in range(rows) if first_stop(stopping_criteria, sequences[i], 1) is None]
    if active and len(active) < rows:
        session.keep_rows(active)

    handed_off = False
    while active:
        choice = controller.next_round(len(active), session.policy.budget)
        if choice.plain:  # TreeSpark rounds no longer pay: transformers' loop from here
            finish_plain(model, session, active, sequences, pads, records, stopping_criteria, logits_processor,
                         generation_config, streamer)
            handed_off = True
            break
        session.apply(choice.budget, choice.gate)
        began = time.perf_counter()
        with tree_timer("round") if tree_timer is not None else nullcontext():
            rounds = session.step([sequences[i][0, pads[i]:] for i in active], [sequences[i] for i in active],
                                  choice.probe)
            committed, still = _commit(rounds, active, sequences, stopping_criteria)
            kept = committed[0].shape[1]
            if want_scores:
                scores.extend(rounds[0].acceptance.scores[:kept])
            if want_logits:
                raw_logits.extend(rounds[0].acceptance.raw_logits[:kept])
            if streamer is not None:
                streamer.put(committed[0].cpu())
        seconds = time.perf_counter() - began
        timed = None if session.batched else seconds  # a batch's rows share each round
        for i, rnd, tokens in zip(active, rounds, committed, strict=True):
            records[i].append(RoundRecord.of(rnd, tokens[0].tolist(), tree_record, timed))
        controller.observe(session.budget, [rnd.tokens.shape[1] for rnd in rounds], [t.shape[1] for t in committed],
                           seconds, choice.probe, rounds[0].verify_seconds)
        if len(still) < len(active):
            active = [active[p] for p in still]
            if active:
                session.keep_rows(still)

    if streamer is not None and not handed_off:  # transformers' loop ended the stream it took over
        streamer.end()
    if datastore is not None:  # growing with use (`grow_tokens`): each row's output, padding excluded
        for i in range(rows):
            datastore.add(sequences[i][0, max(pads[i], input_ids.shape[1] - HEADER_TOKENS):].tolist())
    return _output(sequences, pads, pad, records, scores if want_scores else None,
                   raw_logits if want_logits else None, session, controller, generation_config)


def _output(sequences: list[torch.Tensor], pads: list[int], pad: int | None, records: list[list[RoundRecord]],
            scores: list | None, raw_logits: list | None, session: DecodingSession, controller: RoundController,
            generation_config: GenerationConfig):
    """What the call returns (see `treespark_decoding`): the rows' `sequences` (`[1, T_i]` each) as one tensor,
    padded on the right with `pad` (a batch), or `return_dict_in_generate`'s output."""
    rows = len(sequences)
    if rows == 1:
        # The target's cache of the committed text (left padding excluded), as plain decoding leaves it: every
        # token but the last. A round cut short by a stop had cached entries past it.
        ids = sequences[0]
        session.cache.crop(ids.shape[1] - 1 - pads[0] - session.cache.get_seq_length())  # (minus the entries to drop)
    else:
        ids = torch.full((rows, max(seq.shape[1] for seq in sequences)), pad, dtype=sequences[0].dtype,
                         device=sequences[0].device)
        for i, seq in enumerate(sequences):
            ids[i, :seq.shape[1]] = seq[0]
    if not generation_config.return_dict_in_generate:
        return ids
    depth = session.policy.depth
    if rows > 1:
        stats = [acceptance_stats(r, depth) for r in records]
        return TreeSparkGenerateOutput(sequences=ids, rounds=records, acceptance_length=[m for m, _ in stats],
                                       acceptance_by_depth=[d for _, d in stats], tree_budget=controller.first_budget)
    mean, by_depth = acceptance_stats(records[0], depth)
    return TreeSparkGenerateOutput(sequences=ids, scores=None if scores is None else tuple(scores),
                                   logits=None if raw_logits is None else tuple(raw_logits), rounds=records[0],
                                   acceptance_length=mean, acceptance_by_depth=by_depth,
                                   tree_budget=session.policy.budget,
                                   cache=session.cache if generation_config.use_cache else None)


class TreeSparkCandidateGenerator(CandidateGenerator):
    """Drafts a packed TreeSpark tree, for people who compose their own verification loops.

    `get_candidates(input_ids)` returns `(input_ids + packed node tokens, None)`: the tree's `N`
    nodes in order (parents first). `self.tree` holds the `DraftTree` (parents, depths,
    ancestor matrix) from which `tree_attention_mask` and `tree_position_ids` build the verify
    inputs. Feed back the target features of committed positions with `add_context(features)`
    (`[b, s, n_layers * d_target]`, `engine.select_features(out.hidden_states,
    engine.feature_indices(drafter.config))`) before each call: the drafter is conditioned on them.
    A policy with `tree_budget="auto"` packs its whole candidate pool here (no device-specific choice).
    """

    def __init__(self, drafter, target, policy: TreePolicy | None = None):
        drafter.bind_target(target)
        self.drafter = drafter
        self.policy = policy or resolve_policy(drafter)
        if self.policy.auto:
            self.policy = self.policy.with_budget(self.policy.budget)
        self.policy.validate(drafter.config.block_size)
        self.cache = drafter.new_context_cache()
        self.pending: torch.Tensor | None = None
        self.tree: DraftTree | None = None

    def add_context(self, features: torch.Tensor) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, None]:
        committed = self.cache.get_seq_length() + (0 if self.pending is None else self.pending.shape[1])
        if committed != input_ids.shape[1] - 1:
            raise ValueError(f"the drafter has context for {committed} positions but input_ids has "
                             f"{input_ids.shape[1]} tokens: add_context() the features of all tokens but the last")
        x0 = input_ids[:, -1]
        branches = find_lookup_branches(input_ids[0], self.policy.lookup)
        stop = self.policy.budget + max_extra_budget(branches, self.policy.lookup)
        pool = draft_pool(self.drafter, self.policy, x0, committed, self.pending, self.cache, stop)
        self.pending = None
        pool, extra = add_lookup_branches(pool, branches, self.policy.lookup)
        self.tree = pack_tree(pool, x0, self.policy.budget + extra, self.policy.depth)
        return torch.cat([input_ids, self.tree.tokens[:, 1:]], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """The tree policy is fixed per call; nothing to adapt."""
