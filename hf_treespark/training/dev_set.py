"""The development set: held-out prompts of five kinds, the default target's greedy answers, committed once.

Where the prompts come from, by construction disjoint from training, the benchmark and calibration:

    chat, code, writing   the first human turn of every ShareGPT record in the development band
                          (`assets.SHAREGPT_DEV_POSITION` to `assets.SHAREGPT_SUITES_POSITION`, positions 12,671 to
                          12,999 of the held-out records), sorted into a kind by `prompt_kind`
    second_turn           the band's chat records that have a follow-up alternate between `chat` and this kind: its
                          first turn, the target's own greedy answer to it, then the record's second human turn
    math                  CHAMP's concepts (`assets.champ_concepts`: theorems and identities, each asked as "explain
                          why this holds"); the bench's `math` suite reads CHAMP's problems, never its concepts

Training reads ShareGPT below 12,000 and from 14,000 on; the bench's `sharegpt` suite and calibration read held-out
first turns below the band, its `copy` suite the records from 13,000 on, `multiturn` MT-Bench
(tests/test_dev_set.py checks all of it). A record gives one prompt at most, and a first turn that ShareGPT also
holds outside the band (a repeated question or conversation) none.

Each prompt is answered greedily by the target (at most `MAX_NEW_TOKENS` new tokens, cut after the first EOS) and
written as one line of `id`, `kind`, `prompt_ids`, `response_ids` to a gzip JSONL file (`DEV_SET_PATH` for the
default target, committed; `scripts/make_dev_set.py` regenerates it). `treespark train`, `train-depth1` and
`distil` evaluate on it unless `--dev-data` says otherwise; `dev_compare.py` compares two drafters on it.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from ..hub import assets
from .data import ReferenceSequence, load_references
from .dev_prompts import DevPrompt, math_dev_prompts

DEV_SET_PATH = Path(__file__).resolve().parents[2] / "training_data" / "dev" / "dev_set.jsonl.gz"
DEV_KINDS = ("chat", "code", "writing", "math", "second_turn")
MAX_PROMPT_TOKENS = 512  # a first turn (and the first turn of a second-turn prompt), chat template included
MAX_SECOND_TURN_TOKENS = 768  # a second-turn prompt with its history, the answer counted at MAX_NEW_TOKENS
MAX_NEW_TOKENS = 256  # as the training answers
DEV_MAX_LENGTH = MAX_SECOND_TURN_TOKENS + MAX_NEW_TOKENS  # every reference whole: read at this length everywhere

_CODE = re.compile(
    r"```|\b(python|javascript|typescript|java|c\+\+|c#|sql|mysqli?|postgres\w*|mongo\w*|html5?|css|react|node\.?js|"
    r"php|perl|golang|kotlin|bash|powershell|lua|laravel|django|flask|fastapi|flutter|firebase|pytorch|tensorflow|"
    r"pandas|numpy|regex|llvm|nginx|docker|kubernetes|git|api|json|dll|orm|pytest|apps script|code|coding|"
    r"programming|algorithm|compiler?|debug\w*|schema)(?!\w)"
    r"|\bdef \w+\(|\bfunction\s*\w*\s*\(|#include|\bimport \w+|\bclass \w+\s*[:({]|\bconst \w+ =|=>|</\w+>",
    re.IGNORECASE)
_WRITING_START = re.compile(
    r"^\W*(?:(?:please|can you|could you|help me|i need you to|i want you to)\s+)*"
    r"(?:write|compose|draft|rewrite|re-write|paraphrase|proofread|reword|summari[sz]e)\b", re.IGNORECASE)
_WRITING_PIECE = re.compile(
    r"\b(?:write|compose|draft|create|generate|make up|make|give me)\b[^.?!\n]{0,60}?\b(?:story|stories|poems?|"
    r"sonnet|haiku|song|lyrics|chant|essay|article|blog|post|e-?mail|letter|speech|sermon|script|screenplay|ebook|"
    r"novel|slogan|caption|tweets?|headlines?|bio|profile|cover letter|nominations?|journal|dialogue|conversation|"
    r"summary|description|names)\b", re.IGNORECASE)


def prompt_kind(text: str) -> str:
    """`"code"`, `"writing"` or `"chat"` for a first human turn, by its first 1,000 characters: code when it holds
    code or names a language, tool or programming task; else writing when it asks for a piece of text to be written
    (a story, a poem, an email, a rewrite...); else chat."""
    head = text[:1000]
    if _CODE.search(head):
        return "code"
    if _WRITING_START.search(head) or _WRITING_PIECE.search(head):
        return "writing"
    return "chat"


def _length(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def sharegpt_dev_prompts(tokenizer) -> list[DevPrompt]:
    """The chat, code, writing and second-turn prompts of the development band, in file order (see the module
    docstring). A first turn needs at least 16 characters and `MAX_PROMPT_TOKENS` tokens at most, and a text that
    no human turn of a record outside the band, nor an earlier record of the band, holds too (ShareGPT repeats
    popular questions and some whole conversations); a second turn at least 16 characters, and the whole
    conversation with an answer of `MAX_NEW_TOKENS` at most `MAX_SECOND_TURN_TOKENS`. Ids:
    `"{record id}@{position}"`, `"...#2"` for a second turn."""
    band, elsewhere = [], set()
    for position, record in assets.iter_sharegpt():
        turns = record.get("conversations") or []
        if assets.SHAREGPT_DEV_POSITION <= position < assets.SHAREGPT_SUITES_POSITION:
            band.append((position, record))
        else:
            elsewhere.update(str(t.get("value", "")).strip() for t in turns if t.get("from") == "human")
    prompts: list[DevPrompt] = []
    chats = seconds = 0
    for position, record in band:
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") != "human" or len(turns[0].get("value", "")) < 16:
            continue
        if turns[0]["value"].strip() in elsewhere:
            continue
        elsewhere.add(turns[0]["value"].strip())
        first = [{"role": "user", "content": turns[0]["value"]}]
        if _length(tokenizer, first) > MAX_PROMPT_TOKENS:
            continue
        rid, kind = f"{record.get('id')}@{position}", prompt_kind(turns[0]["value"])
        follow_up = _follow_up(tokenizer, turns) if kind == "chat" and seconds < chats else None
        if follow_up is not None:
            prompts.append(DevPrompt(f"{rid}#2", "second_turn", tuple(first), follow_up))
            seconds += 1
            continue
        chats += kind == "chat"
        prompts.append(DevPrompt(rid, kind, tuple(first)))
    return prompts


def _follow_up(tokenizer, turns: list[dict]) -> str | None:
    """The record's second human turn when it follows an assistant reply to the first, is 16 characters or more and
    fits (`sharegpt_dev_prompts`); else None."""
    if len(turns) < 3 or turns[1].get("from") not in ("gpt", "chatgpt") or turns[2].get("from") != "human":
        return None
    text = turns[2].get("value", "")
    conversation = [{"role": "user", "content": turns[0]["value"]}, {"role": "assistant", "content": ""},
                    {"role": "user", "content": text}]
    if len(text) < 16 or _length(tokenizer, conversation) + MAX_NEW_TOKENS > MAX_SECOND_TURN_TOKENS:
        return None
    return text


def dev_prompts(tokenizer) -> list[DevPrompt]:
    """Every development prompt, in the file's order: the ShareGPT band's (file order), then the math ones."""
    return sharegpt_dev_prompts(tokenizer) + math_dev_prompts()


def generate_dev_set(target, tokenizer, path: str | Path = DEV_SET_PATH, slots: int = 32,
                     progress: bool = True) -> Path:
    """Answer every `dev_prompts` prompt with `target`, greedily, and write the development set to `path`.

    Two continuously batched passes (`answers.AnswerGenerator`, `slots` rows): the single-turn prompts and the
    first turns of the second-turn prompts, then the second turns after the target's own answers. Each answer stops
    at `MAX_NEW_TOKENS` or after its first EOS (kept). Lines follow `dev_prompts`' order; the gzip header carries no
    time or name, so the same answers give the same bytes. Written whole or not at all (a temporary file is renamed
    onto `path`). Returns `path`."""
    from tqdm.auto import tqdm

    from .answers import AnswerConfig, AnswerGenerator
    from .data import _eos_ids

    prompts = dev_prompts(tokenizer)
    eos = _eos_ids(target, tokenizer)
    config = AnswerConfig(slots=slots, max_new_tokens=MAX_NEW_TOKENS, max_prompt_tokens=MAX_SECOND_TURN_TOKENS)

    def answer(items: dict[str, list[int]], what: str) -> dict[str, list[int]]:
        bar = tqdm(total=len(items), desc=what, disable=not progress)
        done = {}
        for out in AnswerGenerator(target, eos, config).run(items.items()):
            done[out.key] = out.response_ids
            bar.update(1)
        bar.close()
        return done

    prompt_ids = {p.id: _ids(tokenizer, list(p.messages)) for p in prompts}
    answers = answer(prompt_ids, "development set: first turns")
    for p in prompts:
        if p.kind == "second_turn":
            earlier = tokenizer.decode(answers[p.id], skip_special_tokens=True).strip()
            prompt_ids[p.id] = _ids(tokenizer, [*p.messages, {"role": "assistant", "content": earlier},
                                                {"role": "user", "content": p.follow_up}])
    answers.update(answer({p.id: prompt_ids[p.id] for p in prompts if p.kind == "second_turn"},
                          "development set: second turns"))
    lines = [json.dumps({"id": p.id, "kind": p.kind, "prompt_ids": prompt_ids[p.id], "response_ids": answers[p.id]},
                        separators=(",", ":")) + "\n" for p in prompts]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write("".join(lines).encode("utf-8"))
    tmp.replace(path)
    return path


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def dev_kinds(path: str | Path = DEV_SET_PATH) -> dict[str, str]:
    """`{id: kind}` of a development set file (a file without `kind` fields: every id `"all"`)."""
    from ..records import json_records

    return {str(record.get("id", f"line {n}")): str(record.get("kind", "all"))
            for n, (record, _) in json_records(Path(path), lambda record: None)}


def default_dev_set(target_name: str, output_dir: str | Path) -> Path:
    """Where a training command's default development set lies: the committed `DEV_SET_PATH` for the default target
    (`"default"`), else `OUTPUT_DIR/dev_set.jsonl.gz` (the same prompts, answered by that target on first use:
    `ensure_dev_set`). Raises `FileNotFoundError` when the committed file is missing (an installed package without
    its source checkout): give `--dev-data`."""
    if target_name != "default":
        return Path(output_dir) / "dev_set.jsonl.gz"
    if not DEV_SET_PATH.is_file():
        raise FileNotFoundError(f"the default development set {DEV_SET_PATH} is missing (it ships with a source "
                                "checkout of hf_treespark): give --dev-data, or regenerate it with "
                                "scripts/make_dev_set.py")
    return DEV_SET_PATH


def ensure_dev_set(path: Path, target, tokenizer) -> Path:
    """`path`, answered by `target` first (`generate_dev_set`) when it does not exist yet."""
    if not path.is_file():
        print(f"[dev set] answering the {len(dev_prompts(tokenizer))} development prompts with the target into "
              f"{path}, once (minutes on a CPU)", flush=True)
        generate_dev_set(target, tokenizer, path)
    return path


def load_dev_set(path: str | Path = DEV_SET_PATH, vocab_size: int | None = None) -> list[ReferenceSequence]:
    """The development references of `path`, whole (`DEV_MAX_LENGTH`)."""
    return load_references(path, max_length=DEV_MAX_LENGTH, vocab_size=vocab_size)
