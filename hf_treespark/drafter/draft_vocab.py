"""Draft vocabularies: rank target token ids by frequency and restrict a drafter to the top of the ranking.

The drafter then proposes tokens from `S`, the `|S|` most frequent ids in the target's own outputs
the LM-head and Markov-head work per round shrink by `V / |S|`, and a round whose
next target token lies outside `S` simply commits the target's bonus token. Verification is on the
full vocabulary, so decoding stays lossless.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from ..records import json_records

ID_FIELDS = ("response_ids", "output_ids", "input_ids", "ids")
TEXT_FIELDS = ("response", "text", "output", "completion")


def count_token_ids(paths: Iterable[str | Path], tokenizer=None, vocab_size: int | None = None) -> Counter:
    """Token-id counts over JSONL files (`.jsonl`, or `.jsonl.gz` compressed, read as `treespark train` reads its
    data: `records.json_records`): each line's first id list (`response_ids`, `output_ids`, `input_ids`,
    `ids`) or, failing that, its first text field (`response`, `text`, ...) tokenised with `tokenizer` (no
    special tokens added).

    Raises `ValueError` naming the file and line it cannot read (not UTF-8, not JSON, no ids or text, ids that
    are not integers >= 0 or, given `vocab_size`, not below it), and naming a file that holds no token id at all
    (empty, or only empty lists): it cannot rank a vocabulary."""
    counts: Counter = Counter()
    for path in map(Path, paths):
        if not path.is_file():
            raise OSError(f"No such data file: {path}")
        found = 0
        for _, (_, ids) in json_records(path, lambda record: _record_token_ids(record, tokenizer, vocab_size)):
            counts.update(ids)
            found += len(ids)
        if not found:
            raise ValueError(f"{path}: no token ids in it (an empty file, or only empty id lists and texts): nothing "
                             "to rank a draft vocabulary by; give the target's outputs")
    return counts


def _record_token_ids(record: dict, tokenizer, vocab_size: int | None) -> list[int]:
    """One JSONL record's token ids (see `count_token_ids`); `ValueError` saying what is wrong with them."""
    key = next((k for k in ID_FIELDS if k in record), None)
    if key is None:
        text_key = next((k for k in TEXT_FIELDS if k in record), None)
        if text_key is None:
            raise ValueError(f"no token ids ({', '.join(ID_FIELDS)}) and no text ({', '.join(TEXT_FIELDS)})")
        if not isinstance(record[text_key], str):
            raise ValueError(f"{text_key!r} must be a string, got {type(record[text_key]).__name__}")
        if tokenizer is None:
            raise ValueError("a text record needs the target's tokenizer to count ids")
        return list(tokenizer(record[text_key], add_special_tokens=False)["input_ids"])
    ids = record[key]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{key!r}: token ids must be a list of integers >= 0 (true/false are not ids)")
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise ValueError(f"{key!r} holds token id {max(ids)}, outside the target's vocabulary [0, {vocab_size}): was "
                         "it tokenised for another model?")
    return ids


def rank_token_ids(counts: Counter, size: int, vocab_size: int, allowed: list[int] | None = None) -> list[int]:
    """The `size` most frequent ids (ties to the smaller id), padded when the data has fewer distinct ids.

    Every counted id must be below `vocab_size`. `allowed`: the drafter's current draft vocabulary (most
    useful first) when it is already restricted: only those ids can be kept, and padding follows their order.
    Without it, padding takes the smallest unseen ids.
    """
    limit = vocab_size if allowed is None else len(allowed)
    if not 0 < size <= limit:
        raise ValueError(f"draft vocabulary size {size} must lie in [1, {limit}]")
    bad = [i for i in counts if i >= vocab_size]
    if bad:
        raise ValueError(f"the data holds token id {max(bad)}, outside the target's vocabulary [0, {vocab_size}): "
                         "was it tokenised for another model?")
    pool = set(range(vocab_size)) if allowed is None else set(allowed)
    ranked = [i for i, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if i in pool][:size]
    seen = set(ranked)
    order = range(vocab_size) if allowed is None else allowed
    ranked += [i for i in order if i not in seen][: size - len(ranked)]
    return ranked


def coverage(counts: Counter, ids: Iterable[int]) -> float:
    """Fraction of counted tokens that lie in `ids`."""
    total = sum(counts.values())
    chosen = set(ids)
    return sum(n for i, n in counts.items() if i in chosen) / total if total else 0.0
