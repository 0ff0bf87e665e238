"""The benchmark's prompt suites: which prompts each one reads, and how a run draws `count` of them.

MT-Bench's 80 first turns and HumanEval's 164 function stubs (asked as "Complete this Python function."), both
grouped by category; ShareGPT's held-out first turns (records 12,000 to 13,999, never training data), of which the
first `max(4 x count, 64)` are read. From each pool `count` prompts are taken evenly spaced, so a small run still
spans the categories. All come from installed packages (`assets`). The comparison, the batch bench, the round
profile, `treespark calibrate` and `scripts/compare_drafters.py` draw from here, so a suite's name means the same
prompts everywhere.
"""

from __future__ import annotations

SUITES = ("mtbench", "humaneval", "sharegpt")
SUITE_LABELS = {"mtbench": "MT-Bench", "humaneval": "HumanEval", "sharegpt": "ShareGPT (held-out)"}


def select_prompts(suite: str, count: int) -> list[str]:
    """`count` prompts spread evenly over the suite (MT-Bench and HumanEval are grouped by category)."""
    from . import assets

    if suite == "mtbench":
        pool = assets.mtbench_prompts()
    elif suite == "humaneval":
        pool = [f"Complete this Python function.\n\n```python\n{p}```" for p in assets.humaneval_prompts()]
    elif suite == "sharegpt":
        pool = assets.sharegpt_prompts("heldout", limit=max(4 * count, 64))
    else:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    if count >= len(pool):
        return pool
    return [pool[i * len(pool) // count] for i in range(count)]


def suite_inputs(tokenizer, suite: str, count: int, max_prompt_tokens: int = 512) -> list[dict]:
    """The first `count` chat-formatted prompts of `suite` (from `4 x count` drawn) no longer than
    `max_prompt_tokens`: each `{"input_ids": [1, T], "attention_mask": [1, T]}`."""
    from . import assets

    encoded = (assets.chat_inputs(tokenizer, p) for p in select_prompts(suite, 4 * count))
    return [inputs for inputs in encoded if inputs["input_ids"].shape[1] <= max_prompt_tokens][:count]
