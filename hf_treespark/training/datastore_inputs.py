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
  A turn's content is a string or a list of text parts (`data.message_text`); a null content refuses the record.

A file is known by its content: one given twice (or a copy of one given before) is read once, and one already in
the store (`Datastore.sources`, an `--append` of it again) is skipped, both said (`Outputs.skipped`).

The tokenizer must be the drafter's target's (`check_tokenizer`): it is refused, naming both, when its name or its
size says otherwise, and when the store it is added to was built with another one (their fingerprints differ).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..sources.datastore import (
    DATASTORE_FILE,
    HEADER_TOKENS,
    describe_tokenizer,
    tokenizer_identity,
    tokenizer_mismatch,
)
from .data import _chat_to_messages, _int_list, json_records

ID_FIELDS = ("prompt_ids", "response_ids")
CHAT_FIELDS = ("messages", "conversations")
SOURCES = ("responses", "assistant turns", "text files")  # what `read_outputs` counts


@dataclass
class Outputs:
    """What `read_outputs` read: the `sequences` to index and `counts` of what they came from (`SOURCES`), the
    content hash of each file read (`sources`), the files `skipped` ("path: why"), and `tokenizer`, the
    `tokenizer_identity` of the tokenizer that tokenised text or chats (None when none was needed)."""

    sequences: list[list[int]] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    sources: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    tokenizer: dict | None = None


def read_outputs(paths: list[str | Path], vocab_size: int, load_tokenizer: Callable[[], object],
                 indexed: Collection[str] = (), check_tokenizer: Callable[[dict], None] | None = None) -> Outputs:
    """What the datastore indexes of each file (see the module docstring), as `Outputs`. `load_tokenizer()` is
    called once, when a text file or chat record first needs it; `check_tokenizer(identity)` is then given its
    `tokenizer_identity` and raises to refuse it. A file whose content hash is in `indexed` (a store's `sources`),
    or equal to one read before it, is skipped.

    Raises `OSError` for a missing file and `ValueError` naming the file (and line) of anything it cannot read:
    not UTF-8, not JSON, a record of no known shape, a conversation without an assistant turn, or token ids outside
    `[0, vocab_size)` (for text, a tokenizer of another target)."""
    out, tokenizer, indexed = Outputs(), None, set(indexed)

    def get_tokenizer():
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = load_tokenizer()
            out.tokenizer = tokenizer_identity(tokenizer)
            if check_tokenizer is not None:
                check_tokenizer(out.tokenizer)
        return tokenizer

    for path in paths:  # all there before any is read
        if not Path(path).is_file():
            raise OSError(f"--data {str(path)!r}: no such file")
    first: dict[str, Path] = {}
    for path in map(Path, paths):
        digest = content_hash(path)
        if digest in indexed or digest in first:
            why = ("already in the store, indexed by an earlier run" if digest in indexed else
                   "given twice" if first[digest].resolve() == path.resolve() else
                   f"the same content as {first[digest]}")
            out.skipped.append(f"{path}: {why}")
            continue
        first[digest] = path
        out.sources.append(digest)
        if path.suffix == ".txt":
            out.sequences.append(_text_file(path, get_tokenizer(), vocab_size))
            out.counts["text files"] += 1
            continue
        for _, (_, (kind, found)) in json_records(path, lambda record: _record(record, get_tokenizer, vocab_size)):
            out.sequences += found
            out.counts[kind] += len(found)
    return out


