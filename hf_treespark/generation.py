"""`generate()`'s TreeSpark loop, its output type, and a `CandidateGenerator` for custom loops.

`treespark_decoding` has the signature of a transformers `custom_generate` callable: `generate()`
prepares the generation config, logits processors and stopping criteria, then calls it (see
`integration.py`). It prefills, then drives `engine.TreeSparkSession` one round at a time
(draft, verify in one target forward, accept, commit), and does what `generate` promises around
that: stopping criteria inside a round, streaming, scores, per-round records.
"""

from __future__ import annotations

import numbers
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batch import BatchedSession
from .budget import BatchBudget, auto_budget, gate_threshold
from .datastore import DATASTORE_FILE, HEADER_TOKENS, Datastore, DatastoreError
from .engine import Round, TreeSparkSession, draft_pool
from .lookup import add_lookup_branches, find_lookup_branches, max_extra_budget
from .tree import DraftTree, TreePolicy, pack_tree


@dataclass
class RoundRecord:
    """What happened in one drafting round.

    tree_size: non-root nodes verified. num_accepted: accepted non-root nodes, of which
    `lookup_accepted` only a lookup branch had proposed.
    accepted_path: node indices (into the packed tree, root excluded) of the accepted path.
    `datastore_accepted` only the datastore had proposed.
    committed: tokens committed this round (accepted tokens, then the bonus unless the round
    stopped first). tree: the packed tree (`tokens`, `parents`, `depths`, `scores`, root first)
    and `candidates` (every proposed node with `packed` flags), when requested.
    """

    tree_size: int
    num_accepted: int
    accepted_path: list[int]
    committed: list[int]
    tree: dict | None = None
    lookup_accepted: int = 0
    datastore_accepted: int = 0

    @property
    def acceptance_length(self) -> int:
        return len(self.committed)

    @classmethod
    def of(cls, rnd: Round, committed: list[int], keep_tree: bool = False) -> RoundRecord:
        """The record of an engine round whose `committed` tokens (possibly cut by a stop) were kept."""
        accepted = min(rnd.num_accepted, len(committed))
        return cls(tree_size=rnd.tree.num_nodes, num_accepted=accepted,
                   accepted_path=rnd.acceptance.path[0, 1:accepted + 1].tolist(), committed=committed,
                   tree=tree_record_dict(rnd.tree) if keep_tree else None,
                   lookup_accepted=rnd.lookup_accepted(accepted), datastore_accepted=rnd.datastore_accepted(accepted))


@dataclass
class TreeSparkGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus per-round records.

    rounds: one `RoundRecord` per drafting round.
    acceptance_length: mean tokens committed per round (accepted nodes + bonus; SPEC section 3).
    acceptance_by_depth: fraction of rounds whose accepted path reached depth `d`, for `d = 1..D`.
    tree_budget: the budget `N` used (the one chosen when `tree_budget="auto"`).
    """

    rounds: list[RoundRecord] | None = None
    acceptance_length: float | None = None
    acceptance_by_depth: list[float] | None = None
    tree_budget: int | None = None


def acceptance_stats(rounds: list[RoundRecord], depth: int) -> tuple[float, list[float]]:
    """Mean acceptance length and per-depth acceptance rate over `rounds`."""
    if not rounds:
        return 0.0, [0.0] * depth
    mean = sum(r.acceptance_length for r in rounds) / len(rounds)
    by_depth = [sum(r.num_accepted >= d for r in rounds) / len(rounds) for d in range(1, depth + 1)]
    return mean, by_depth


def resolve_policy(drafter, tree_budget=None, tree_topk=None, tree_depth=None, tree_frontier=None,
                   tree_chain=False, tree_lookup=None) -> TreePolicy:
    """The drafter config's tree policy, overridden by the per-call knobs (`TreePolicy.from_config`)."""
    return TreePolicy.from_config(drafter.config, budget=tree_budget, topk=tree_topk, depth=tree_depth,
                                  frontier=tree_frontier, chain=tree_chain, lookup=tree_lookup,
                                  vocab_size=drafter.draft_vocab_size)


