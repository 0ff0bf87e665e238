"""What `treespark train --data` reads: regeneration files, and any text (chats, plain text) as reference sequences.

The kind of each file is told by its name, then by each JSONL record's fields (as `treespark datastore` tells them):

- JSONL (`.jsonl`, `.jsonl.gz`) records with `prompt_ids` and `response_ids`, a regeneration file: the prompt, then
  the response, cut to `max_length` (`data.load_references`, unchanged).
- JSONL chat records, `messages` (role/content) or `conversations` (ShareGPT from/value): one reference per assistant
  turn, its prompt the conversation before it in the target's chat template (with the assistant header), its
  response the turn up to its end-of-turn token. A prompt too long for `max_length` keeps its last tokens (at least
  the assistant header), so the turn fills the rest.
- `.txt`: plain UTF-8 text, tokenised without special tokens and cut into consecutive windows of `max_length`
  tokens; every position but a window's first is a response position (text has no turns).

What a text trains the drafter towards is `labels` (`TrainConfig.labels`): the distribution terms (`L1`, confidence,
survival, coverage) always compare with the target's own teacher-forced distribution at each position; `L_ce` takes
the text's next token (`"text"`) or the target's most likely token there (`"target"`: distilled, for text the
target did not write; on its own greedy answers the two are the same).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ..records import json_records
from ..sources.datastore import HEADER_TOKENS
from .data import ReferenceSequence, _int_list
from .datastore_inputs import ID_FIELDS, chat_turn_pairs

logger = logging.getLogger(__name__)

LABELS_HELP = ("the label of L_ce at each position: 'text', the next token of the given sequence (on the target's "
               "own regenerated answers, its greedy choice), or 'target', the target's own most likely token at that "
               "position, teacher-forced on the given text (distilled: for chats and text the target did not write). "
               "The other losses always compare with the target's distribution there")


def load_training_data(paths: list[str | Path], get_tokenizer: Callable[[], object], max_length: int = 1024,
                       limit: int | None = None, vocab_size: int | None = None) -> list[ReferenceSequence]:
    """The reference sequences of every file (see the module docstring), in order, at most `limit`.
    `get_tokenizer()` is called when a chat or a text first needs the target's tokenizer. A sequence with fewer
    than 2 response tokens within `max_length` is dropped, with a warning per file.

    Raises `OSError` for a missing file and `ValueError` naming the file (and line) of what it cannot read: not UTF-8,
    not JSON, a record of no known shape, a chat without an assistant turn, token ids outside the vocabulary."""
    for path in paths:
        if not Path(path).is_file():
            raise OSError(f"--data {str(path)!r}: no such file")
    if limit is not None and limit <= 0:
        return []
    sequences: list[ReferenceSequence] = []
    for path in map(Path, paths):
        if path.suffix == ".txt":
            sequences += text_windows(path, get_tokenizer(), max_length, vocab_size)
        else:
            sequences += _json_references(path, get_tokenizer, max_length, vocab_size,
                                          None if limit is None else limit - len(sequences))
        if limit is not None and len(sequences) >= limit:
            return sequences[:limit]
    return sequences


def _json_references(path: Path, get_tokenizer: Callable[[], object], max_length: int, vocab_size: int | None,
                     limit: int | None) -> list[ReferenceSequence]:
    """A JSONL file's references, record by record: a regeneration record cut as `data.load_references` cuts it
    (`(prompt + response)[:max_length]`), a chat's turns after as much of their prompt as the window leaves."""
    out, dropped = [], 0
    parse = lambda record: _record_pairs(record, get_tokenizer, vocab_size)  # noqa: E731
    for line_no, (record, (kind, pairs)) in json_records(path, parse):
        for k, (prompt, response) in enumerate(pairs):
            if kind == "ids":
                keep, rid = len(prompt), str(record.get("id", f"{path.stem}:{line_no}"))
            else:  # the turn fills what the window leaves; the prompt keeps at least the assistant header
                keep, rid = max(HEADER_TOKENS, max_length - len(response)), f"{path.name}:{line_no}#{k}"
            prompt_len = min(len(prompt), keep)
            input_ids = (prompt[len(prompt) - prompt_len:] + response)[:max_length]
            if len(input_ids) - prompt_len < 2:
                dropped += 1
                continue
            out.append(ReferenceSequence(id=rid, input_ids=input_ids, prompt_len=prompt_len))
            if limit is not None and len(out) >= limit:
                return out
    if dropped:
        logger.warning("%s: %d sequence(s) dropped: fewer than 2 response tokens within max_length=%d", path, dropped,
                       max_length)
    return out


def _record_pairs(record: dict, get_tokenizer: Callable[[], object], vocab_size: int | None
                  ) -> tuple[str, list[tuple[list[int], list[int]]]]:
    """`("ids", [(prompt_ids, response_ids)])` of a regeneration record, `("chat", [(prompt, turn), ...])` of a chat."""
    if any(key in record for key in ID_FIELDS):
        return "ids", [tuple(_int_list(record, key, vocab_size) for key in ID_FIELDS)]
    pairs = chat_turn_pairs(record, get_tokenizer, "nothing to train the drafter on")
    for prompt, turn in pairs:
        _check_vocabulary(prompt + turn, vocab_size, "the chat")
    return "chat", pairs


def text_windows(path: Path, tokenizer, max_length: int, vocab_size: int | None = None) -> list[ReferenceSequence]:
    """A `.txt` file's consecutive windows of `max_length` tokens, each its own sequence with `prompt_len` 1 (a
    window's first token has no context to draft from); a last window under 3 tokens is dropped."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start + 1}); save the file as UTF-8") from None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    _check_vocabulary(ids, vocab_size, path)
    windows = [ids[start:start + max_length] for start in range(0, len(ids), max_length)]
    out = [ReferenceSequence(id=f"{path.name}#{w}", input_ids=window, prompt_len=1)
           for w, window in enumerate(windows) if len(window) >= 3]
    if not out:
        raise ValueError(f"{path}: fewer than 3 tokens of text; give more text")
    return out


def _check_vocabulary(ids: list[int], vocab_size: int | None, where) -> None:
    if vocab_size is None:
        return
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where}: the tokenizer of --target gave token id {bad}, outside the target's vocabulary "
                         f"(0..{vocab_size - 1}): give --target the model the drafter is for")

