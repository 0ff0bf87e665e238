"""Batched TreeSpark rounds: a left-padded batch of `B > 1` sequences, one target forward per round for all rows.

A round, for the unfinished rows:

    plan     each row plans its own tree (`engine.RowPlanner`: lookup branches, lookup-only rounds, the
             drafter gate, datastore branches)
    draft    ONE drafter pass for every row, when at least one row's plan needs the drafter (the others'
             pending target features join the drafter's context all the same); its candidate pool is
             expanded for those rows together and each row packs its own tree
    verify   ONE target forward over `[B, 1 + N]` tokens, `N` the largest tree of the round: a row's smaller
             tree is padded with nodes that see only the prefix and themselves and are never walked; a 4D mask
             per row over its own valid cache entries and its tree's ancestry; explicit positions per row
    accept   each row walks its own tree (`verify.greedy_accept`, or the per-node walk with processors or
             sampling), on its own logits
    commit   each row keeps its root and accepted entries; their features join its pending drafter context

The ragged cache. Rows accept different numbers of tokens in a round, so their caches grow unevenly. The target
cache is transformers' `DynamicCache`, one physical length `L` for all rows, with `valid` (`[B, L]` bool) marking
each row's real entries. A round's verified chunk of `1 + N` entries is compacted in place to its first
`M = max(accepted + 1)` entries (each row's kept entries first, in order; `verify.commit_cache`) and `valid`
records how many of the `M` each row kept; rejected and padding entries stay, masked. Positions are logical (a
row's committed tokens before it), never physical, so rotary embeddings are exact whatever the layout. When more
than half of the cache is padding (and it holds at least `COMPACT_MIN` entries), every row's real entries are
gathered to the right end (`compact`): one copy of the cache. Cost: a row never holds more than about twice its
longest neighbour's entries in memory, every attention reads the padding entries too (at most as many as real
ones), and a compaction copies the cache once per halving. The drafter's context cache
(`DrafterContextCache.valid`) is kept the same way. A row that finishes is removed from both caches (`keep_rows`):
finished rows cost nothing, so the batch shrinks as rows end.

`generation_batch.py` drives the session (stopping, padding finished rows as plain `generate` does, records) and, with
`tree_budget="auto"`, chooses the budget for the number of unfinished rows (`budget.BatchBudget`). Where no tree
pays any more (greedy, no logits processors), it hands the rows to transformers' own loop: the cache, gathered
right (`plain_inputs`), is then an ordinary left-padded cache with logical positions.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
from transformers import DynamicCache, LogitsProcessorList

from ..core.tree import Candidates, DraftTree, TreePolicy
from ..core.verify import cache_kwarg, commit_cache, greedy_accept, grouped_attention, processed_accept
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
)

COMPACT_MIN = 64  # entries below which a cache is never compacted
EXTRA_NODES = 0  # nodes a row's tree may hold beyond the budget (lookup and datastore branches included)


class BatchGate(DrafterGate):
    """The drafter gate of a batch, shared by its rows: every row's drafter round feeds its running mean, and its
    idle count is in rounds of the batch (a round in which any row went without the drafter), not of rows."""

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
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[0]:], mask[i, width - row.shape[0]:] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def pool_row(pool: Candidates, row: int) -> Candidates:
    """Row `row` of a batched candidate pool, as a pool of batch size 1."""
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


class BatchedSession:
    """Decoding state of a batch (see the module docstring): target cache and `valid`, the drafter's context, one
    `RowPlanner` per row. Rows are addressed by their position among the unfinished rows.

    Usage: `first_logits = session.prefill(input_ids, attention_mask)`, pick each row's first token, then repeatedly
    `rounds = session.step(texts, sequences)` and `session.keep_rows(...)` when rows finish.

    Args:
        policy: the tree policy; `budget` (if given) fixes its budget (`set_budget` changes it; 0 = plain steps,
            nothing drafted). An "auto" policy without a budget drafts its whole pool until `choose_budget` decides.
        logits_processor / do_sample: how the target picks tokens (the per-node walk when either is set).
        gate: the threshold of the batch's drafter gate (`lookup.DrafterGate`, one for all rows: the drafter pass
            serves every row; each row's drafter rounds feed it, and each row's round without it counts as idle).
        datastore: as `engine.TreeSparkSession`.
        choose_budget: for "auto" without a calibrated profile, called once with the first drafter pool's scores
            (`[b, C]`); returns the budget.
    """

    def __init__(self, target, drafter, policy: TreePolicy, batch_size: int, *,
                 logits_processor: LogitsProcessorList | None = None, do_sample: bool = False,
                 cache: DynamicCache | None = None, timer: PhaseTimer | None = None, gate: float = 0.0,
                 datastore=None, budget: int | None = None, choose_budget=None):
        self.target = target
        self.drafter = drafter.bind_target(target)
        self.processors = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.do_sample = do_sample
        self.walk_processed = do_sample or len(self.processors) > 0
        self.cache = cache if cache is not None else DynamicCache(config=target.config)
        self.cache_kw = cache_kwarg(target)
        self.hidden_ids = feature_indices(drafter.config.target_layer_ids)
        self.context = drafter.new_context_cache()
        self.timer = timer
        self.choose_budget = choose_budget
        self.policy = policy  # every row's (`set_budget`), kept here too: the session outlives its last row
        self.max_nodes: int | None = None
        self.planners = [RowPlanner(policy, gate, datastore, timer) for _ in range(batch_size)]
        self.gate = BatchGate(gate) if policy.lookup else None  # one for the batch: the pass serves every row
        for planner in self.planners:
            planner.gate = self.gate
        if budget is not None:
            self.set_budget(budget)
        self.pending: list[torch.Tensor] = []  # per row: target features `[p, F]` not yet in the drafter's context
        self.valid: torch.Tensor | None = None  # [B, L] bool
        self.lengths: torch.Tensor | None = None  # [B] committed tokens in the cache: each row's next position

    def _phase(self, name: str):
        return self.timer(name) if self.timer is not None else nullcontext()

    @property
    def budget(self) -> int:
        """The drafter's budget per row; 0: plain steps."""
        return 0 if self.max_nodes == 0 else self.policy.budget

    def set_budget(self, budget: int) -> None:
        """Every row's budget from the next round on; 0: plain steps (the root alone, no drafter, no branches)."""
        if budget > 0:
            self.policy = self.policy.with_budget(budget)
        self.max_nodes = budget + EXTRA_NODES if budget > 0 else 0
        for planner in self.planners:
            planner.policy, planner.max_nodes = self.policy, self.max_nodes

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The left-padded prompts `[B, T]` (`attention_mask` 0 on padding) through the target, as plain `generate`
        runs them; returns each row's last logits `[B, V]`."""
        mask = attention_mask.long()
        position_ids = logical_positions(mask)
        with grouped_attention(self.target):
            out = self.target(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                              output_hidden_states=self.hidden_ids, **{self.cache_kw: self.cache},
                              **last_logits_only(self.target))
        features = select_features(out.hidden_states, self.hidden_ids)
        self.valid = mask.bool()
        self.lengths = mask.sum(dim=1)
        self.pending = [features[i][self.valid[i]] for i in range(input_ids.shape[0])]
        return out.logits[:, -1]

    def _drafter_pass(self, anchors: torch.Tensor) -> TreeSparkDrafterOutput:
        """One drafter pass for every row: its output, depth logits `[B, D', |S|]`. Each row's pending features,
        left-padded to the longest, join its context (`context_valid` marks the real ones)."""
        rows = len(self.pending)
        longest = max(p.shape[0] for p in self.pending)
        width = self.pending[0].shape[-1]
        features = self.pending[0].new_zeros(rows, longest, width)
        valid = torch.zeros(rows, longest, dtype=torch.bool, device=anchors.device)
        positions = torch.zeros(rows, longest, dtype=torch.long, device=anchors.device)
        for i, pending in enumerate(self.pending):
            count = pending.shape[0]
            if count:
                features[i, longest - count:] = pending
                valid[i, longest - count:] = True
                positions[i, longest - count:] = self.lengths[i] - count + torch.arange(count, device=anchors.device)
        out = self.drafter(anchor_ids=anchors[:, None], anchor_positions=self.lengths[:, None],
                           target_features=features, context_positions=positions, context_cache=self.context,
                           context_valid=valid, logit_slots=self.policy.expanded_depth)
        self.pending = [p[:0] for p in self.pending]
        return out

    def draft(self, texts: list[torch.Tensor]) -> list[DraftTree]:
        """Every row's tree for this round; `texts`: each row's unpadded text (1-D), its anchor `x0` last."""
        plans = [planner.plan(text) for planner, text in zip(self.planners, texts, strict=True)]
        drafted = [i for i, plan in enumerate(plans) if plan.tree is None]
        if not drafted:
            return [plan.tree for plan in plans]
        anchors = torch.stack([text[-1] for text in texts])
        with self._phase("draft"):
            drafted_out = self._drafter_pass(anchors)
        with self._phase("tree"):
            stops = [self.planners[i].stop_budget(plans[i]) for i in drafted]
            stop = None if self.choose_budget is not None or None in stops else max(stops)
            pool = expand_pool(self.drafter, drafted_rows(drafted_out, drafted), anchors[drafted], self.policy, stop)
            if self.choose_budget is not None:  # "auto" without a profile: chosen on the first drafter pool
                self.set_budget(self.choose_budget(pool.scores))
                self.choose_budget = None
            trees = [plan.tree for plan in plans]
            for row, i in enumerate(drafted):
                trees[i] = self.planners[i].pack(plans[i], pool_row(pool, row))
        return trees

    def verify(self, trees: list[DraftTree]):
        """ONE target forward over every row's tree, padded to the largest (see the module docstring)."""
        rows, width = len(trees), max(tree.num_nodes for tree in trees) + 1
        device = self.valid.device
        tokens = torch.stack([tree.tokens[0, :1].expand(width) for tree in trees]).clone()
        depths = torch.zeros(rows, width, dtype=torch.long, device=device)
        allowed = torch.eye(width, dtype=torch.bool, device=device).repeat(rows, 1, 1)
        for i, tree in enumerate(trees):
            n = tree.num_nodes + 1
            tokens[i, :n], depths[i, :n] = tree.tokens[0], tree.depths[0]
            allowed[i, :n, :n] = tree.ancestors[0]
        allowed = torch.cat([self.valid[:, None, :].expand(rows, width, -1), allowed], dim=-1)
        dtype = self.target.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        with grouped_attention(self.target):
            return self.target(input_ids=tokens, position_ids=self.lengths[:, None] + depths,
                               attention_mask=mask[:, None], use_cache=True, output_hidden_states=self.hidden_ids,
                               **{self.cache_kw: self.cache})

    def commit(self, verified, accepted: list[torch.Tensor]) -> None:
        """Keep each row's root and accepted entries (`accepted[i]`: chunk indices, root first), compact the chunk,
        queue their features; compact the caches when half of them is padding."""
        past, longest = self.valid.shape[1], max(keep.shape[0] for keep in accepted)
        keep = torch.stack([torch.cat([k, k[-1:].expand(longest - k.shape[0])]) for k in accepted])
        commit_cache(self.cache, past, keep)
        counts = torch.tensor([k.shape[0] for k in accepted], device=keep.device)
        chunk = torch.arange(longest, device=keep.device)[None, :] < counts[:, None]
        self.valid = torch.cat([self.valid, chunk], dim=1)
        self.lengths = self.lengths + counts
        features = select_features(verified.hidden_states, self.hidden_ids)
        self.pending = [torch.cat([p, features[i, k]]) for i, (p, k) in enumerate(zip(self.pending, accepted,
                                                                                      strict=True))]
        self.compact()

    def compact(self, force: bool = False) -> None:
        """Gather each row's real entries to the right end of the target cache (and of the drafter's context) when
        more than half of it is padding and it holds at least `COMPACT_MIN` entries (or `force`)."""
        if force or _mostly_padding(self.valid):
            index, self.valid = right_aligned(self.valid)
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    tensor = getattr(layer, name)
                    gather = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                    setattr(layer, name, tensor.gather(2, gather))
        if self.context.valid is not None and (force or _mostly_padding(self.context.valid)):
            self.context.select(*right_aligned(self.context.valid))

    def plain_inputs(self, texts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows as a left-padded batch for plain decoding from this cache (`generation_batch._finish_plain`): every
        row's cache entries gathered to the right end (after which the cache is an ordinary left-padded cache of
        `W` entries), and `(ids, attention_mask, position_ids)`, each `[B, W + 1]`: each row's text (`texts`,
        unpadded, its last token not yet in the cache) right-aligned, padding on the left; positions logical, as
        the cache holds them."""
        self.compact(force=True)
        rows, width = self.valid.shape
        ids = torch.full((rows, width + 1), pad, dtype=texts[0].dtype, device=texts[0].device)
        for i, text in enumerate(texts):
            if text.shape[0] != int(self.lengths[i]) + 1:
                raise RuntimeError(f"row {i}: {text.shape[0]} tokens against {int(self.lengths[i])} in the cache")
            ids[i, width + 1 - text.shape[0]:] = text
        mask = torch.cat([self.valid, self.valid.new_ones(rows, 1)], dim=1).long()
        return ids, mask, logical_positions(mask)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep the rows `rows` (positions among the current rows), in that order: the others have finished."""
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.context.keep_rows(index)
        self.valid, self.lengths = self.valid[index], self.lengths[index]
        self.pending = [self.pending[i] for i in rows]
        self.planners = [self.planners[i] for i in rows]

    @torch.no_grad()
    def step(self, texts: list[torch.Tensor], sequences: list[torch.Tensor]) -> list[Round]:
        """One round for every row: `texts` each row's unpadded text (1-D, its last token `x0`), `sequences` each
        row's tokens as logits processors see them (`[1, T_i]`, padding included)."""
        if self.gate is not None:
            self.gate.new_round()
        trees = self.draft(texts)
        with self._phase("verify"):
            verified = self.verify(trees)
        with self._phase("walk"):
            rounds = []
            for i, tree in enumerate(trees):
                logits = verified.logits[i:i + 1, :tree.num_nodes + 1]
                acceptance = (processed_accept(tree, logits, sequences[i], self.processors, self.do_sample)
                              if self.walk_processed else greedy_accept(tree, logits))
                rounds.append(Round(tree, acceptance, int(acceptance.num_accepted[0]),
                                    kind=self.planners[i].round_kind()))
        with self._phase("commit"):
            self.commit(verified, [rnd.acceptance.path[0, :rnd.num_accepted + 1] for rnd in rounds])
        for planner, tree, rnd in zip(self.planners, trees, rounds, strict=True):
            planner.after_round(tree, rnd)
        return rounds


def _mostly_padding(valid: torch.Tensor) -> bool:
    return valid.shape[1] >= COMPACT_MIN and 2 * int(valid.sum()) < valid.numel()
