"""The target's own answers, fast: continuous batching over one preallocated KV cache.

`regenerate_responses` (`data.py`) answers a batch of prompts with `target.generate` and waits for the batch's
longest answer: a row that finished early computes padding until then, and every batch starts again from an empty
cache. `AnswerGenerator` keeps `slots` rows decoding at once in one `StaticCache` of `cache_len` positions per row;
the moment a row's answer ends (EOS or `max_new_tokens`) the next prompt takes its row, prefilled in a forward of
its own (several freed rows together), while the other rows go on.

One decoding step is one target forward over `[slots, 1]` tokens. All rows write their new key/value at the same
cache slot `t` (the cache's shared write position); row `r`'s sequence occupies slots `start[r] .. t`, and its
position ids count from `start[r]`, so its tokens are where a lone run would put them. The attention mask
`[slots, 1, 1, cache_len]` lets each row see its own slots only. A new prompt of `P` tokens is written at slots
`t - P .. t - 1` of its row (its row's earlier occupant is done with them); `t` never drops below the longest
prompt. When `t` reaches the end of the cache, every row's slots are moved left by the same amount (`_roll`), so
a row's span (prompt plus answer) always fits.

Greedy answers equal `target.generate(do_sample=False)` run prompt by prompt (float32; in half precision up to a
near-tie of the target's logits, as any batched decoding): tests/test_answers.py. Sampling draws each token from
`softmax(logits / temperature)` with a seeded generator.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, StaticCache

from ..core.verify import cache_kwarg, register_sdpa_variant

RAGGED_SDPA = "treespark_ragged_decode"
_PLAN = threading.local()  # the decoding step's chunks, read by `ragged_decode_attention` (one per thread)


@dataclass
class _Chunk:
    """Rows `first .. last - 1` of a decoding step attend to cache slots `low .. t`, under `mask`
    `[rows, 1, 1, t + 1 - low]` (0 where a row may attend, the dtype's minimum before its own first slot)."""

    first: int
    last: int
    low: int
    mask: torch.Tensor


def ragged_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            is_causal=None, **kwargs):
    """sdpa attention for one query token per row in which each chunk of rows reads only the cache slots its rows
    use (`_PLAN.chunks`, `_PLAN.t`), not the whole preallocated cache; grouped-query heads are stacked per key/value
    head (`[rows, kv_heads, groups, head_dim]`), so the cache is never repeated. Anything else (a prefill, no plan)
    goes to transformers' sdpa unchanged. Takes and returns what transformers' attention functions do
    (`query` `[b, heads, 1, d]`, `key`/`value` `[b, kv_heads, cache_len, d]`; out `[b, 1, heads, d]`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    chunks = getattr(_PLAN, "chunks", None)
    if chunks is None or query.shape[2] != 1 or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, heads, _, dim = query.shape
    kv_heads, end = key.shape[1], _PLAN.t + 1
    stacked = query.reshape(b, kv_heads, heads // kv_heads, dim)  # (B, KV, G, D)
    out = query.new_empty(b, kv_heads, heads // kv_heads, value.shape[-1])
    for chunk in chunks:
        rows = slice(chunk.first, chunk.last)
        out[rows] = F.scaled_dot_product_attention(stacked[rows], key[rows, :, chunk.low:end],
                                                   value[rows, :, chunk.low:end], attn_mask=chunk.mask, scale=scaling)
    return out.reshape(b, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


_RAGGED_REGISTERED = register_sdpa_variant(RAGGED_SDPA, ragged_decode_attention)


@contextmanager
def _ragged_attention(model, enabled: bool) -> Iterator[None]:
    """Within the block, an sdpa `model` uses `ragged_decode_attention` (when `enabled`)."""
    config = model.config
    if not enabled:
        yield
        return
    config._attn_implementation = RAGGED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
        _PLAN.chunks = None


@dataclass
class AnswerConfig:
    """The knobs of `AnswerGenerator`."""

    slots: int = 32  # rows decoding at once
    max_new_tokens: int = 256  # an answer stops here if it has not reached EOS
    max_prompt_tokens: int = 384  # longer prompts are refused by `AnswerGenerator.add`
    spare: int = 128  # cache slots beyond the longest row span: decoding steps between two rolls, at least
    do_sample: bool = False  # greedy (the deployed mode) unless set
    temperature: float = 1.0  # with do_sample
    seed: int = 0  # with do_sample
    prefill_tokens: int = 4096  # most prompt tokens prefilled in one forward (several freed rows together)
    chunk_rows: int = 8  # rows that share an attention window (sdpa targets; 0: every row reads the whole cache)
    sort_every: int = 32  # decoding steps between two sorts of the rows by their first slot (with chunk_rows)

    @property
    def cache_len(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens + self.spare


@dataclass
class Answer:
    """One finished answer: the prompt's `key`, its token ids and the answer's (EOS included when reached)."""

    key: object
    prompt_ids: list[int]
    response_ids: list[int]


class AnswerGenerator:
    """Answers prompts (token ids, chat-templated by the caller) with `target`, `config.slots` at a time.

    Takes the target (a causal LM; any dtype and device), its EOS ids and the config. `run(prompts)` yields an
    `Answer` per prompt as each finishes (not in input order). Raises `ValueError` for a prompt longer than
    `config.max_prompt_tokens` or empty.
    """

    def __init__(self, target, eos_ids: Iterable[int], config: AnswerConfig | None = None):
        self.target = target.eval()
        self.config = config or AnswerConfig()
        self.device = next(target.parameters()).device
        self.eos = torch.tensor(sorted(set(eos_ids)), device=self.device)
        if not len(self.eos):
            raise ValueError("AnswerGenerator needs at least one EOS id")
        self.eos_set = set(self.eos.tolist())
        self.cache_arg = cache_kwarg(target)
        self.random = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.steps = 0  # decoding forwards run
        self.prefills = 0  # prefill forwards run
        self.rolls = 0  # times the cache's slots were moved left
        self.sorts = 0  # times the rows were put in order of their first slot (rolls included)
        self.ragged = (self.config.chunk_rows > 0 and _RAGGED_REGISTERED
                       and getattr(target.config, "_attn_implementation", None) == "sdpa")

    # ----- the loop ------------------------------------------------------------------------------------------

    def run(self, prompts: Iterable[tuple[object, list[int]]]) -> Iterator[Answer]:
        """Yield an `Answer` for every `(key, prompt_ids)` of `prompts` (an iterable, read as rows free up)."""
        with _ragged_attention(self.target, self.ragged):
            yield from self._run(prompts)

    @torch.inference_mode()
    def _run(self, prompts: Iterable[tuple[object, list[int]]]) -> Iterator[Answer]:
        cfg = self.config
        pending = iter(prompts)
        rows: list[dict | None] = [None] * cfg.slots  # per row: key, prompt, answer so far, start slot
        cache = self._new_cache()
        t = cfg.max_prompt_tokens  # the shared write slot: room for the longest prompt before it
        self._set_length(cache, t)
        next_tokens = torch.zeros(cfg.slots, dtype=torch.long, device=self.device)
        exhausted, sorted_at = False, 0
        while True:
            free = [r for r, row in enumerate(rows) if row is None]
            if free and not exhausted:
                fresh = []
                for r in free:
                    item = next(pending, None)
                    if item is None:
                        exhausted = True
                        break
                    fresh.append((r, *self._checked(item)))
                firsts = self._prefill(cache, t, fresh) if fresh else {}
                ended = False
                for r, key, ids in fresh:
                    rows[r] = {"key": key, "prompt": ids, "answer": [firsts[r]], "start": t - len(ids)}
                    next_tokens[r] = firsts[r]
                    if self._finished(rows[r]):  # its first token already ends it
                        yield self._answer(rows[r])
                        rows[r], ended = None, True
                if ended:
                    continue  # refill before decoding
            live = [r for r, row in enumerate(rows) if row is not None]
            if not live:
                return
            if t == cfg.cache_len or (self.ragged and self.steps - sorted_at >= cfg.sort_every):
                t, order = self._roll(cache, rows, t, shift=t == cfg.cache_len)
                sorted_at = self.steps
                rows[:] = [rows[i] for i in order]
                next_tokens = next_tokens[torch.tensor(order, device=self.device)]
                continue  # the rows moved: list the live ones again
            logits = self._step(cache, rows, next_tokens, t)  # [slots, V]
            t += 1
            chosen = self._choose(logits)
            next_tokens = chosen
            picked = chosen.tolist()
            for r in live:
                token = picked[r]
                rows[r]["answer"].append(token)
                if self._finished(rows[r]):
                    yield self._answer(rows[r])
                    rows[r] = None

    def _checked(self, item) -> tuple[object, list[int]]:
        key, ids = item
        ids = [int(i) for i in ids]
        if not ids or len(ids) > self.config.max_prompt_tokens:
            raise ValueError(f"prompt {key!r} has {len(ids)} tokens: a prompt needs 1 to max_prompt_tokens="
                             f"{self.config.max_prompt_tokens}")
        return key, ids

    def _finished(self, row: dict) -> bool:
        answer = row["answer"]
        return len(answer) >= self.config.max_new_tokens or answer[-1] in self.eos_set

    @staticmethod
    def _answer(row: dict) -> Answer:
        return Answer(row["key"], row["prompt"], row["answer"])

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row from `logits` `[slots, V]`: argmax, or a draw at `temperature`."""
        if not self.config.do_sample:
            return logits.max(-1).indices  # the first maximum, as argmax; 2-3x faster than argmax on bf16 CPU logits
        probs = torch.softmax(logits.float() / self.config.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.random).squeeze(1)

    # ----- the cache -----------------------------------------------------------------------------------------

    def _new_cache(self) -> StaticCache:
        cfg, text = self.config, self.target.config.get_text_config(decoder=True)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        cache = StaticCache(config=self.target.config, max_cache_len=cfg.cache_len)
        cache.early_initialization(cfg.slots, heads, head_dim, self.target.dtype, self.device)
        return cache

    @staticmethod
    def _set_length(cache: StaticCache, t: int) -> None:
        """Make `t` the slot every row's next key/value is written at."""
        for layer in cache.layers:
            layer.cumulative_length.fill_(t)

    def _roll(self, cache: StaticCache, rows: list[dict | None], t: int, shift: bool = True) -> tuple[int, list[int]]:
        """Put the rows in order of their first slot (oldest first, free rows last), so that rows of similar spans
        share an attention window, and (`shift`) move every row's slots left by the same amount, keeping the
        longest prompt's room before the write slot. Returns the new write slot and the order (new row i was row
        `order[i]`)."""
        starts = [row["start"] for row in rows if row is not None]
        move = min(min(starts), t - self.config.max_prompt_tokens) if shift else 0
        if shift and move <= 0:
            raise RuntimeError("the answer cache cannot roll: a row outgrew max_prompt_tokens + max_new_tokens")
        order = sorted(range(len(rows)), key=lambda r: rows[r]["start"] if rows[r] is not None else t)
        index = torch.tensor(order, device=self.device)
        low = min(starts) - move if not shift else 0  # a sort alone moves the slots in use only
        for layer in cache.layers:
            layer.keys[:, :, low: t - move] = layer.keys[index, :, low + move:t]
            layer.values[:, :, low: t - move] = layer.values[index, :, low + move:t]
        for row in rows:
            if row is not None:
                row["start"] -= move
        self._set_length(cache, t - move)
        self.rolls += shift
        self.sorts += 1
        return t - move, order

    def _step(self, cache: StaticCache, rows: list[dict | None], tokens: torch.Tensor, t: int) -> torch.Tensor:
        """One decoding forward: every row's `tokens` written at slot `t`; returns the logits `[slots, V]`."""
        cfg = self.config
        starts = torch.tensor([row["start"] if row is not None else t for row in rows], device=self.device)
        slots = torch.arange(cfg.cache_len, device=self.device)
        allowed = (slots[None, :] >= starts[:, None]) & (slots[None, :] <= t)  # [slots, cache_len]
        mask = torch.zeros(allowed.shape, dtype=self.target.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.target.dtype).min)
        if self.ragged:
            _PLAN.t, _PLAN.chunks = t, self._chunks(starts, mask, t)
        out = self.target(input_ids=tokens[:, None], position_ids=(t - starts)[:, None],
                          attention_mask=mask[:, None, None, :], use_cache=True, logits_to_keep=1,
                          **{self.cache_arg: cache})
        self.steps += 1
        return out.logits[:, -1]

    def _chunks(self, starts: torch.Tensor, mask: torch.Tensor, t: int) -> list[_Chunk]:
        """Consecutive rows, `chunk_rows` at a time, each chunk reading from its oldest row's first slot."""
        chunks, size = [], self.config.chunk_rows
        for first in range(0, len(starts), size):
            last = min(first + size, len(starts))
            low = int(starts[first:last].min())
            chunks.append(_Chunk(first, last, low, mask[first:last, None, None, low: t + 1]))
        return chunks

    def _prefill(self, cache: StaticCache, t: int, fresh: list[tuple[int, object, list[int]]]) -> dict[int, int]:
        """Prefill the prompts of `fresh` (`(row, key, ids)`) into their rows, ending at slot `t`; returns each row's
        first answer token. Prompts are right-padded together (a causal mask keeps padding out of real tokens),
        at most `config.prefill_tokens` tokens per forward."""
        firsts: dict[int, int] = {}
        group: list[tuple[int, object, list[int]]] = []
        for item in sorted(fresh, key=lambda x: len(x[2])):
            if group and len(item[2]) * (len(group) + 1) > self.config.prefill_tokens:
                firsts.update(self._prefill_group(cache, t, group))
                group = []
            group.append(item)
        if group:
            firsts.update(self._prefill_group(cache, t, group))
        return firsts

    def _prefill_group(self, cache: StaticCache, t: int, group) -> dict[int, int]:
        width = max(len(ids) for _, _, ids in group)
        ids = torch.zeros(len(group), width, dtype=torch.long, device=self.device)
        for i, (_, _, prompt) in enumerate(group):
            ids[i, : len(prompt)] = torch.tensor(prompt, device=self.device)
        own = DynamicCache()
        _PLAN.chunks = None  # a prefill attends as sdpa does
        lengths = torch.tensor([len(p) for _, _, p in group], device=self.device)
        ends, which = torch.unique(lengths - 1, return_inverse=True)  # logits at each row's last prompt token only
        out = self.target(input_ids=ids, use_cache=True, logits_to_keep=ends, **{self.cache_arg: own})
        self.prefills += 1
        last = out.logits[torch.arange(len(group), device=self.device), which]  # [g, V]
        chosen = self._choose(last)
        for layer, (keys, values) in zip(cache.layers, _layer_states(own), strict=True):
            for i, (row, _, prompt) in enumerate(group):
                n = len(prompt)
                layer.keys[row, :, t - n: t] = keys[i, :, :n]
                layer.values[row, :, t - n: t] = values[i, :, :n]
        return {row: int(chosen[i]) for i, (row, _, _) in enumerate(group)}


