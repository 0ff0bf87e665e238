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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

from ..verify import cache_kwarg


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
        self.cache_arg = cache_kwarg(target)
        self.random = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.steps = 0  # decoding forwards run
        self.prefills = 0  # prefill forwards run
        self.rolls = 0  # times the cache's slots were moved left

    # ----- the loop ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, prompts: Iterable[tuple[object, list[int]]]) -> Iterator[Answer]:
        """Yield an `Answer` for every `(key, prompt_ids)` of `prompts` (an iterable, read as rows free up)."""
        cfg = self.config
        pending = iter(prompts)
        rows: list[dict | None] = [None] * cfg.slots  # per row: key, prompt, answer so far, start slot
        cache = self._new_cache()
        t = cfg.max_prompt_tokens  # the shared write slot: room for the longest prompt before it
        self._set_length(cache, t)
        next_tokens = torch.zeros(cfg.slots, dtype=torch.long, device=self.device)
        exhausted = False
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
            if t == cfg.cache_len:
                t = self._roll(cache, rows, t)
            logits = self._step(cache, rows, next_tokens, t)  # [slots, V]
            t += 1
            chosen = self._choose(logits)
            for r in live:
                token = int(chosen[r])
                rows[r]["answer"].append(token)
                next_tokens[r] = token
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
        return len(answer) >= self.config.max_new_tokens or bool((self.eos == answer[-1]).any())

    @staticmethod
    def _answer(row: dict) -> Answer:
        return Answer(row["key"], row["prompt"], row["answer"])

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of every row from `logits` `[slots, V]`: argmax, or a draw at `temperature`."""
        if not self.config.do_sample:
            return logits.argmax(-1)
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

    def _roll(self, cache: StaticCache, rows: list[dict | None], t: int) -> int:
        """Move every row's slots left by the same amount, keeping the longest prompt's room before the write
        slot; returns the new write slot."""
        starts = [row["start"] for row in rows if row is not None]
        shift = min(min(starts), t - self.config.max_prompt_tokens)
        if shift <= 0:
            raise RuntimeError("the answer cache cannot roll: a row outgrew max_prompt_tokens + max_new_tokens")
        for layer in cache.layers:
            layer.keys[:, :, : t - shift] = layer.keys[:, :, shift:t].clone()
            layer.values[:, :, : t - shift] = layer.values[:, :, shift:t].clone()
        for row in rows:
            if row is not None:
                row["start"] -= shift
        self._set_length(cache, t - shift)
        self.rolls += 1
        return t - shift

    def _step(self, cache: StaticCache, rows: list[dict | None], tokens: torch.Tensor, t: int) -> torch.Tensor:
        """One decoding forward: every row's `tokens` written at slot `t`; returns the logits `[slots, V]`."""
        cfg = self.config
        starts = torch.tensor([row["start"] if row is not None else t for row in rows], device=self.device)
        slots = torch.arange(cfg.cache_len, device=self.device)
        allowed = (slots[None, :] >= starts[:, None]) & (slots[None, :] <= t)  # [slots, cache_len]
        mask = torch.zeros(allowed.shape, dtype=self.target.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.target.dtype).min)
        out = self.target(input_ids=tokens[:, None], position_ids=(t - starts)[:, None],
                          attention_mask=mask[:, None, None, :], use_cache=True, logits_to_keep=1,
                          **{self.cache_arg: cache})
        self.steps += 1
        return out.logits[:, -1]

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
        out = self.target(input_ids=ids, use_cache=True, **{self.cache_arg: own})
        self.prefills += 1
        lengths = torch.tensor([len(p) for _, _, p in group], device=self.device)
        last = out.logits[torch.arange(len(group), device=self.device), lengths - 1]  # [g, V]
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

    def done(self) -> set[str]:
        """The ids of every answer in a complete shard."""
        ids = set()
        for path in self.paths():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                ids.update(json.loads(line)["id"] for line in f if line.strip())
        return ids

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