def resolve_gate(model, drafter, policy: TreePolicy, tree_gate="auto") -> float:
    """The drafter gate's threshold for this call (`lookup.DrafterGate`): `"auto"` (this device's,
    `budget.gate_threshold`) or a number >= 0 (0: the drafter drafts every round that is not lookup-only).
    Raises `ValueError` for anything else."""
    if isinstance(tree_gate, str) and tree_gate == "auto":
        return gate_threshold(model, drafter, policy) if policy.lookup else 0.0
    threshold = real_scalar(tree_gate)
    if threshold is None or not threshold >= 0:
        raise ValueError(f'tree_gate={tree_gate!r} is invalid: use "auto" or a number >= 0 (drafted tokens a '
                         "drafter round must get accepted on average; 0 = always draft)")
    return threshold


def real_scalar(value) -> float | None:
    """`value` as a float when it is one real number (Python, numpy, or a 0-d torch tensor), else None: bools,
    strings, complex numbers and tensors with dimensions are not."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


_loaded_datastores: dict[tuple[str, float], Datastore] = {}  # by path and modification time


def resolve_datastore(drafter, tree_datastore=None) -> Datastore | None:
    """The datastore whose branches join this call's rounds (`datastore.py`), or None.

    `None`: the drafter's own (`drafter.datastore`, loaded with it) when its config's `tree_datastore` is on;
    `False`: none; `True`: the drafter's own, which must exist; a `Datastore`, or the directory or file of one
    (loaded once per process). Raises `ValueError` naming the knob for anything else and for a datastore built
    for another vocabulary (a `DatastoreError`, naming the file, for a damaged one)."""
    own = getattr(drafter, "datastore", None)
    vocab = drafter.config.target_vocab_size
    if tree_datastore is None:
        return own if getattr(drafter.config, "tree_datastore", True) else None
    if isinstance(tree_datastore, (bool, np.bool_)):
        if tree_datastore and own is None:
            raise ValueError("tree_datastore=True, but this drafter carries no datastore: build one with `treespark "
                             "datastore --data FILES --output DRAFTER_DIR`, or pass a Datastore or its directory")
        return own if tree_datastore else None
    if isinstance(tree_datastore, (str, os.PathLike)):
        path = Path(tree_datastore)
        path = path / DATASTORE_FILE if path.is_dir() else path
        key = (str(path.resolve()), path.stat().st_mtime if path.is_file() else 0.0)
        if key not in _loaded_datastores:
            try:
                _loaded_datastores[key] = Datastore.load(path, vocab_size=vocab)
            except DatastoreError as err:
                raise DatastoreError(f"tree_datastore={os.fspath(tree_datastore)!r}: {err}") from None
        return _loaded_datastores[key]
    if isinstance(tree_datastore, Datastore):
        if tree_datastore.vocab_size != vocab:
            raise ValueError(f"tree_datastore: this datastore was built for a vocabulary of {tree_datastore.vocab_size}"
                             f" ids, the drafter's target has {vocab}: build one from this target's outputs")
        return tree_datastore
    raise ValueError(f"tree_datastore={tree_datastore!r:.60} is invalid: use True/False, a Datastore, or the "
                     "directory of one")


def _first_stop(stopping_criteria: StoppingCriteriaList, ids: torch.Tensor, num_new: int) -> int | None:
    """How many of the `num_new` last tokens plain decoding would have produced before stopping."""
    start = ids.shape[1] - num_new
    for j in range(1, num_new + 1):
        if stopping_criteria(ids[:, : start + j], None).any():
            return j
    return None


def check_supported(model, drafter, input_ids: torch.Tensor, generation_config: GenerationConfig) -> None:
    """Refuse what TreeSpark decoding cannot do, saying what to do instead."""
    if getattr(getattr(drafter, "config", None), "model_type", None) != "treespark":
        raise TypeError(f"expected a TreeSpark drafter, got {type(drafter).__name__}")
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in impl:
        raise ValueError(f"TreeSpark verification needs a 4D tree attention mask, which attn_implementation="
                         f"{impl!r} cannot take. Load the target with attn_implementation='sdpa' or 'eager'.")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("TreeSpark decoding does not do beam search: drop num_beams or the assistant_model.")
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError("TreeSpark decoding returns one sequence per prompt: drop num_return_sequences or "
                         "the assistant_model.")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("TreeSpark decoding supports decoder-only targets.")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {list(input_ids.shape)}): TreeSpark decoding needs at least one "
                         "prompt token per row.")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise ValueError(f"input_ids has dtype {input_ids.dtype}: token ids must be integers (torch.long), as the "
                         "tokenizer returns them.")
    vocab = model.get_input_embeddings().weight.shape[0]
    top = int(input_ids.max())
    if top >= vocab or int(input_ids.min()) < 0:
        bad = top if top >= vocab else int(input_ids.min())
        raise ValueError(f"input_ids holds token id {bad}, outside the target's vocabulary [0, {vocab}): "
                         "tokenize with the target's own tokenizer.")


def check_arguments(generation_config: GenerationConfig, model_kwargs: dict) -> None:
    """Refuse, by name, what plain `generate` takes but TreeSpark decoding would not read or return."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("TreeSpark decoding does not take inputs_embeds: the drafter and its lookup branches draft "
                         "from token ids. Pass input_ids (the tokenized prompt) instead, or drop the assistant_model.")
    outputs = {"output_attentions": "attentions", "output_hidden_states": "hidden states"}
    asked = [flag for flag in outputs if getattr(generation_config, flag, None)]
    if asked and generation_config.return_dict_in_generate:
        flags = ", ".join(f"{flag}=True" for flag in asked)
        raise ValueError(f"TreeSpark decoding does not return {' or '.join(outputs[f] for f in asked)} ({flags}): its "
                         f"target forwards run over drafted trees, not the committed text. Drop it; for those tensors, "
                         f"run the target once over out.sequences with {flags}.")


