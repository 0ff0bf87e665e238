"""`generate()`'s TreeSpark loop and a `CandidateGenerator` for custom loops.

`treespark_decoding` has the signature of a transformers `custom_generate` callable: `generate()`
prepares the generation config, logits processors and stopping criteria, then calls it (see
`integration.py`). It prefills, then drives `session.DecodingSession` (one row) a round at a time
(draft, verify in one target forward, accept, commit), and does what `generate` promises around
that: stopping criteria inside a round, streaming, scores, per-round records.

Around it, one module per idea: what a call accepts (`generation_checks.py`), what it returns
(`generation_output.py`), and the loop for a batch of more than one row (`generation_batch.py`).
Their public names are importable from here too.
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
from .budget import auto_budget
from .call_guard import hand_off, resolve_guard
from .engine import draft_pool
from .generation_batch import batched_decoding
from .generation_checks import (
    check_arguments,
    check_supported,
    empty_cache,
    left_padding,
    resolve_datastore,
    resolve_gate,
    resolve_policy,
    resolve_sources,
)
from .generation_output import RoundRecord, TreeSparkGenerateOutput, acceptance_stats, first_stop
from .session import DecodingSession


def _pick(processed: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The next token `[1, 1]` from processed scores `[1, V]`: a sample, or the argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1)
    return processed.argmax(dim=-1, keepdim=True)


def _committed(rnd, ids: torch.Tensor, stopping_criteria: StoppingCriteriaList):
    """`(ids with the round's tokens, the tokens committed, whether the call is done)`: a stopping criterion met
    inside the round cuts its tokens there."""
    new_tokens = rnd.tokens
    ids = torch.cat([ids, new_tokens], dim=1)
    stop = first_stop(stopping_criteria, ids, new_tokens.shape[1])
    if stop is None:
        return ids, new_tokens, False
    return ids[:, : ids.shape[1] - new_tokens.shape[1] + stop], new_tokens[:, :stop], True


def _auto_chooser(model, drafter, policy: TreePolicy):
    """For `tree_budget="auto"`: the budget, fixed now when it can be, else a chooser for the first round."""
    if not policy.auto:
        return policy, None
    chosen = auto_budget(model, drafter, policy)
    if chosen is not None:
        return policy.with_budget(chosen), None
    return policy, lambda pool_scores: auto_budget(model, drafter, policy, pool_scores[0])  # [1, C]: one row


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
    """The TreeSpark decoding loop (a transformers `custom_generate` callable).

    Returns `[1, prompt + new]` token ids, or a `TreeSparkGenerateOutput` with
    `return_dict_in_generate=True`; its `cache` (`past_key_values`) is the target's cache of every token but
    the last, as plain decoding returns it (left padding excluded). Attentions, hidden states and
    `inputs_embeds` are refused (`check_arguments`). `tree_record=True` stores each round's tree in its record;
    `tree_gate`: the drafter gate's threshold with lookup on (`resolve_gate`).
    `tree_timer` (an `engine.PhaseTimer`) sums the wall time of each round phase (`treespark bench --profile`).
    `tree_guard` (batch size 1, on by default): a call whose rounds commit tokens more slowly than plain steps, judged
    twice in a row against root-only probe rounds, goes on in transformers' own loop (`call_guard.py`; not with
    scores, logits or padding); False drafts to the end. One target forward per round: no latency is measured
    here (`tree_budget="auto"` reads the latency `hf_treespark.calibration.measure.calibrate_latency` stored, or falls
    back to a default budget).
    """
    drafter = treespark_drafter
    check_arguments(generation_config, model_kwargs)
    check_supported(model, drafter, input_ids, generation_config)
    policy = resolve_policy(drafter, tree_budget, tree_topk, tree_depth, tree_frontier, tree_chain, tree_lookup)
    datastore = resolve_datastore(drafter, tree_datastore)
    sources = build_sources(drafter, {"datastore": datastore, **resolve_sources(tree_sources)})
    streamer = treespark_streamer
    if input_ids.shape[0] > 1:
        gate = None if isinstance(tree_gate, str) and tree_gate == "auto" else resolve_gate(model, drafter, policy,
                                                                                             tree_gate)
        return batched_decoding(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                                policy, gate, datastore, sources, streamer, tree_record, tree_timer, model_kwargs)
    policy, choose_budget = _auto_chooser(model, drafter, policy)
    gate = resolve_gate(model, drafter, policy, tree_gate)
    want_scores = bool(generation_config.output_scores)
    want_logits = bool(generation_config.output_logits)
    do_sample = bool(generation_config.do_sample)

    # Left padding (batch size 1): the target sees the unpadded prompt; processors and stopping
    # criteria see the padded sequence, as in plain decoding.
    num_pad = left_padding(model_kwargs.get("attention_mask"), input_ids)
    session = DecodingSession(model, drafter, policy, logits_processor=logits_processor, do_sample=do_sample,
                              keep_scores=want_scores or want_logits, cache=empty_cache(model_kwargs),
                              choose_budget=choose_budget, timer=tree_timer, gate=gate, sources=sources)

    if streamer is not None:
        streamer.put(input_ids.cpu())
    # Prefill: the first token comes from the prompt's forward, as in plain decoding.
    row = session.prefill(input_ids[:, num_pad:]).float()
    processed = logits_processor(input_ids, row) if len(logits_processor) else row
    first = _pick(processed, do_sample)
    scores = [processed] if want_scores else []
    raw_logits = [row] if want_logits else []
    ids = torch.cat([input_ids, first], dim=1)
    if streamer is not None:
        streamer.put(first.cpu())
    done = first_stop(stopping_criteria, ids, 1) is not None

    rounds: list[RoundRecord] = []
    guard = resolve_guard(tree_guard, guardable=not (want_scores or want_logits) and num_pad == 0)
    handed_off = False
    while not done:
        if guard is not None and guard.should_hand_off:  # slower than plain steps: transformers' loop from here
            start = ids.shape[1]
            ids = hand_off(model, session, ids, logits_processor, stopping_criteria, generation_config, streamer)
            rounds.extend(RoundRecord.plain_step(token) for token in ids[0, start:].tolist())
            handed_off = True
            break
        probe = guard is not None and guard.probing  # the root alone: a plain step, its forward timed
        began = time.perf_counter()
        with session.timer("round") if session.timer is not None else nullcontext():
            rnd = session.step([ids[0, num_pad:]], [ids], probe)[0]
            ids, new_tokens, done = _committed(rnd, ids, stopping_criteria)
            if want_scores:
                scores.extend(rnd.acceptance.scores[:new_tokens.shape[1]])
            if want_logits:
                raw_logits.extend(rnd.acceptance.raw_logits[:new_tokens.shape[1]])
            if streamer is not None:
                streamer.put(new_tokens.cpu())
        seconds = time.perf_counter() - began
        rounds.append(RoundRecord.of(rnd, new_tokens[0].tolist(), tree_record, seconds))
        if guard is not None:
            guard.observe(rnd.verify_seconds if probe else seconds, new_tokens.shape[1], probe, rnd.verify_seconds)

    if streamer is not None and not handed_off:  # transformers' loop ended the stream it took over
        streamer.end()
    if datastore is not None:  # growing with use, where the datastore keeps added outputs (`grow_tokens`)
        datastore.add(ids[0, max(0, input_ids.shape[1] - HEADER_TOKENS):].tolist())
    # The target's cache of the committed text (left padding excluded), as plain decoding leaves it: every
    # token but the last. A round cut short by a stop had cached entries past it.
    session.cache.crop(ids.shape[1] - 1 - num_pad - session.cache.get_seq_length())  # (minus the entries to drop)
    if not generation_config.return_dict_in_generate:
        return ids
    return _output(ids, scores if want_scores else None, raw_logits if want_logits else None, rounds, session,
                   generation_config.use_cache)


def _output(ids, scores, raw_logits, rounds, session, use_cache: bool) -> TreeSparkGenerateOutput:
    """`return_dict_in_generate`'s output of a batch-1 call (`scores`/`raw_logits` None where not asked for)."""
    mean, by_depth = acceptance_stats(rounds, session.policy.depth)
    return TreeSparkGenerateOutput(sequences=ids, scores=None if scores is None else tuple(scores),
                                   logits=None if raw_logits is None else tuple(raw_logits), rounds=rounds,
                                   acceptance_length=mean, acceptance_by_depth=by_depth,
                                   tree_budget=session.policy.budget, cache=session.cache if use_cache else None)


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
