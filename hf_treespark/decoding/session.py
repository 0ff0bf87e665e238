"""The decoding session: `B >= 1` sequences, one drafter pass and one target forward per round for all rows.

Batch 1 is a batch of one row. A round, for the unfinished rows:

    plan     each row plans its own tree (`engine.RowPlanner`: lookup branches, lookup-only rounds, the
             drafter gate, datastore branches)
    draft    ONE drafter pass for every row, when at least one row's plan needs the drafter (the others'
             pending target features join the drafter's context all the same); its candidate pool is
             expanded for those rows together and each row packs its own tree
    verify   ONE target forward over `[B, 1 + N]` tokens, `N` the largest tree of the round (`core.tree.stack_trees`:
             a smaller tree is padded with nodes that see only the prefix and themselves and are never walked),
             a 4D mask per row over its own real cache entries and its tree's ancestry
             (`core.verify.tree_attention_mask`), positions `row's committed tokens + depth`
    accept   each row walks its own tree (`verify.greedy_accept`, or the per-node walk with processors or sampling)
    commit   each row keeps its root and accepted entries (`RaggedCache.commit`); their features join its pending
             drafter context; the bonus is the row's next `x0`

The cache is ragged: rows accept different numbers of tokens, so `RaggedCache` keeps which entries of each row are
real (see there). One row never has padding, and its cache is an ordinary cache (`valid` None), its mask the
prefix whole plus the tree.

`generation.treespark_decoding` drives the session, for one row or many, as the round controller
(`controller.RoundController`) decides.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import replace

import torch
from transformers import DynamicCache, LogitsProcessorList

from ..core.tree import Candidates, DraftTree, TreePolicy, stack_trees
from ..core.verify import (
    cache_kwarg,
    commit_cache,
    greedy_accept,
    grouped_attention,
    processed_accept,
    tree_attention_mask,
    tree_position_ids,
)
from ..drafter.modeling import TreeSparkDrafterOutput
from ..sources.lookup import DrafterGate
from .engine import (
    PhaseTimer,
    Round,
    RowPlanner,
    drafted_rows,
    expand_pool,
    feature_indices,
    last_logits_only,
    select_features,
    synchronised_clock,
)

COMPACT_MIN = 64  # entries below which a cache is never compacted
EXTRA_NODES = 0  # nodes a batch row's tree may hold beyond the budget (lookup and datastore branches included)


class SharedGate(DrafterGate):
    """The drafter gate of a session, shared by its rows (one drafter pass serves every row): every row's drafter
    round feeds its running mean, and its idle count is in rounds of the session (a round in which any row went
    without the drafter), not of rows. With one row it is the row's own gate."""

    def __init__(self, threshold: float):
        super().__init__(threshold)
        self.counted = False

    def new_round(self) -> None:
        self.counted = False

    def skipped(self) -> None:
        if not self.counted:
            self.counted = True
            super().skipped()