def content_hash(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex: what tells a file given again, under any name."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


@dataclass(frozen=True)
class DrafterTarget:
    """The target a drafter's `config` (its config.json) was made for: `name` (`target_name_or_path`, None when it
    records none) and `vocab_size` (`target_vocab_size`)."""

    name: str | None
    vocab_size: int
    config: Path


def drafter_target(vocab_size: int | None, config_path: Path) -> DrafterTarget | None:
    """The drafter a store is built for: the `--output` drafter's `config_path`, else (without `--vocab-size`) the
    shipped drafter's; None for a store of `--vocab-size` alone. Raises `ValueError` naming a config that is not a
    drafter's, unless `--vocab-size` is given (then it is not needed)."""
    from ..hub.assets import DEFAULT_DRAFTER_DIR

    if not config_path.is_file():
        if vocab_size is not None:
            return None
        config_path = DEFAULT_DRAFTER_DIR / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        return DrafterTarget(config.get("target_name_or_path") or None, int(config["target_vocab_size"]), config_path)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        if vocab_size is not None:
            return None
        raise ValueError(f"{config_path} is not a drafter config ({err!r}); give --vocab-size") from None


def check_tokenizer(identity: dict, drafter: DrafterTarget | None, store=None) -> None:
    """Refuse (`ValueError` naming both) a tokenizer, given as its `tokenizer_identity`, that is not the one of the
    `drafter`'s target: more ids than its vocabulary, or another model's name (compared by the last part of the
    name or path, case aside; a drafter or tokenizer without one is not compared by name). Given the `store` it is
    added to (a `Datastore`), refuse one whose fingerprint differs from the tokenizer the store was built with."""
    mismatch = tokenizer_mismatch(getattr(store, "tokenizer", None), identity)
    if mismatch is not None:
        raise ValueError(f"--output's datastore {mismatch}: give --target the model it was built with, or --force "
                         "to replace it; nothing was written")
    if drafter is None:
        return
    size, name = identity.get("size"), identity.get("name_or_path")
    too_big = size is not None and size > drafter.vocab_size
    other_name = bool(drafter.name and name) and _model_name(drafter.name) != _model_name(name)
    if not (too_big or other_name):
        return
    from ..hub.assets import DEFAULT_DRAFTER_DIR

    shipped = drafter.config == DEFAULT_DRAFTER_DIR / "config.json"
    made_for = (f"{drafter.name} ({drafter.vocab_size} ids)" if drafter.name else
                f"a target of {drafter.vocab_size} ids (its config names none)")
    fix = f"give --target {drafter.name or 'the model the drafter was made for'}"
    if shipped:
        fix += f", or --vocab-size {size or 'N'} to build a store of this target's alone"
    elif other_name and not too_big:
        fix += f" (or, if --target is that model under another name, set target_name_or_path in {drafter.config})"
    raise ValueError(f"--target's tokenizer is {describe_tokenizer(identity)}, but "
                     f"{'the shipped drafter' if shipped else f'the drafter at {drafter.config.parent}'} was made for "
                     f"{made_for}: {fix}; nothing was written")


def _model_name(name_or_path: str) -> str:
    """The model's name in `name_or_path`, as a Hub id and local copies share it: `org/Model-1B` and
    `/models/model-1b/` both give `model-1b`."""
    return Path(name_or_path.rstrip("/\\")).name.lower()


@contextlib.contextmanager
def removing_created_folders(output: Path) -> Iterator[None]:
    """Run the block; when it raises, remove the folders it created on the way to `output` (they were missing
    before: never one that was there), with the datastore file it may have left in them, and raise again."""
    created = None
    for folder in (output, *output.parents):
        if folder.exists():
            break
        created = folder
    try:
        yield
    except BaseException:
        if created is not None:
            for leftover in (output / DATASTORE_FILE, output / (DATASTORE_FILE + ".tmp")):
                leftover.unlink(missing_ok=True)
            for folder in (output, *output.parents):
                with contextlib.suppress(OSError):  # a folder something else wrote into is left
                    folder.rmdir()
                if folder == created:
                    break
        raise


def load_tokenizer(target: str | None):
    """The tokenizer of `--target` (default: the offline default target's)."""
    from transformers import AutoTokenizer

    from ..hub import assets

    if not target:
        return AutoTokenizer.from_pretrained(assets.default_target_path())
    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise OSError(f"--target {target!r}: no tokenizer loads from it ({err}); give the target model's name or "
                      "directory") from None
