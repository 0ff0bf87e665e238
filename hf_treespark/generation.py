"""The TreeSpark decoding loop, its output type, and a `CandidateGenerator` for custom loops.

Per round (SPEC sections 2-3):
  1. one drafter pass over `[x0, MASK * (B - 1)]` with the newly committed target features,
  2. the tree policy (`tree.build_tree`) packs `N` candidate nodes,
  3. ONE target forward over `[x0] + nodes` with a tree mask and depth positions,
  4. the acceptance walk picks the longest path the target agrees with, plus a bonus token,
  5. the target cache keeps the root and accepted entries; their hidden states extend the
     drafter's context; the bonus is the next round's `x0`.

`treespark_decoding` has the signature of a transformers `custom_generate` callable: `generate()`
prepares the generation config, logits processors and stopping criteria, then calls it
(see `integration.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .budget import CANDIDATE_BUDGETS, auto_budget, is_auto
from .tree import DraftTree, TreePolicy, build_tree
from .verify import cache_kwarg, commit_cache, greedy_accept, processed_accept, tree_attention_mask, tree_position_ids


@dataclass
class RoundRecord:
    """What happened in one drafting round.

    tree_size: non-root nodes verified. num_accepted: accepted non-root nodes.
    accepted_path: node indices (into the packed tree, root excluded) of the accepted path.
    committed: tokens committed this round (accepted tokens, then the bonus unless the round
    stopped first). tree: the packed tree (`tokens`, `parents`, `depths`, `scores`, root first)
    and `candidates` (every proposed node with `packed` flags), when requested.
    """

    tree_size: int
    num_accepted: int
    accepted_path: list[int]
    committed: list[int]
    tree: dict | None = None

    @property
    def acceptance_length(self) -> int:
        return len(self.committed)


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
                   tree_chain=False) -> TreePolicy:
    """The drafter config's tree policy, overridden by the per-call knobs."""
    cfg = drafter.config
    depth = cfg.block_size if tree_depth is None else tree_depth
    if tree_chain:
        policy = TreePolicy.chain(depth)
    else:
        budget = cfg.tree_budget if tree_budget is None else tree_budget
        policy = TreePolicy(
            topk=cfg.tree_topk if tree_topk is None else tree_topk,
            frontier=cfg.tree_frontier if tree_frontier is None else tree_frontier,
            budget=1 if is_auto(budget) else budget,
            depth=depth,
        )
        if is_auto(budget):  # the largest candidate pool; the first round picks the budget
            pool = replace(policy, budget=max(CANDIDATE_BUDGETS))
            policy = replace(pool, budget=min(pool.budget, pool.num_candidates))
    policy.validate(cfg.block_size)
    return policy


