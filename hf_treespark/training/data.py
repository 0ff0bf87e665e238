"""The data side of drafter training: prompts, regenerated references, and batches of reference sequences.

Three steps (docs/method.md, training):

1. **Prompts** from ShareGPT, JSONL files or `datasets` datasets, optionally mixed with weights
   (`mix_prompts`, `parse_mixture("sharegpt:0.6,code.jsonl:0.4")`).
2. **Regeneration**: the target answers every prompt in its deployed decoding mode (greedy by default), so the
   drafter learns the target's own continuations. Output is a JSONL file, one line per prompt, in the format of
   the files in `training_data/` (its README); runs resume where an interrupted one stopped.
3. **References**: `prompt_ids + response_ids` per line, truncated, served by `ReferenceDataset` and batched by
   `collate_references`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..hub.assets import sharegpt_first_turns
from ..records import json_records
from .held_out import asks_evaluated, evaluated_texts, normalised

logger = logging.getLogger(__name__)
SHAREGPT_MIXTURE_SOURCES = ("sharegpt", "sharegpt_turns", "sharegpt_tail", "sharegpt_tail_turns")  # mixture names

# ShareGPT speakers -> chat roles. ShareGPT V3 names the model "gpt" mostly, "chatgpt"/"bing"/"bard" sometimes.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Prompt:
    """One training prompt: a chat ending in the turn the target should answer."""

    id: str
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]
    source: str

    @property
    def text(self) -> str:
        """The last user turn's text."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


# ----- record shapes -----------------------------------------------------------------------------------------


def message_text(content, turn: int) -> str:
    """The text of turn `turn` (from 1) of a chat record: its `content` (ShareGPT: `value`), a string (returned as it
    is) or a list of parts (OpenAI-style; transformers' chat templates): the `text` of the parts of type "text" (or
    of no type), joined by newlines; images and other parts are left out. Raises `ValueError` naming the turn for
    null content (the record is refused, as any unreadable record is) and for content of any other kind."""
    if isinstance(content, str):
        return content
    if content is None:
        raise ValueError(f"message {turn} has no content (null): give the turn's text, or leave the record out")
    if not isinstance(content, list):
        raise ValueError(f"message {turn}'s content is {content!r:.40}, not text or a list of text parts")
    texts = []
    for k, part in enumerate(content, start=1):
        text = part.get("text") if isinstance(part, dict) else part
        if isinstance(part, dict) and part.get("type") not in (None, "text") or text is None:
            continue  # an image, or another part without text
        if not isinstance(part, dict) or not isinstance(text, str):
            raise ValueError(f"message {turn}'s content part {k} is {part!r:.40}, not a text part such as "
                             '{"type": "text", "text": "..."}')
        texts.append(text)
    return "\n".join(texts)


def _sharegpt_turns_to_messages(turns: list) -> list[dict[str, str]]:
    messages = []
    for k, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise ValueError(f"a ShareGPT turn needs 'from' and 'value', got {turn!r:.80}")
        role = _SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise ValueError(f"unknown ShareGPT speaker {turn['from']!r} (known: {sorted(_SHAREGPT_ROLES)})")
        messages.append({"role": role, "content": message_text(turn["value"], k)})
    return messages