def check_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                generation_config: GenerationConfig, streamer) -> torch.Tensor:
    """The batch's attention mask (`[B, T]`, long), after refusing what batched decoding cannot take: a mask of
    another shape or with values other than 0 and 1, right padding, a row of padding only; streamers and scores
    (per-step tensors of the whole batch, which rows that advance by several tokens a round do not have)."""
    rows, length = input_ids.shape
    if streamer is not None:
        raise ValueError(f"streamer: streaming needs batch size 1 (got {rows} rows), as transformers' streamers do. "
                         "Drop the streamer, or generate one prompt at a time to stream it.")
    asked = [flag for flag in ("output_scores", "output_logits") if getattr(generation_config, flag, False)]
    if asked:
        raise ValueError(f"{', '.join(f'{flag}=True' for flag in asked)} is supported at batch size 1 only (got "
                         f"{rows} rows): drop it, or generate one prompt at a time for per-step scores.")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (rows, length):
        shape = (list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                 else type(attention_mask).__name__)
        raise ValueError(f"attention_mask has shape {shape} but input_ids has [{rows}, {length}]: pass the mask the "
                         "tokenizer returned with these ids.")
    mask = attention_mask.long()
    if not bool(((mask == 0) | (mask == 1)).all()) or (attention_mask.dtype.is_floating_point
                                                       and not torch.equal(attention_mask.float(), mask.float())):
        raise ValueError("attention_mask holds values other than 0 and 1: pass the tokenizer's mask (1 = token, "
                         "0 = padding).")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        bad = int((mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"row {bad} of the batch is right-padded (attention_mask zeros after tokens): TreeSpark "
                         "decoding, like plain decoder-only generation, needs left padding; load the tokenizer with "
                         "padding_side='left'.")
    if not bool(mask[:, -1].all()):
        bad = int((mask[:, -1] == 0).nonzero()[0, 0])
        raise ValueError(f"row {bad} of the batch is all padding (attention_mask is 0 everywhere): give every row at "
                         "least one prompt token.")
    return mask


def _left_padding(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> int:
    """Number of left-padding positions (batch size 1); other padding is refused."""
    if attention_mask is None or bool(attention_mask.all()):
        return 0
    keep = attention_mask[0].bool()
    num_pad = int(keep.nonzero()[0, 0]) if keep.any() else input_ids.shape[1]
    if not bool(keep[num_pad:].all()):
        raise ValueError("TreeSpark decoding supports left padding only (attention_mask zeros at the start).")
    return num_pad


def _empty_cache(model_kwargs: dict) -> DynamicCache | None:
    """The caller's `DynamicCache` if it passed one (it must be empty), else None (the session makes one)."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if not isinstance(cache, DynamicCache):
        return None
    if cache.get_seq_length() > 0:
        raise ValueError("TreeSpark decoding starts from an empty cache; do not pass a filled cache.")
    return cache


def _pick(processed: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The next token `[1, 1]` from processed scores `[1, V]`: a sample, or the argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1)
    return processed.argmax(dim=-1, keepdim=True)


def _auto_chooser(model, drafter, policy: TreePolicy):
    """For `tree_budget="auto"`: the budget, fixed now when it can be, else a chooser for the first round."""
    if not policy.auto:
        return policy, None
    chosen = auto_budget(model, drafter, policy)
    if chosen is not None:
        return policy.with_budget(chosen), None
    return policy, lambda pool_scores: auto_budget(model, drafter, policy, pool_scores)


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
    tree_record: bool = False,
    tree_timer=None,
    **model_kwargs,
):
    """The TreeSpark decoding loop (a transformers `custom_generate` callable).

    Returns `[1, prompt + new]` token ids, or a `TreeSparkGenerateOutput` with
    `return_dict_in_generate=True`; its `cache` (`past_key_values`) is the target's cache of every token but
    the last, as plain decoding returns it (left padding excluded). Attentions, hidden states and
    `inputs_embeds` are refused (`check_arguments`). `tree_record=True` stores each round's tree in its record;
    `tree_gate`: the drafter gate's threshold with lookup on (`resolve_gate`).
    `tree_timer` (an `engine.PhaseTimer`) sums the wall time of each round phase (`treespark bench --profile`).
    One target forward per round: nothing is measured here (`tree_budget="auto"` reads the latency
    that `hf_treespark.budget.calibrate_latency` stored, or falls back to a default budget).
    """
    drafter = treespark_drafter
    check_arguments(generation_config, model_kwargs)
    check_supported(model, drafter, input_ids, generation_config)
    policy = resolve_policy(drafter, tree_budget, tree_topk, tree_depth, tree_frontier, tree_chain, tree_lookup)
    datastore = resolve_datastore(drafter, tree_datastore)
    streamer = treespark_streamer
    if input_ids.shape[0] > 1:
        gate = None if isinstance(tree_gate, str) and tree_gate == "auto" else resolve_gate(model, drafter, policy,
                                                                                             tree_gate)
        return batched_decoding(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                                policy, gate, datastore, streamer, tree_record, tree_timer, model_kwargs)
    policy, choose_budget = _auto_chooser(model, drafter, policy)
    gate = resolve_gate(model, drafter, policy, tree_gate)
    want_scores = bool(generation_config.output_scores)
    want_logits = bool(generation_config.output_logits)
    do_sample = bool(generation_config.do_sample)

    # Left padding (batch size 1): the target sees the unpadded prompt; processors and stopping
    # criteria see the padded sequence, as in plain decoding.
    num_pad = _left_padding(model_kwargs.get("attention_mask"), input_ids)
    session = TreeSparkSession(model, drafter, policy, logits_processor=logits_processor, do_sample=do_sample,
                               keep_scores=want_scores or want_logits, cache=_empty_cache(model_kwargs),
                               choose_budget=choose_budget, timer=tree_timer, gate=gate, datastore=datastore)

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
    done = _first_stop(stopping_criteria, ids, 1) is not None

    rounds: list[RoundRecord] = []
    while not done:
        with session.timer("round") if session.timer is not None else nullcontext():
            rnd = session.step(ids)
            new_tokens = rnd.tokens
            ids = torch.cat([ids, new_tokens], dim=1)
            stop = _first_stop(stopping_criteria, ids, new_tokens.shape[1])
            if stop is not None:
                ids = ids[:, : ids.shape[1] - new_tokens.shape[1] + stop]
                new_tokens = new_tokens[:, :stop]
                done = True
            committed = new_tokens.shape[1]
            if want_scores:
                scores.extend(rnd.acceptance.scores[:committed])
            if want_logits:
                raw_logits.extend(rnd.acceptance.raw_logits[:committed])
            if streamer is not None:
                streamer.put(new_tokens.cpu())
            rounds.append(RoundRecord.of(rnd, new_tokens[0].tolist(), tree_record))

    if streamer is not None:
        streamer.end()
    if datastore is not None:  # growing with use, where the datastore keeps added outputs (`grow_tokens`)
        datastore.add(ids[0, max(0, input_ids.shape[1] - HEADER_TOKENS):].tolist())
    # The target's cache of the committed text (left padding excluded), as plain decoding leaves it: every
    # token but the last. A round cut short by a stop had cached entries past it.
    session.cache.crop(ids.shape[1] - 1 - num_pad - session.cache.get_seq_length())  # (minus the entries to drop)
    if not generation_config.return_dict_in_generate:
        return ids
    mean, by_depth = acceptance_stats(rounds, session.policy.depth)
    return TreeSparkGenerateOutput(
        sequences=ids,
        scores=tuple(scores) if want_scores else None,
        logits=tuple(raw_logits) if want_logits else None,
        rounds=rounds,
        acceptance_length=mean,
        acceptance_by_depth=by_depth,
        tree_budget=session.policy.budget,
        cache=session.cache if generation_config.use_cache else None,
    )


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
                     gate: float | None, datastore, streamer, tree_record: bool, tree_timer, model_kwargs: dict):
    """`treespark_decoding` for a left-padded batch of `B > 1` rows (`batch.BatchedSession`).

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

    session = BatchedSession(model, drafter, policy, rows, logits_processor=logits_processor,
                             do_sample=bool(generation_config.do_sample), cache=_empty_cache(model_kwargs),
                             timer=tree_timer, gate=gate if gate is not None else 0.0, datastore=datastore,
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
    active = [i for i in range(rows) if _first_stop(stopping_criteria, sequences[i], 1) is None]
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
                stop = _first_stop(stopping_criteria, sequences[i], new_tokens.shape[1])
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


def _finish_plain(model, session: BatchedSession, active: list[int], sequences: list[torch.Tensor], pads: list[int],
                  records: list[list[RoundRecord]], pad: int, stopping_criteria: StoppingCriteriaList,
                  logits_processor: LogitsProcessorList, generation_config: GenerationConfig) -> None:
    """The unfinished rows `active` decoded to their ends by transformers' own loop, continuing from the session's
    cache (gathered into an ordinary left-padded cache, `BatchedSession.plain_inputs`): what "auto" does once no
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
        records[i].extend(RoundRecord(tree_size=0, num_accepted=0, accepted_path=[], committed=[token])
                          for token in new_tokens[0].tolist())


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


def tree_record_dict(tree: DraftTree) -> dict:
    """Plain lists describing a packed tree and its candidate pool (batch row 0)."""
    cand = tree.candidates
    no_lookup = [False] * tree.tokens.shape[1]
    return {
        "lookup": tree.lookup[0].tolist() if tree.lookup is not None else no_lookup,
        "retrieved": tree.retrieved[0].tolist() if tree.retrieved is not None else no_lookup,
        "tokens": tree.tokens[0].tolist(),
        "parents": tree.parents[0].tolist(),
        "depths": tree.depths[0].tolist(),
        "scores": tree.scores[0].tolist(),
        "candidates": {
            "tokens": cand.tokens[0].tolist(),
            "parents": cand.parents[0].tolist(),
            "depths": cand.depths[0].tolist(),
            "scores": cand.scores[0].tolist(),
            "packed": cand.packed[0].tolist(),
            "node_index": cand.node_index[0].tolist(),
            "lookup": cand.lookup[0].tolist() if cand.lookup is not None else [False] * cand.tokens.shape[1],
            "retrieved": (cand.retrieved[0].tolist() if cand.retrieved is not None
                          else [False] * cand.tokens.shape[1]),
        },
    }


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