def wants_auto_budget(drafter, tree_budget=None, tree_chain=False) -> bool:
    return not tree_chain and is_auto(drafter.config.tree_budget if tree_budget is None else tree_budget)


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
    if input_ids.shape[0] != 1:
        raise ValueError(f"TreeSpark decoding supports batch size 1 for now (got {input_ids.shape[0]}). "
                         "Call generate once per prompt.")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("TreeSpark decoding supports decoder-only targets.")


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
    tree_record: bool = False,
    **model_kwargs,
):
    """The TreeSpark decoding loop (a transformers `custom_generate` callable).

    Returns `[1, prompt + new]` token ids, or a `TreeSparkGenerateOutput` with
    `return_dict_in_generate=True`. `tree_record=True` stores each round's tree in its record.
    """
    drafter = treespark_drafter
    check_supported(model, drafter, input_ids, generation_config)
    policy = resolve_policy(drafter, tree_budget, tree_topk, tree_depth, tree_frontier, tree_chain)
    choose_budget = wants_auto_budget(drafter, tree_budget, tree_chain)
    drafter.bind_target(model)
    streamer = treespark_streamer
    cache_kw = cache_kwarg(model)
    want_scores = bool(generation_config.output_scores)
    want_logits = bool(generation_config.output_logits)
    walk_processed = generation_config.do_sample or len(logits_processor) > 0 or want_scores or want_logits

    # Left padding (batch size 1): the target sees the unpadded prompt; processors and stopping
    # criteria see the padded sequence, as in plain decoding.
    num_pad = 0
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        keep = attention_mask[0].bool()
        num_pad = int(keep.nonzero()[0, 0]) if keep.any() else input_ids.shape[1]
        if not bool(keep[num_pad:].all()):
            raise ValueError("TreeSpark decoding supports left padding only (attention_mask zeros at the start).")

    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None or not isinstance(cache, DynamicCache):
        cache = DynamicCache(config=model.config)
    if cache.get_seq_length() > 0:
        raise ValueError("TreeSpark decoding starts from an empty cache; do not pass a filled cache.")
    hidden_ids = [i + 1 for i in drafter.config.target_layer_ids]

    def features_of(out) -> torch.Tensor:
        return torch.cat([out.hidden_states[i] for i in hidden_ids], dim=-1)

    if streamer is not None:
        streamer.put(input_ids.cpu())

    # Prefill: the first token comes from the prompt's forward, as in plain decoding.
    out = model(input_ids=input_ids[:, num_pad:], use_cache=True, output_hidden_states=hidden_ids, **{cache_kw: cache})
    new_features = features_of(out)
    scores, raw_logits = [], []
    row = out.logits[:, -1].float()
    processed = logits_processor(input_ids, row) if len(logits_processor) else row
    if generation_config.do_sample:
        first = torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1)
    else:
        first = processed.argmax(dim=-1, keepdim=True)
    if want_scores:
        scores.append(processed)
    if want_logits:
        raw_logits.append(row)
    ids = torch.cat([input_ids, first], dim=1)
    if streamer is not None:
        streamer.put(first.cpu())
    done = _first_stop(stopping_criteria, ids, 1) is not None

    drafter_cache = drafter.new_context_cache()
    rounds: list[RoundRecord] = []
    while not done:
        past_len = ids.shape[1] - 1 - num_pad  # x0 = ids[:, -1] is not in the target cache yet
        x0 = ids[:, -1]
        draft = drafter(
            anchor_ids=x0[:, None],
            anchor_positions=torch.full_like(x0[:, None], past_len),
            target_features=new_features,
            context_cache=drafter_cache,
        )
        tree = build_tree(draft.depth_logits, drafter.markov_bias, x0, policy)
        if choose_budget:  # tree_budget="auto": decided once, from the largest tree's scores if need be
            policy = replace(policy, budget=auto_budget(model, drafter, policy, tree.scores[0, 1:]))
            tree = build_tree(draft.depth_logits, drafter.markov_bias, x0, policy)
            choose_budget = False

        out = model(
            input_ids=tree.tokens,
            position_ids=tree_position_ids(tree, past_len),
            attention_mask=tree_attention_mask(tree, past_len, model.dtype),
            use_cache=True,
            output_hidden_states=hidden_ids,
            **{cache_kw: cache},
        )
        if walk_processed:
            acc = processed_accept(tree, out.logits, ids, logits_processor, bool(generation_config.do_sample),
                                   keep_scores=want_scores or want_logits)
        else:
            acc = greedy_accept(tree, out.logits)
        num_accepted = int(acc.num_accepted[0])
        keep = acc.path[:, : num_accepted + 1]
        commit_cache(cache, past_len, keep)
        features = features_of(out)  # root and accepted nodes attended to their ancestors only: exact
        new_features = features.gather(1, keep[:, :, None].expand(-1, -1, features.shape[-1]))

        new_tokens = acc.tokens[:, : num_accepted + 1]
        ids = torch.cat([ids, new_tokens], dim=1)
        stop = _first_stop(stopping_criteria, ids, num_accepted + 1)
        if stop is not None:
            ids = ids[:, : ids.shape[1] - (num_accepted + 1) + stop]
            new_tokens = new_tokens[:, :stop]
            done = True
        committed = new_tokens.shape[1]
        if want_scores:
            scores.extend(acc.scores[:committed])
        if want_logits:
            raw_logits.extend(acc.raw_logits[:committed])
        if streamer is not None:
            streamer.put(new_tokens[0].cpu())
        rounds.append(RoundRecord(
            tree_size=tree.num_nodes,
            num_accepted=min(num_accepted, committed),
            accepted_path=keep[0, 1:committed + 1].tolist(),
            committed=new_tokens[0].tolist(),
            tree=tree_record_dict(tree) if tree_record else None,
        ))

    if streamer is not None:
        streamer.end()
    sequences = ids
    if not generation_config.return_dict_in_generate:
        return sequences
    mean, by_depth = acceptance_stats(rounds, policy.depth)
    return TreeSparkGenerateOutput(
        sequences=sequences,
        scores=tuple(scores) if want_scores else None,
        logits=tuple(raw_logits) if want_logits else None,
        rounds=rounds,
        acceptance_length=mean,
        acceptance_by_depth=by_depth,
        tree_budget=policy.budget,
    )


def tree_record_dict(tree: DraftTree) -> dict:
    """Plain lists describing a packed tree and its candidate pool (batch row 0)."""
    cand = tree.candidates
    return {
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
        },
    }


class TreeSparkCandidateGenerator(CandidateGenerator):
    """Drafts a packed TreeSpark tree, for people who compose their own verification loops.

    `get_candidates(input_ids)` returns `(input_ids + packed node tokens, None)`: the tree's `N`
    nodes in order (parents first). `self.tree` holds the `DraftTree` (parents, depths,
    ancestor matrix) from which `tree_attention_mask` and `tree_position_ids` build the verify
    inputs. Feed back the target features of committed positions with `add_context(features)`
    (`[b, s, n_layers * d_target]`, concatenated over `drafter.config.target_layer_ids`, HF index
    `l + 1`) before each call: the drafter is conditioned on them.
    """

    def __init__(self, drafter, target, policy: TreePolicy | None = None):
        drafter.bind_target(target)
        self.drafter = drafter
        self.policy = policy or resolve_policy(drafter)
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
        draft = self.drafter(anchor_ids=x0[:, None], anchor_positions=torch.full_like(x0[:, None], committed),
                             target_features=self.pending, context_cache=self.cache)
        self.pending = None
        self.tree = build_tree(draft.depth_logits, self.drafter.markov_bias, x0, self.policy)
        return torch.cat([input_ids, self.tree.tokens[:, 1:]], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """The tree policy is fixed per call; nothing to adapt."""
