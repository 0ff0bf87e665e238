"""What `treespark datastore` indexes of a user's files: the target's outputs as token-id sequences.

The kind of each input is told by its name, then by each JSONL record's fields:

- `.txt`: plain UTF-8 text; the whole file is one sequence, tokenised with the target's tokenizer (no special
  tokens added).
- JSONL (`.jsonl`, or `.jsonl.gz` compressed) records with `prompt_ids` and `response_ids` (a regeneration file,
  what `treespark train --data` reads): the response, after the last `HEADER_TOKENS` tokens of its prompt.
- JSONL chat records, `messages` (a list of role/content) or `conversations` (ShareGPT from/value): every
  assistant turn, as the target's chat template lays it out after the conversation before it (its end-of-turn
  token included), after the last `HEADER_TOKENS` tokens of that templated prompt (the assistant header). System
  and user turns are context only: the store holds what the assistant answered, which should be the target.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..datastore import HEADER_TOKENS
from .data import _chat_to_messages, _int_list, json_records

ID_FIELDS = ("prompt_ids", "response_ids")
CHAT_FIELDS = ("messages", "conversations")
SOURCES = ("responses", "assistant turns", "text files")  # what `read_outputs` counts


def read_outputs(paths: list[str | Path], vocab_size: int, load_tokenizer: Callable[[], object]
                 ) -> tuple[list[list[int]], Counter]:
    """`(sequences, counts)`: what the datastore indexes of each file (see the module docstring), and how many
    `responses` (id records), `assistant turns` and `text files` they came from. `load_tokenizer()` is called once,
    when a text file or chat record first needs it.

    Raises `OSError` for a missing file and `ValueError` naming the file (and line) of anything it cannot read:
    not UTF-8, not JSON, a record of no known shape, a conversation without an assistant turn, or token ids outside
    `[0, vocab_size)` (for text, a tokenizer of another target)."""
    tokenizer = None

    def get_tokenizer():
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = load_tokenizer()
        return tokenizer

    for path in paths:  # all there before any is read
        if not Path(path).is_file():
            raise OSError(f"--data {str(path)!r}: no such file")
    sequences: list[list[int]] = []
    counts: Counter = Counter()
    for path in map(Path, paths):
        if path.suffix == ".txt":
            sequences.append(_text_file(path, get_tokenizer(), vocab_size))
            counts["text files"] += 1
            continue
        for _, (_, (kind, found)) in json_records(path, lambda record: _record(record, get_tokenizer, vocab_size)):
            sequences += found
            counts[kind] += len(found)
    return sequences, counts


def describe(counts: Counter) -> str:
    """`read_outputs`'s counts in words: "2 responses, 1 text file"."""
    return ", ".join(f"{counts[kind]} {kind[:-1] if counts[kind] == 1 else kind}" for kind in SOURCES
                     if counts[kind]) or "nothing new"


def _text_file(path: Path, tokenizer, vocab_size: int) -> list[int]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start + 1}); save the file as UTF-8") from None
    if not text.strip():
        raise ValueError(f"{path}: no text in it; give the target's outputs")
    try:
        return _in_vocabulary(tokenizer(text, add_special_tokens=False)["input_ids"], vocab_size)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _record(record: dict, get_tokenizer: Callable[[], object], vocab_size: int) -> tuple[str, list[list[int]]]:
    """One JSONL record: `("responses", [its response])` or `("assistant turns", [one per turn])`."""
    if "response_ids" in record or "prompt_ids" in record:
        prompt_ids, response_ids = (_int_list(record, key, vocab_size) for key in ID_FIELDS)
        return "responses", [prompt_ids[-HEADER_TOKENS:] + response_ids] if response_ids else []
    pairs = chat_turn_pairs(record, get_tokenizer, "nothing of the target's to index")
    turns = [prompt[-HEADER_TOKENS:] + turn for prompt, turn in pairs]
    return "assistant turns", [_in_vocabulary(ids, vocab_size) for ids in turns]


def chat_turn_pairs(record: dict, get_tokenizer: Callable[[], object], why: str
                    ) -> list[tuple[list[int], list[int]]]:
    """`assistant_turn_pairs` of a chat record (`messages` or `conversations`). Raises `ValueError` for a record of
    neither field, a conversation without an assistant turn (`why` says what is then missing), a tokenizer without
    a chat template, or a template that refuses the conversation."""
    field = next((key for key in CHAT_FIELDS if key in record), None)
    if field is None:
        raise ValueError(f"a record needs {' and '.join(ID_FIELDS)} (token ids) or {' / '.join(CHAT_FIELDS)} (a "
                         f"chat); it has {', '.join(sorted(record)) or 'no fields'}")
    messages = _chat_to_messages(record[field])
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"the conversation has no assistant turn: {why}")
    tokenizer = get_tokenizer()
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat record, but the target's tokenizer has no chat template: give --target a chat "
                         "model, or the text as a .txt file or token ids")
    try:
        return assistant_turn_pairs(tokenizer, messages)
    except Exception as err:  # a Jinja template's own refusal, e.g. roles that do not alternate
        raise ValueError(f"the target's chat template refused the conversation ({err})") from None


def assistant_turn_pairs(tokenizer, messages: list[dict[str, str]]) -> list[tuple[list[int], list[int]]]:
    """`(prompt, turn)` for each assistant turn of `messages`: the templated conversation before it (with the
    generation prompt), then the turn up to its first EOS, kept. A template that rewrites earlier turns (so the turn
    is not a continuation of its prompt) gets the turn's text tokenised alone, then EOS."""
    eos = tokenizer.eos_token_id
    template = lambda turns, open_turn: list(tokenizer.apply_chat_template(  # noqa: E731
        turns, add_generation_prompt=open_turn, tokenize=True, return_dict=False))
    pairs = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template(messages[:k], True) if k else []
        full = template(messages[: k + 1], False)
        if k and full[: len(prompt)] == prompt:
            turn = full[len(prompt):]
            turn = turn[: turn.index(eos) + 1] if eos in turn else turn
        else:
            turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + ([eos] if eos is not None
                                                                                          else [])
        pairs.append((prompt, list(turn)))
    return pairs


def _in_vocabulary(ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"the tokenizer of --target gave token id {bad}, outside the vocabulary [0, {vocab_size}) of "
                         "the store: give --target the target the drafter was made for (or --vocab-size)")
    return list(ids)


def store_vocab_size(vocab_size: int | None, config_path: Path) -> int:
    """The store's vocabulary: `--vocab-size`, else the `target_vocab_size` of the `--output` drafter's
    `config_path`, else the shipped drafter's."""
    from ..assets import DEFAULT_DRAFTER_DIR

    if vocab_size is not None:
        return vocab_size
    if not config_path.is_file():
        config_path = DEFAULT_DRAFTER_DIR / "config.json"
    try:
        return int(json.loads(config_path.read_text(encoding="utf-8"))["target_vocab_size"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{config_path} is not a drafter config ({err!r}); give --vocab-size") from None


def load_tokenizer(target: str | None):
    """The tokenizer of `--target` (default: the offline default target's)."""
    from transformers import AutoTokenizer

    from .. import assets

    if not target:
        return AutoTokenizer.from_pretrained(assets.default_target_path())
    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise OSError(f"--target {target!r}: no tokenizer loads from it ({err}); give the target model's name or "
                      "directory") from None