def _chat_to_messages(value) -> list[dict[str, str]]:
    """A string prompt, a list of {role, content} or a list of ShareGPT {from, value} -> messages, each turn's
    content as its text (`message_text`). Raises `ValueError` for any other shape."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError(f"expected a string or a list of turns, got {type(value).__name__}")
    if value and isinstance(value[0], dict) and "from" in value[0]:
        return _sharegpt_turns_to_messages(value)
    messages = []
    for k, m in enumerate(value, start=1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"a message needs 'role' and 'content', got {m!r:.80}")
        messages.append({"role": str(m["role"]), "content": message_text(m["content"], k)})
    return messages


def _record_to_messages(record: dict, field: str | None = None) -> list[dict[str, str]]:
    """The prompt of one record: everything up to, not including, a final assistant turn.

    Shapes (first match wins unless `field` names one): `messages` (list of {role, content}),
    `conversations` (ShareGPT {from, value}), `prompt` (a string).
    """
    if field is not None:
        if field not in record:
            raise ValueError(f"record has no field {field!r} (fields: {sorted(record)})")
        messages = _chat_to_messages(record[field])
    elif "messages" in record:
        messages = _chat_to_messages(record["messages"])
    elif "conversations" in record:
        messages = _sharegpt_turns_to_messages(record["conversations"])
    elif "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ValueError(f"'prompt' must be a string, got {type(record['prompt']).__name__}")
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError(f"record has none of 'messages', 'conversations', 'prompt' (fields: {sorted(record)})")
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("the conversation has no user turn before its final assistant turn")
    return messages


# ----- prompt sources ----------------------------------------------------------------------------------------


def sharegpt_chat_prompts(split: str = "train", limit: int | None = None, min_chars: int = 16) -> list[Prompt]:
    """ShareGPT V3's first human turns (`assets.sharegpt_first_turns`) as chat `Prompt`s, as in
    `training_data/README.md`. ShareGPT ids repeat (123 do in the 17,671 complete records), so a prompt's id is
    `"{record id}@{position}"`. `split="train"`: file positions < 12,000; `"heldout"`: 12,000 to 13,999
    (evaluation); `"tail"`: 14,000 on (training data beyond the held-out band, `assets.SHAREGPT_TAIL_POSITION`). The
    training splits leave out a text evaluation reads (`held_out.evaluated_texts`), `limit` counting what is kept.
    """
    turns = sharegpt_first_turns(split, limit if split == "heldout" else None, min_chars)
    evaluated = frozenset() if split == "heldout" else evaluated_texts()
    return [Prompt(id=f"{rid}@{position}", messages=[{"role": "user", "content": text}], source="sharegpt")
            for rid, position, text in turns if normalised(text) not in evaluated][:limit]


def sharegpt_later_turn_prompts(limit: int | None = None, min_chars: int = 16, split: str = "train") -> list[Prompt]:
    """ShareGPT V3's second and later human turns, each with the conversation before it, from the training
    records only (file positions < 12,000, or from 14,000 on with `split="tail"`; the held-out records are never
    read): more training prompts than the first turns alone, with ShareGPT's own assistant replies as the history.

    A prompt is the conversation up to and including one human turn of at least `min_chars` characters; its
    id is `"{record id}@{position}#{turn index}"` (the index in the record's `conversations`). Records whose
    turns do not alternate human / assistant from a human first turn, or that name an unknown speaker, are
    skipped whole (their later turns would answer something other than what the history shows), and so is a prompt
    with a turn that evaluation reads (`held_out.evaluated_texts`: ShareGPT repeats conversations).
    """
    from ..hub import assets

    if split not in ("train", "tail"):
        raise ValueError(f"split must be 'train' or 'tail', got {split!r}")
    start, source = (assets.SHAREGPT_TAIL_POSITION, "sharegpt_tail_turns") if split == "tail" else (0, "sharegpt_turns")
    prompts, evaluated = [], evaluated_texts()
    for position, record in assets.iter_sharegpt(start):
        if split == "train" and position >= assets.SHAREGPT_HELDOUT_POSITION:
            break
        messages = _alternating_messages(record.get("conversations") or [])
        for index in range(2, len(messages or []), 2):
            if len(messages[index]["content"]) >= min_chars and not asks_evaluated(messages[:index + 1], evaluated):
                prompts.append(Prompt(id=f"{record.get('id')}@{position}#{index}", messages=messages[:index + 1],
                                      source=source))
                if limit is not None and len(prompts) >= limit:
                    return prompts
    return prompts


def _alternating_messages(turns: list) -> list[dict[str, str]] | None:
    """A ShareGPT record's turns as messages, or None where they do not alternate human / assistant from a human
    first turn or name an unknown speaker (a bulk scan skips such a record; `_sharegpt_turns_to_messages` raises)."""
    try:
        messages = _sharegpt_turns_to_messages(turns)
    except ValueError:
        return None
    if not messages or any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(messages)):
        return None
    return messages


def jsonl_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file; each line has `messages`, `conversations` or `prompt` (see `_record_to_messages`).

    A line's id is its `id` field if it has one, else `"{file stem}:{line number}"`. Blank lines are skipped.
    Raises `ValueError` naming the file and line of a line that is not a JSON object of one of these shapes.
    """
    path = Path(path)
    prompts: list[Prompt] = []
    if limit is not None and limit <= 0:
        return prompts
    for line_no, (record, messages) in json_records(path, _record_to_messages):
        rid = str(record["id"]) if "id" in record else f"{path.stem}:{line_no}"
        prompts.append(Prompt(id=rid, messages=messages, source=str(path)))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def _load_hf_dataset(name_or_path: str | Path, split: str):
    try:
        import datasets
    except ImportError as e:
        raise ImportError("hf_dataset_prompts needs the `datasets` package: pip install datasets") from e
    path = Path(name_or_path)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(path))  # a directory written by `save_to_disk`
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    if path.is_file():  # a single data file: pick the builder from its extension
        builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
        suffix = path.suffix.lower()
        if suffix not in builders:
            raise ValueError(f"cannot load {path}: unknown data file type {suffix!r} (known: {sorted(builders)})")
        return datasets.load_dataset(builders[suffix], data_files=str(path), split=split)
    return datasets.load_dataset(str(name_or_path), split=split)  # a Hub name or a local data directory


