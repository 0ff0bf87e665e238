"""Prompts that do not run out: later human turns asked on their own, and prompts the target writes itself.

Sources (`treespark answers --prompts`), each an iterator of `data.Prompt`:

    sharegpt_standalone   ShareGPT's second and later human turns of the training records (file positions below
                          the held-out band, and from the tail on), each asked alone, without its conversation
    self                  questions the target writes itself: its chat template up to the user's turn is fed to it
                          and it is sampled until it ends the turn (the Magpie recipe), then kept only if it passes
                          `QuestionFilter` (length, mostly letters, no duplicate or near-duplicate)
    sharegpt, sharegpt_turns, sharegpt_tail, sharegpt_tail_turns, a .jsonl path: `data.parse_mixture_spec`'s

No source reads a held-out ShareGPT record (positions 12,000 to 13,999: the benchmark, calibration and the
development set) or any other evaluation set: the ShareGPT readers stop before the band or start after it
(tests/test_prompt_supply.py checks every position they yield), and skip a turn whose text evaluation reads
where ShareGPT repeats it outside the band (`held_out.evaluated_texts`; tests/test_held_out.py checks every source).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

from ..hub import assets
from .answers import AnswerConfig, AnswerGenerator
from .data import Prompt, _alternating_messages, parse_mixture_spec
from .held_out import evaluated_texts, normalised

SELF_SOURCE = "self"
STANDALONE_SOURCE = "sharegpt_standalone"
SOURCES = (STANDALONE_SOURCE, SELF_SOURCE, "sharegpt", "sharegpt_turns", "sharegpt_tail", "sharegpt_tail_turns")


def sharegpt_positions() -> Iterator[tuple[int, dict]]:
    """`(position, record)` of ShareGPT's training records: below the held-out band, then the tail."""
    for position, record in assets.iter_sharegpt(0):
        if position >= assets.SHAREGPT_HELDOUT_POSITION:
            break
        yield position, record
    yield from assets.iter_sharegpt(assets.SHAREGPT_TAIL_POSITION)


def standalone_turn_prompts(min_chars: int = 16) -> Iterator[Prompt]:
    """ShareGPT's later human turns of at least `min_chars` characters, each a one-turn chat, but those that
    evaluation asks (`held_out.evaluated_texts`); id `"{record id}@{position}#{turn index}/alone"`."""
    evaluated = evaluated_texts()
    for position, record in sharegpt_positions():
        messages = _alternating_messages(record.get("conversations") or [])
        for index in range(2, len(messages or []), 2):
            text = messages[index]["content"]
            if len(text) >= min_chars and normalised(text) not in evaluated:
                yield Prompt(id=f"{record.get('id')}@{position}#{index}/alone",
                             messages=[{"role": "user", "content": text}], source=STANDALONE_SOURCE)