def left_padded(rows: list[torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Token-id rows `[T_i]` as one left-padded batch (`input_ids`, `attention_mask`), as a batched pipeline
    makes."""
    width = max(row.shape[0] for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[0]:], mask[i, width - row.shape[0]:] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def pool_row(pool: Candidates, row: int) -> Candidates:
    """Row `row` of a batched candidate pool, as a pool of batch size 1."""
    if pool.tokens.shape[0] == 1:
        return pool
    one = slice(row, row + 1)
    return replace(pool, tokens=pool.tokens[one], parents=pool.parents[one], depths=pool.depths[one],
                   scores=pool.scores[one], expansions=[tuple(t[one] for t in step) for step in pool.expansions])


def logical_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each entry's position among its row's real entries (`mask [b, L]`, 1 real, 0 padding; padding at 0), as
    plain `generate` numbers a left-padded batch."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def right_aligned(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(index [b, W], valid [b, W])`: each row's valid entries (`valid [b, L]` bool), in order, at the right end of
    `W = max count` columns, padding (index of an invalid or any entry, not valid) on the left."""
    counts = valid.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices  # invalid first, then valid, in order
    index = order[:, valid.shape[1] - width:]
    kept = torch.arange(width, device=valid.device)[None, :] >= (width - counts)[:, None]
    return index, kept


def _mostly_padding(valid: torch.Tensor) -> bool:
    return valid.shape[1] >= COMPACT_MIN and 2 * int(valid.sum()) < valid.numel()


class RaggedCache:
    """The target's `DynamicCache` for rows of different lengths, and the drafter's context cache beside it.

    The cache has one physical length `L` for all rows; `valid` (`[B, L]` bool, or None while every entry is real,
    as for one row) marks each row's real entries and `lengths` (`[B]`) counts them: each row's next position.
    A round's verified chunk of `1 + N` entries is compacted in place to its first `M = max(accepted + 1)` entries
    (each row's kept entries first, in order; `verify.commit_cache`), and `valid` records how many of the `M` each
    row kept; rejected and padding entries stay, masked. Positions are logical (a row's committed tokens before
    it), never physical, so rotary embeddings are exact whatever the layout. When more than half of the cache is
    padding (and it holds at least `COMPACT_MIN` entries), every row's real entries are gathered to the right end
    (`compact`): one copy of the cache. A row never holds more than about twice its longest neighbour's entries in
    memory. The drafter's context cache (`DrafterContextCache.valid`) is compacted the same way. A row that
    finishes is removed from both (`keep_rows`).
    """

    def __init__(self, cache: DynamicCache, context):
        self.cache = cache
        self.context = context
        self.valid: torch.Tensor | None = None  # [B, L] bool; None: every entry real
        self.lengths: torch.Tensor | None = None  # [B]

    @property
    def physical_length(self) -> int:
        return self.cache.get_seq_length()

    def prefilled(self, mask: torch.Tensor | None, rows: int, length: int, device: torch.device) -> None:
        """After the prompts' forward: `mask` (`[B, T]`, 0 on left padding) or None (no padding)."""
        if mask is None:
            self.valid, self.lengths = None, torch.full((rows,), length, dtype=torch.long, device=device)
        else:
            self.valid, self.lengths = mask.bool(), mask.sum(dim=1)

    def mask(self, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The verify forward's additive mask `[B, 1, W, L + W]` for trees of ancestry `ancestors` (`[B, W, W]`)."""
        prefix = self.physical_length if self.valid is None else self.valid
        return tree_attention_mask(ancestors, prefix, dtype)

    def commit(self, past: int, accepted: list[torch.Tensor]) -> None:
        """Keep each row's root and accepted entries of the verified chunk that follows the `past` entries
        (`accepted[i]`: chunk indices, root first), compact the chunk; compact the caches when half of them is
        padding."""
        longest = max(keep.shape[0] for keep in accepted)
        counts = [keep.shape[0] for keep in accepted]
        keep = torch.stack([torch.cat([k, k[-1:].expand(longest - k.shape[0])]) for k in accepted])
        commit_cache(self.cache, past, keep)
        uneven = min(counts) != longest
        if self.valid is not None or uneven:
            kept = torch.tensor(counts, device=keep.device)
            chunk = torch.arange(longest, device=keep.device)[None, :] < kept[:, None]
            valid = self.valid if self.valid is not None else chunk.new_ones(len(accepted), past)
            self.valid = torch.cat([valid, chunk], dim=1)
        self.lengths = self.lengths + torch.tensor(counts, device=self.lengths.device)
        self.compact()

    def compact(self, force: bool = False) -> None:
        """Gather each row's real entries to the right end of the target cache (and of the drafter's context) when
        more than half of it is padding and it holds at least `COMPACT_MIN` entries (or `force`)."""
        if self.valid is not None and (force or _mostly_padding(self.valid)):
            index, self.valid = right_aligned(self.valid)
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    tensor = getattr(layer, name)
                    gather = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                    setattr(layer, name, tensor.gather(2, gather))
        if self.context.valid is not None and (force or _mostly_padding(self.context.valid)):
            self.context.select(*right_aligned(self.context.valid))

    def keep_rows(self, rows: list[int]) -> None:
        """Keep the rows `rows` (positions among the current rows), in that order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.context.keep_rows(index)
        self.lengths = self.lengths[index]
        if self.valid is not None:
            self.valid = self.valid[index]

    def plain_inputs(self, texts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows as a left-padded batch for plain decoding from this cache (`handoff.finish_plain`): every
        row's cache entries gathered to the right end (after which the cache is an ordinary left-padded cache of
        `W` entries), and `(ids, attention_mask, position_ids)`, each `[B, W + 1]`: each row's text (`texts`,
        unpadded, its last token not yet in the cache) right-aligned, padding on the left; positions logical, as
        the cache holds them."""
        if self.valid is None:
            self.valid = torch.ones(len(texts), self.physical_length, dtype=torch.bool, device=self.lengths.device)
        self.compact(force=True)
        rows, width = self.valid.shape
        ids = torch.full((rows, width + 1), pad, dtype=texts[0].dtype, device=texts[0].device)
        for i, text in enumerate(texts):
            if text.shape[0] != int(self.lengths[i]) + 1:
                raise RuntimeError(f"row {i}: {text.shape[0]} tokens against {int(self.lengths[i])} in the cache")
            ids[i, width + 1 - text.shape[0]:] = text
        mask = torch.cat([self.valid, self.valid.new_ones(rows, 1)], dim=1).long()
        return ids, mask, logical_positions(mask)


class DecodingSession:
    """Decoding state of `batch_size >= 1` rows (see the module docstring): the ragged target cache, the drafter's
    context, one `RowPlanner` per row. Rows are addressed by their position among the unfinished rows.

    Usage: `first_logits = session.prefill(input_ids, attention_mask)`, pick each row's first token, then repeatedly
    `rounds = session.step(texts, sequences)` and `session.keep_rows(...)` when rows finish.

    Args:
        target: the causal LM (eager or sdpa attention).
        drafter: a `TreeSparkDrafter` built for it (bound here).
        policy: the tree policy; `budget` (if given) fixes its budget (`set_budget` changes it; 0 = plain steps,
            nothing drafted). An "auto" policy without a budget drafts its whole pool until `choose_budget` decides.
        logits_processor / do_sample: how the target picks tokens; greedy without processors takes the vectorised
            walk, anything else the per-node walk of `verify.processed_accept`.
        keep_scores: keep the processed scores and raw logits of every committed token.
        gate: with lookup on, the threshold of the session's drafter gate (`SharedGate`; `controller.resolve_gate`
            gives this device's); 0 runs the drafter in every round that is not lookup-only.
        sources: branch sources (`sources.base.BranchSource`: the datastore, registered sources) whose nodes join
            every round that is not lookup-only, asked in order.
        choose_budget: for "auto" without a fixed budget, called once with the first drafter pool's scores
            (`[b, C]`, root excluded); returns the budget.
        pricer: one row's `controller.RoundPricer` (what each round carries, in place of the drafter gate), or None.
    """

    def __init__(self, target, drafter, policy: TreePolicy, batch_size: int = 1, *,
                 logits_processor: LogitsProcessorList | None = None, do_sample: bool = False,
                 keep_scores: bool = False, cache: DynamicCache | None = None, timer: PhaseTimer | None = None,
                 gate: float = 0.0, sources=(), budget: int | None = None, choose_budget=None, pricer=None):
        self.target = target
        self.drafter = drafter.bind_target(target)
        self.processors = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.do_sample = do_sample
        self.keep_scores = keep_scores
        self.walk_processed = do_sample or len(self.processors) > 0 or keep_scores
        self.cache_kw = cache_kwarg(target)
        self.hidden_ids = feature_indices(drafter.config.target_layer_ids)
        self.context = drafter.new_context_cache()
        self.ragged = RaggedCache(cache if cache is not None else DynamicCache(config=target.config), self.context)
        self.timer = timer
        self.choose_budget = choose_budget
        self.policy = policy  # every row's (`set_budget`), kept here too: the session outlives its last row
        self.batched = batch_size > 1  # a batch's trees hold at most the budget: its verify pads to the widest
        self.max_nodes: int | None = None
        self.planners = [RowPlanner(policy, gate, sources, timer) for _ in range(batch_size)]
        self.gate = SharedGate(gate) if policy.lookup else None
        for planner in self.planners:
            planner.gate = self.gate
        if pricer is not None and batch_size == 1:
            self.planners[0].pricer = pricer
        if budget is not None:
            self.set_budget(budget)
        self.pending: list[torch.Tensor] = []  # per row: target features `[p, F]` not yet in the drafter's context

    @property
    def cache(self) -> DynamicCache:
        return self.ragged.cache

    @property
    def lengths(self) -> torch.Tensor:
        """`[B]`: each row's committed tokens in the cache (its next position)."""
        return self.ragged.lengths

    def _phase(self, name: str):
        return self.timer(name) if self.timer is not None else nullcontext()

    @property
    def budget(self) -> int:
        """The drafter's budget per row; 0: plain steps."""
        return 0 if self.max_nodes == 0 else self.policy.budget

    def set_budget(self, budget: int) -> None:
        """Every row's budget from the next round on; 0: plain steps (the root alone, no drafter, no branches).
        A batch's trees are capped at the budget (`EXTRA_NODES`); one row's may add its lookup and datastore nodes."""
        if budget > 0:
            self.policy = self.policy.with_budget(budget)
        self.max_nodes = 0 if budget == 0 else budget + EXTRA_NODES if self.batched else None
        for planner in self.planners:
            planner.policy, planner.max_nodes = self.policy, self.max_nodes

    def apply(self, budget: int | None, gate: float | None) -> None:
        """The round controller's choice for the next round (`controller.RoundChoice`): the budget (`set_budget`)
        and the drafter gate's threshold, each where given (None: unchanged)."""
        if budget is not None:
            self.set_budget(budget)
        if gate is not None and self.gate is not None:
            self.gate.threshold = gate

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prompts `[B, T]` through the target, left-padded where `attention_mask` is 0, as plain `generate` runs
        them; returns each row's last logits `[B, V]`."""
        padded = attention_mask is not None and (self.batched or not bool(attention_mask.all()))
        mask = attention_mask.long() if padded else None
        extra = {"attention_mask": mask, "position_ids": logical_positions(mask)} if padded else {}
        with grouped_attention(self.target):
            out = self.target(input_ids=input_ids, use_cache=True, output_hidden_states=self.hidden_ids,
                              **extra, **{self.cache_kw: self.cache}, **last_logits_only(self.target))
        features = select_features(out.hidden_states, self.hidden_ids)
        self.ragged.prefilled(mask, input_ids.shape[0], input_ids.shape[1], input_ids.device)
        self.pending = [features[i] if mask is None else features[i][mask[i].bool()] for i in range(len(features))]
        return out.logits[:, -1]

    def _drafter_pass(self, anchors: torch.Tensor) -> TreeSparkDrafterOutput:
        """One drafter pass for every row: its output, depth logits `[B, D', |S|]`. Each row's pending features
        join its context: as they are for rows of equal counts without padding (one row), else left-padded to the
        longest (`context_valid` marks the real ones)."""
        counts = [p.shape[0] for p in self.pending]
        longest = max(counts)
        if self.context.valid is None and min(counts) == longest:
            features = torch.stack(self.pending) if longest else None
            out = self.drafter(anchor_ids=anchors[:, None], anchor_positions=self.lengths[:, None],
                               target_features=features, context_cache=self.context,
                               logit_slots=self.policy.expanded_depth)
        else:
            rows, width, device = len(self.pending), self.pending[0].shape[-1], anchors.device
            features = self.pending[0].new_zeros(rows, longest, width)
            valid = torch.zeros(rows, longest, dtype=torch.bool, device=device)
            positions = torch.zeros(rows, longest, dtype=torch.long, device=device)
            for i, pending in enumerate(self.pending):
                count = pending.shape[0]
                if count:
                    features[i, longest - count:] = pending
                    valid[i, longest - count:] = True
                    positions[i, longest - count:] = self.lengths[i] - count + torch.arange(count, device=device)
            out = self.drafter(anchor_ids=anchors[:, None], anchor_positions=self.lengths[:, None],
                               target_features=features, context_positions=positions, context_cache=self.context,
                               context_valid=valid, logit_slots=self.policy.expanded_depth)
        self.pending = [p[:0] for p in self.pending]
        return out

    def draft(self, texts: list[torch.Tensor], probe: bool = False) -> list[DraftTree]:
        """Every row's tree for this round; `texts`: each row's unpadded text (1-D), its anchor `x0` last. A
        `probe` verifies each root alone (a plain step, for the per-call guard)."""
        plans = [planner.plan(text, probe) for planner, text in zip(self.planners, texts, strict=True)]
        drafted = [i for i, plan in enumerate(plans) if plan.tree is None]
        if not drafted:
            return [plan.tree for plan in plans]
        anchors = torch.stack([text[-1] for text in texts])
        with self._phase("draft"):
            drafted_out = self._drafter_pass(anchors)
        with self._phase("tree"):
            stops = [self.planners[i].stop_budget(plans[i]) for i in drafted]
            stop = None if self.choose_budget is not None or None in stops else max(stops)
            if len(drafted) < len(plans):
                drafted_out = drafted_rows(drafted_out, drafted)
            pool = expand_pool(self.drafter, drafted_out, anchors[drafted], self.policy, stop)
            if self.choose_budget is not None:  # "auto" without a fixed budget: chosen on the first drafter pool
                chosen = self.choose_budget(pool.scores)
                self.choose_budget = None
                self.set_budget(chosen)
            trees = [plan.tree for plan in plans]
            for row, i in enumerate(drafted):
                trees[i] = self.planners[i].pack(plans[i], pool_row(pool, row))
        return trees

    def verify(self, trees: list[DraftTree]):
        """ONE target forward over every row's tree, padded to the largest (`core.tree.stack_trees`); the output has
        logits `[B, W, V]`."""
        tokens, depths, ancestors = stack_trees(trees)
        with grouped_attention(self.target):
            return self.target(input_ids=tokens, position_ids=tree_position_ids(depths, self.lengths),
                               attention_mask=self.ragged.mask(ancestors, self.target.dtype), use_cache=True,
                               output_hidden_states=self.hidden_ids, **{self.cache_kw: self.cache})

    def commit(self, verified, past: int, accepted: list[torch.Tensor]) -> None:
        """Keep each row's root and accepted entries (`accepted[i]`: chunk indices, root first) and queue their
        features for the drafter. Their features are exact: each node attended only to the committed prefix and
        its ancestors."""
        self.ragged.commit(past, accepted)
        features = select_features(verified.hidden_states, self.hidden_ids)
        self.pending = [torch.cat([p, features[i, k]]) for i, (p, k) in enumerate(zip(self.pending, accepted,
                                                                                      strict=True))]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep the rows `rows` (positions among the current rows), in that order: the others have finished."""
        self.ragged.keep_rows(rows)
        self.pending = [self.pending[i] for i in rows]
        self.planners = [self.planners[i] for i in rows]

    def plain_inputs(self, texts: list[torch.Tensor], pad: int):
        """`RaggedCache.plain_inputs`: the rows as a left-padded batch for transformers' own loop."""
        return self.ragged.plain_inputs(texts, pad)

    @torch.no_grad()
    def step(self, texts: list[torch.Tensor], sequences: list[torch.Tensor], probe: bool = False) -> list[Round]:
        """One round for every row: `texts` each row's unpadded text (1-D, its last token `x0`), `sequences` each
        row's tokens as logits processors see them (`[1, T_i]`, padding included). A `probe` verifies each root
        alone, a plain step. A probe's target forward is timed (`Round.verify_seconds`), and every round's on a CPU,
        where the clock needs no synchronisation."""
        began = time.perf_counter()
        if self.gate is not None:
            self.gate.new_round()
        trees = self.draft(texts, probe)
        device = trees[0].tokens.device
        timed = probe or device.type == "cpu"
        past = self.ragged.physical_length
        with self._phase("verify"):
            began = synchronised_clock(device) if timed else 0.0
            verified = self.verify(trees)
            seconds = synchronised_clock(device) - began if timed else None
        with self._phase("walk"):
            rounds = []
            for i, tree in enumerate(trees):
                logits = verified.logits[i:i + 1, :tree.num_nodes + 1]
                acceptance = (processed_accept(tree, logits, sequences[i], self.processors, self.do_sample,
                                               keep_scores=self.keep_scores)
                              if self.walk_processed else greedy_accept(tree, logits))
                rounds.append(Round(tree, acceptance, int(acceptance.num_accepted[0]), seconds,
                                    self.planners[i].round_kind(probe)))
        with self._phase("commit"):
            self.commit(verified, past, [rnd.acceptance.path[0, :rnd.num_accepted + 1] for rnd in rounds])
        spent = time.perf_counter() - began if device.type == "cpu" else None  # CUDA would need a synchronisation
        for planner, tree, rnd in zip(self.planners, trees, rounds, strict=True):
            planner.after_round(tree, rnd, spent)
        return rounds