def hf_dataset_prompts(name_or_path: str | Path, split: str = "train", limit: int | None = None,
                       messages_field: str | None = None) -> list[Prompt]:
    """Prompts from a `datasets` dataset: a Hub name, a local data directory or file, or a `save_to_disk` folder.

    Records have the shapes `jsonl_prompts` reads; `messages_field` names the column to use instead of
    detecting it (its value may be a string, {role, content} turns or ShareGPT {from, value} turns).
    A record's id is its `id` column if there is one, else `"{name}:{index}"`.
    """
    ds = _load_hf_dataset(name_or_path, split)
    name = str(name_or_path)
    prompts: list[Prompt] = []
    for index, record in enumerate(ds):
        if limit is not None and len(prompts) >= limit:
            break
        try:
            messages = _record_to_messages(dict(record), messages_field)
        except ValueError as e:
            raise ValueError(f"{name} [{split}] record {index}: {e}") from None
        rid = str(record["id"]) if record.get("id") is not None else f"{name}:{index}"
        prompts.append(Prompt(id=rid, messages=messages, source=f"hf:{name}"))
    return prompts


# ----- mixtures ----------------------------------------------------------------------------------------------


def _largest_remainder(weights: list[float], total: int) -> list[int]:
    """Integer counts summing to `total`, proportional to `weights` (Hamilton's method)."""
    quotas = [w * total for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mix_prompts(sources: list[tuple[list[Prompt], float]], total: int, seed: int = 0) -> list[Prompt]:
    """`total` prompts drawn from `sources` in proportion to their weights, in a seed-determined shuffled order.

    Weights are normalised; source `i` contributes `round(total * w_i)` prompts (largest-remainder rounding, so
    the counts add up to `total` exactly). A source is sampled without replacement up to its size. Only when it
    must give more than it has is it repeated, in whole shuffled passes plus a without-replacement remainder, so
    every prompt of an oversampled source appears `floor(n / size)` or `ceil(n / size)` times: the least-lumpy
    form of sampling with replacement. Repeats (and ids that collide across sources) get a `"#k"` suffix, so ids
    stay unique, which regeneration needs to resume by id. Deterministic for a given `seed`.
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if not sources:
        raise ValueError("mix_prompts needs at least one source")
    weights = [float(w) for _, w in sources]
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {weights}")
    counts = _largest_remainder([w / sum(weights) for w in weights], total)
    rng = random.Random(seed)
    mixed: list[Prompt] = []
    for (prompts, _), n in zip(sources, counts, strict=True):
        if n == 0:
            continue
        if not prompts:
            raise ValueError("a source with a positive weight has no prompts")
        passes, rest = divmod(n, len(prompts))
        for _ in range(passes):
            mixed.extend(rng.sample(prompts, len(prompts)))
        mixed.extend(rng.sample(prompts, rest))
    rng.shuffle(mixed)
    seen: dict[str, int] = {}
    out = []
    for p in mixed:
        k = seen.get(p.id, 0) + 1
        seen[p.id] = k
        out.append(p if k == 1 else Prompt(id=f"{p.id}#{k}", messages=p.messages, source=p.source))
    return out


@dataclass
class MixtureEntry:
    """One `SOURCE:WEIGHT` item of a mixture spec. `kind` is one of `SHAREGPT_MIXTURE_SOURCES`, "hf" or "jsonl"."""

    kind: str
    name: str
    weight: float

    def load(self, limit: int | None = None) -> list[Prompt]:
        if self.kind in SHAREGPT_MIXTURE_SOURCES:  # sharegpt[_tail][_turns]
            split = "tail" if "_tail" in self.kind else "train"
            if self.kind.endswith("_turns"):
                return sharegpt_later_turn_prompts(limit=limit, split=split)
            return sharegpt_chat_prompts(split, limit=limit)
        if self.kind == "hf":
            return hf_dataset_prompts(self.name, limit=limit)
        return jsonl_prompts(self.name, limit=limit)


def parse_mixture_spec(spec: str) -> list[MixtureEntry]:
    """Parse `"sharegpt:0.6,hf:org/name:0.2,path/to/code.jsonl:0.2"` without loading anything.

    `sharegpt` is the ShareGPT train split's first turns, `sharegpt_turns` its later turns with their history
    (`sharegpt_later_turn_prompts`), `sharegpt_tail` / `sharegpt_tail_turns` the same from the records beyond the
    held-out band (positions from 14,000 on), `hf:<name>` a `datasets` dataset, anything else a JSONL path (which
    must exist). Every item needs a weight (`:W`, finite, >= 0); at least one weight must be positive.
    """
    entries: list[MixtureEntry] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise ValueError(f"empty item in mixture spec {spec!r}")
        source, sep, weight_text = item.rpartition(":")
        if not sep or not source:
            raise ValueError(f"mixture item {item!r} must be SOURCE:WEIGHT, e.g. 'sharegpt:0.6'")
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(f"mixture item {item!r}: weight {weight_text!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mixture item {item!r}: weight must be finite and >= 0, got {weight_text!r}")
        if source in SHAREGPT_MIXTURE_SOURCES:
            entries.append(MixtureEntry(source, source, weight))
        elif source.startswith("hf:"):
            if not source[3:]:
                raise ValueError(f"mixture item {item!r}: 'hf:' needs a dataset name")
            entries.append(MixtureEntry("hf", source[3:], weight))
        else:
            if not Path(source).is_file():
                raise FileNotFoundError(f"mixture item {item!r}: no such JSONL file {source!r}")
            entries.append(MixtureEntry("jsonl", source, weight))
    if sum(e.weight for e in entries) <= 0:
        raise ValueError(f"mixture spec {spec!r} has no positive weight")
    return entries


def parse_mixture(spec: str, limit_per_source: int | None = None) -> list[tuple[list[Prompt], float]]:
    """Parse a CLI mixture spec (see `parse_mixture_spec`) and load each source: input for `mix_prompts`.

    The whole spec is validated before any source is loaded.
    """
    return [(entry.load(limit_per_source), entry.weight) for entry in parse_mixture_spec(spec)]


# ----- regeneration ------------------------------------------------------------------------------------------


def _scan_regenerated(out_path: Path) -> set[str]:
    """Ids already in `out_path`, after repairing what a crash mid-write can leave behind.

    Records are written whole lines at a time, so every newline-terminated line must parse (otherwise the file
    is corrupt: `ValueError` naming the line). Only the text after the last newline can be cut short: it is
    dropped if it does not parse, or given its missing newline if it does.
    """
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    *lines, tail = data.split(b"\n")
    done: set[str] = set()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            done.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{out_path}:{line_no}: malformed line in a regeneration file ({e!r:.120})") from None
    if tail.strip():
        try:
            done.add(str(json.loads(tail)["id"]))
            with open(out_path, "ab") as f:  # the record is whole, only its newline was never written
                f.write(b"\n")
        except (ValueError, KeyError, TypeError):
            logger.warning("%s: dropping a truncated last line (%d bytes) left by an interrupted run",
                           out_path, len(tail))
            with open(out_path, "r+b") as f:
                f.truncate(len(data) - len(tail))
    return done


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i: i + size]


def _eos_ids(target, tokenizer) -> list[int]:
    eos = getattr(target.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the target's generation config nor the tokenizer defines an EOS token")
    return sorted(ids)


@torch.inference_mode()
def regenerate_responses(target, tokenizer, prompts: Iterable[Prompt], out_path: str | Path, batch_size: int = 32,
                         max_new_tokens: int = 256, max_prompt_tokens: int = 384, do_sample: bool = False,
                         temperature: float = 1.0, progress: bool = True,
                         chat_template_kwargs: dict | None = None) -> Path:
    """The target's own responses to `prompts`, appended to `out_path` as JSONL; resumable.

    Each prompt is chat-templated (`add_generation_prompt=True`, plus `chat_template_kwargs`, e.g.
    `{"enable_thinking": False}` for Qwen3: training responses must come from the deployed mode); prompts longer
    than `max_prompt_tokens` are skipped. Batches are left-padded here, without touching the tokenizer's
    `padding_side` (pad id: `tokenizer.pad_token_id`, else EOS), decoded greedily unless `do_sample` (greedy is
    the deployed decoding mode), and each response is cut after its first EOS (the target's generation-config
    EOS ids and the tokenizer's), the EOS kept. One line per prompt: `{"id", "source", "prompt" (last user
    text), "prompt_ids", "response_ids", "response"}`, the format of `training_data/`'s files.

    Resuming: the file is flushed (and fsynced) after every batch, so a crash loses at most one batch; on the next
    call, ids already in the file are skipped and a half-written last line is dropped. Pending prompts are sorted
    by prompt length (ties: input order) so batches pad little. The order depends only on the pending set, and a
    crash leaves whole batches done (a prefix of that order), so a resumed run with the same `batch_size` forms
    exactly the batches the uninterrupted run would have formed: its output is the same, near-ties included.
    Lines appear in this length order, not input order; readers key on `id`.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _scan_regenerated(out_path)
    eos_ids = _eos_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    pending: list[tuple[Prompt, list[int]]] = []
    seen: set[str] = set()
    skipped = 0
    for prompt in prompts:
        if prompt.id in seen:
            raise ValueError(f"duplicate prompt id {prompt.id!r}: ids must be unique to resume by id")
        seen.add(prompt.id)
        if prompt.id in done:
            continue
        ids = list(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, **(chat_template_kwargs or {})))
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        pending.append((prompt, ids))
    if skipped:
        logger.warning("%s: skipping %d of %d prompts: longer than max_prompt_tokens=%d tokens after the chat "
                       "template", out_path, skipped, len(seen), max_prompt_tokens)
    if done & seen:
        logger.info("%s: %d of %d prompts already answered in this file (resumed)", out_path, len(done & seen),
                       len(seen))
    pending.sort(key=lambda item: len(item[1]))  # stable: equal lengths keep input order

    sampling = {"do_sample": True, "temperature": temperature} if do_sample else {"do_sample": False}
    device = target.device
    bar = tqdm(total=len(pending), disable=not progress, desc="regenerating", unit="prompt")
    try:
        with open(out_path, "a", encoding="utf-8") as f:
            for batch in _batches(pending, batch_size):
                width = max(len(ids) for _, ids in batch)
                input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for _, ids in batch], device=device)
                attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch],
                                              device=device)
                output = target.generate(input_ids=input_ids, attention_mask=attention_mask,
                                         max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids,
                                         **sampling)
                if not isinstance(output, torch.Tensor):  # return_dict_in_generate set in the generation config
                    output = output.sequences
                lines = []
                for (prompt, ids), row in zip(batch, output[:, width:].tolist(), strict=True):
                    cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
                    response_ids = row[:cut]
                    lines.append(json.dumps({
                        "id": prompt.id, "source": prompt.source, "prompt": prompt.text,
                        "prompt_ids": ids, "response_ids": response_ids,
                        "response": tokenizer.decode(response_ids, skip_special_tokens=True),
                    }, ensure_ascii=False) + "\n")
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(batch))
    finally:
        bar.close()
    return out_path


# ----- references --------------------------------------------------------------------------------------------


@dataclass
class ReferenceSequence:
    """One training sequence: the prompt's token ids then the target's response, `input_ids[:prompt_len]` prompt."""

    id: str
    input_ids: list[int]
    prompt_len: int


def _int_list(record: dict, key: str, vocab_size: int | None = None) -> list[int]:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{key!r} must be a list of token ids")
    if value and (min(value) < 0 or (vocab_size is not None and max(value) >= vocab_size)):
        bad = next(t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size))
        limit = f"the target's vocabulary (0..{vocab_size - 1})" if vocab_size is not None else "0 or more"
        raise ValueError(f"{key!r} holds token id {bad}, outside {limit}: was this file made with another "
                         "tokenizer?")
    return value


def check_token_ids(references: list[ReferenceSequence], vocab_size: int) -> None:
    """Raise `ValueError` naming the first sequence with a token id outside `0..vocab_size - 1`."""
    for ref in references:
        if ref.input_ids and (min(ref.input_ids) < 0 or max(ref.input_ids) >= vocab_size):
            bad = next(t for t in ref.input_ids if not 0 <= t < vocab_size)
            raise ValueError(f"reference sequence {ref.id!r} holds token id {bad}, outside the target's vocabulary "
                             f"(0..{vocab_size - 1}): was it made with another tokenizer?")


def load_references(paths: list[str | Path] | str | Path, max_length: int = 1024,
                    limit: int | None = None, vocab_size: int | None = None) -> list[ReferenceSequence]:
    """Reference sequences from regeneration JSONL files (`.jsonl`, or `.jsonl.gz` compressed): `prompt_ids +
    response_ids`, cut to `max_length`.

    A sequence whose response keeps fewer than 2 tokens after the cut is dropped (nothing to anchor on); a
    warning says how many each file lost and why. Raises `ValueError` naming the file and line of a line that is
    not valid JSON with integer-list `prompt_ids` and `response_ids`, or (given `vocab_size`, the target's) that
    holds a token id outside the vocabulary.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    sequences: list[ReferenceSequence] = []
    token_lists = lambda record: (_int_list(record, "prompt_ids", vocab_size),  # noqa: E731
                                  _int_list(record, "response_ids", vocab_size))
    if limit is not None and limit <= 0:
        return sequences
    for path in map(Path, paths):
        dropped = 0
        for line_no, (record, (prompt_ids, response_ids)) in json_records(path, token_lists):
            input_ids = (prompt_ids + response_ids)[:max_length]
            if len(input_ids) - len(prompt_ids) < 2:
                dropped += 1
                continue
            rid = str(record.get("id", f"{path.stem}:{line_no}"))
            sequences.append(ReferenceSequence(id=rid, input_ids=input_ids, prompt_len=len(prompt_ids)))
            if limit is not None and len(sequences) >= limit:
                break
        if dropped:
            logger.warning("%s: %d sequence(s) dropped: fewer than 2 response tokens within max_length=%d (an "
                           "empty or 1-token response, or a prompt that fills max_length)", path, dropped, max_length)
        if limit is not None and len(sequences) >= limit:
            break
    return sequences


class ReferenceDataset(Dataset):
    """A map-style dataset over `ReferenceSequence`s; batch it with `collate_references`."""

    def __init__(self, sequences: list[ReferenceSequence]):
        self.sequences = list(sequences)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> ReferenceSequence:
        return self.sequences[index]


def collate_references(batch: list[ReferenceSequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: `input_ids` [b, T] long (pad: `pad_id`), `attention_mask` [b, T] long (1 = token),
    `prompt_lens` [b] long, `lengths` [b] long; `T` is the longest sequence in the batch."""
    lengths = [len(s.input_ids) for s in batch]
    width = max(lengths, default=0)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        input_ids[i, : lengths[i]] = torch.tensor(s.input_ids, dtype=torch.long)
        attention_mask[i, : lengths[i]] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompt_lens": torch.tensor([s.prompt_len for s in batch], dtype=torch.long),
        "lengths": torch.tensor(lengths, dtype=torch.long),
    }