class QuestionFilter:
    """Keeps a written question when it is `min_chars` to `max_chars` long, at least `min_letters` of its
    characters are letters, digits, spaces or common punctuation, and it is neither a duplicate of a kept one
    (after lower-casing and collapsing non-word characters) nor a near-duplicate: `shingles`-word shingles whose
    estimated Jaccard similarity to a kept question's is `near` or more (MinHash, `bands` x `rows` hashes, LSH)."""

    def __init__(self, min_chars: int = 16, max_chars: int = 2000, min_letters: float = 0.8, near: float = 0.7,
                 shingles: int = 3, bands: int = 16, rows: int = 4):
        self.min_chars, self.max_chars, self.min_letters, self.near = min_chars, max_chars, min_letters, near
        self.shingles, self.bands, self.rows = shingles, bands, rows
        self.exact: set[str] = set()
        self.buckets: list[dict[tuple, list[frozenset]]] = [{} for _ in range(bands)]
        self.refused = {"length": 0, "letters": 0, "duplicate": 0, "near-duplicate": 0}

    def keep(self, text: str) -> bool:
        """True (and remembered) if `text` passes; else False, counted in `refused` by reason."""
        text = text.strip()
        if not self.min_chars <= len(text) <= self.max_chars:
            self.refused["length"] += 1
            return False
        plain = sum(c.isalnum() or c.isspace() or c in ".,;:!?'\"()-" for c in text)
        if plain < self.min_letters * len(text) or not re.search(r"[A-Za-z]", text):
            self.refused["letters"] += 1
            return False
        words = re.findall(r"\w+", text.lower())
        normal = " ".join(words)
        if normal in self.exact:
            self.refused["duplicate"] += 1
            return False
        grams = frozenset(" ".join(words[i:i + self.shingles]) for i in range(max(1, len(words) - self.shingles + 1)))
        signature = self._minhash(grams)
        keys = [tuple(signature[b * self.rows:(b + 1) * self.rows]) for b in range(self.bands)]
        for band, key in enumerate(keys):
            for other in self.buckets[band].get(key, ()):
                if len(grams & other) >= self.near * len(grams | other):
                    self.refused["near-duplicate"] += 1
                    return False
        self.exact.add(normal)
        for band, key in enumerate(keys):
            self.buckets[band].setdefault(key, []).append(grams)
        return True

    def _minhash(self, grams: frozenset) -> list[int]:
        """`bands * rows` MinHash values of `grams`: per hash `(a * h + b) mod (2^61 - 1)`, the minimum."""
        prime = (1 << 61) - 1
        hashes = [int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") for g in grams]
        return [min((a * h + b) % prime for h in hashes) for a, b in _MINHASH_PARAMETERS[: self.bands * self.rows]]


_MINHASH_PARAMETERS = [(int.from_bytes(hashlib.blake2b(f"a{i}".encode(), digest_size=8).digest(), "little") | 1,
                        int.from_bytes(hashlib.blake2b(f"b{i}".encode(), digest_size=8).digest(), "little"))
                       for i in range(256)]


def _user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where the user's text begins (system turn included, as the template
    writes it by default)."""
    sentinel = "\u2063QUESTION\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    if sentinel not in text:
        raise ValueError("the tokenizer's chat template does not write the user's text as given: it cannot be asked "
                         "to write questions")
    return list(tokenizer(text[: text.index(sentinel)], add_special_tokens=False)["input_ids"])


def self_prompts(target, tokenizer, eos_ids: list[int], seed: int = 0, slots: int = 32, max_question_tokens: int = 128,
                 temperature: float = 1.0, chunk: int | None = None, question_filter: QuestionFilter | None = None,
                 start: int = 0) -> Iterator[Prompt]:
    """Questions the target writes itself (sampled at `temperature` after its chat template's user-turn prefix,
    `chunk` at a time (default two per row) on `slots` rows), kept by `question_filter`; ids `"self:{seed}:{n}"`
    for the `n`-th question written (from `start`: a resumed run skips ahead by draw; draws are seeded per chunk),
    source `self`.
    Questions that do not end their turn within `max_question_tokens` are dropped (cut mid-sentence)."""
    prefix = _user_turn_prefix(tokenizer)
    kept = question_filter or QuestionFilter()
    chunk = chunk or 2 * slots
    n = start - start % chunk
    while True:
        config = AnswerConfig(slots=slots, max_new_tokens=max_question_tokens, max_prompt_tokens=len(prefix),
                              do_sample=True, temperature=temperature, seed=seed * 1_000_003 + n, spare=64)
        written = AnswerGenerator(target, eos_ids, config).run((n + i, prefix) for i in range(chunk))
        for answer in sorted(written, key=lambda a: a.key):
            if answer.key < start or answer.response_ids[-1] not in eos_ids:
                continue
            text = tokenizer.decode(answer.response_ids[:-1], skip_special_tokens=True)
            if kept.keep(text):
                yield Prompt(id=f"self:{seed}:{answer.key}", messages=[{"role": "user", "content": text.strip()}],
                             source=SELF_SOURCE)
        n += chunk


def prompt_source(name: str, **self_kwargs) -> Iterator[Prompt]:
    """The prompts of source `name` (`SOURCES`, or a .jsonl path), lazily; `self_kwargs` go to `self_prompts`."""
    if name == STANDALONE_SOURCE:
        return standalone_turn_prompts()
    if name == SELF_SOURCE:
        return self_prompts(**self_kwargs)
    entry = parse_mixture_spec(f"{name}:1")[0]
    return iter(entry.load())