def _layer_states(cache: DynamicCache) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`(keys, values)` `[batch, kv_heads, length, head_dim]` of every layer of a filled `DynamicCache`."""
    for layer in cache.layers:
        yield layer.keys, layer.values


# ----- shards on disk ----------------------------------------------------------------------------------------


class AnswerShards:
    """Answers kept as gzip JSONL shards in `directory` (`answers-NNNNN.jsonl.gz`, one record a line: `id`,
    `source`, `prompt_ids`, `response_ids`, what `treespark train --data` reads). A shard is written whole to a
    temporary name and renamed, so a crash loses at most the answers not yet in a shard; `done()` lists the ids
    already answered, for a resumed run to skip."""

    def __init__(self, directory: str | Path, shard_answers: int = 256):
        self.directory = Path(directory)
        self.shard_answers = shard_answers
        self.pending: list[dict] = []

    def paths(self) -> list[Path]:
        return sorted(self.directory.glob("answers-*.jsonl.gz"))

    def records(self) -> Iterator[dict]:
        """Every answer in a complete shard, in shard order."""
        for path in self.paths():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                yield from (json.loads(line) for line in f if line.strip())

    def done(self) -> set[str]:
        """The ids of every answer in a complete shard."""
        return {record["id"] for record in self.records()}

    def add(self, record: dict) -> None:
        self.pending.append(record)
        if len(self.pending) >= self.shard_answers:
            self.flush()

    def flush(self) -> None:
        """Write the pending answers as the next shard (nothing if none)."""
        if not self.pending:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        index = len(self.paths())
        final = self.directory / f"answers-{index:05d}.jsonl.gz"
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        try:
            with gzip.open(tmp, "wt", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in self.pending)
                f.flush()
            tmp.replace(final)
        finally:
            tmp.unlink(missing_ok=True)
        self.pending = []
