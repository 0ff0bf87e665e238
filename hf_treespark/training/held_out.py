"""The texts evaluation reads, which no training reader yields.

The training readers never read a held-out ShareGPT record (file positions 12,000 to 13,999), but ShareGPT repeats
popular questions and whole conversations, so a held-out record's text can come back at a training position: a
benchmark prompt, a reply the copy suite pastes, a development or calibration question. The ShareGPT readers of
training (`data.sharegpt_chat_prompts` and `data.sharegpt_later_turn_prompts` for the train and tail splits,
`prompt_supply.standalone_turn_prompts`) therefore skip every prompt one of whose turns is a text of
`evaluated_texts`, compared with runs of white space collapsed (`normalised`):

- the first human turn of every held-out record (what the bench's sharegpt suite, calibration and both development
  sets ask are among them);
- the first assistant reply of every record of the bench's own band (positions 13,000 to 13,999) at least as long as
  the copy suite takes: the texts it pastes after its instructions;
- every prompt of the other bench suites that need no target (MT-Bench, HumanEval as asked and bare, CHAMP's
  problems), MT-Bench's second turns (the multiturn suite) and the development set's math prompts, all of them.

The development set's follow-ups (the second human turns it asks after a first turn, "Continue writing please" among
them) are not texts of their own here: the record is the pair, and its first turn is. Short turns are not exempt
otherwise: a training prompt that asks, word for word, what a
held-out record's first turn asks is skipped whatever its length. tests/test_held_out.py checks every reader
against what the bench, calibration and the development set actually read.
"""

from __future__ import annotations

from collections.abc import Iterable


def normalised(text) -> str:
    """`text` stripped, each run of white space one space: how texts are compared here."""
    return " ".join(str(text).split())


def evaluated_texts() -> frozenset[str]:
    """Every text evaluation reads (see the module docstring), `normalised`. Reads the installed ShareGPT, MT-Bench,
    HumanEval and CHAMP packages (one pass over the ShareGPT file)."""
    from ..bench import suites
    from ..hub import assets
    from .dev_prompts import math_dev_prompts

    texts = set()
    for position, record in assets.iter_sharegpt(assets.SHAREGPT_HELDOUT_POSITION):
        if position >= assets.SHAREGPT_TAIL_POSITION:
            break
        if position < assets.SHAREGPT_HELDOUT_POSITION:
            continue
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            texts.add(normalised(turns[0].get("value", "")))
        if (position >= assets.SHAREGPT_SUITES_POSITION and len(turns) >= 2
                and len(str(turns[1].get("value", "")).strip()) >= suites.COPY_CHARS[0]):
            texts.add(normalised(turns[1]["value"]))
    for suite in suites.ALL_SUITES:  # the ShareGPT suites ask the records' texts above
        if suite not in suites.TARGET_SUITES and suite not in ("sharegpt", "copy"):
            texts.update(normalised(text) for text in suites.select_prompts(suite, 1_000_000))
    texts.update(normalised(turn) for conversation in assets.mtbench_conversations() for turn in conversation)
    texts.update(normalised(prompt) for prompt in assets.humaneval_prompts())
    texts.update(normalised(m["content"]) for prompt in math_dev_prompts(1_000_000) for m in prompt.messages)
    texts.discard("")
    return frozenset(texts)


def asks_evaluated(messages: Iterable[dict], evaluated: frozenset[str]) -> bool:
    """True if a turn of `messages` ({role, content} dicts) is one of the `evaluated` texts (`evaluated_texts`)."""
    return any(normalised(m["content"]) in evaluated for m in messages)
