"""The development set's prompt record and its math prompts, apart from `dev_set.py` (which reads the committed
references through `data.py`) so that `held_out.py`, which `data.py`'s readers use, can name every development text
without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hub import assets

MATH_PROMPTS = 48  # CHAMP concepts taken, evenly spread over the 87 distinct ones


@dataclass(frozen=True)
class DevPrompt:
    """One development prompt: `messages` (the chat to answer; for a `second_turn`, its first turn only) and, for a
    `second_turn`, the `follow_up` asked after the target's answer to that first turn."""

    id: str
    kind: str
    messages: tuple[dict, ...]
    follow_up: str | None = None


def math_dev_prompts(count: int = MATH_PROMPTS) -> list[DevPrompt]:
    """`count` of CHAMP's distinct concepts, evenly spread over the file (grouped by topic there), each asked as
    "explain why this holds, step by step, with a small example". Ids: `"champ:{concept identifier}"`."""
    distinct, seen = [], set()
    for identifier, name, statement in assets.champ_concepts():
        if statement.strip() not in seen:
            seen.add(statement.strip())
            distinct.append((identifier, name, statement.strip()))
    chosen = distinct if count >= len(distinct) else [distinct[i * len(distinct) // count] for i in range(count)]
    prompts = []
    for identifier, name, statement in chosen:
        ask = f"Explain the {name}: why it holds" if name else "Explain why this holds"
        text = f"{ask}, step by step, with a small example.\n\n{statement}"
        prompts.append(DevPrompt(f"champ:{identifier}", "math", ({"role": "user", "content": text},)))
    return prompts
