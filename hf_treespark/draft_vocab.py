"""Draft vocabularies: rank target token ids by frequency and restrict a drafter to the top of the ranking.

The drafter then proposes tokens from `S`, the `|S|` most frequent ids in the target's own outputs
(SPEC section 2b): the LM-head and Markov-head work per round shrink by `V / |S|`, and a round whose
next target token lies outside `S` simply commits the target's bonus token. Verification is on the
full vocabulary, so decoding stays lossless.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

ID_FIELDS = ("response_ids", "output_ids", "input_ids", "ids")
TEXT_FIELDS = ("response", "text", "output", "completion")


def count_token_ids(paths: Iterable[str | Path], tokenizer=None) -> Counter:
    """Token-id counts over JSONL files: each line's first id list (`response_ids`, `output_ids`,
    `input_ids`, `ids`) or, failing that, its first text field (`response`, `text`, ...) tokenised with
    `tokenizer` (no special tokens added). Raises `ValueError` naming the file and line it cannot read."""
    counts: Counter = Counter()
    for path in map(Path, paths):
        if not path.is_file():
            raise OSError(f"No such data file: {path}")
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from None
                ids = next((record[k] for k in ID_FIELDS if isinstance(record, dict) and k in record), None)
                if ids is None:
                    text = next((record[k] for k in TEXT_FIELDS if isinstance(record, dict) and k in record), None)
                    if text is None:
                        raise ValueError(f"{path}:{number}: no token ids ({', '.join(ID_FIELDS)}) and no text "
                                         f"({', '.join(TEXT_FIELDS)})")
                    if tokenizer is None:
                        raise ValueError(f"{path}:{number}: a text record needs the target's tokenizer to count ids")
                    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise ValueError(f"{path}:{number}: token ids must be non-negative integers")
                counts.update(ids)
    return counts


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
