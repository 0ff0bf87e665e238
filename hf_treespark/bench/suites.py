"""The benchmark's prompt suites: which prompts each one reads, and how a run draws `count` of them.

The default three (`SUITES`, what `treespark bench` runs unless `--suites` says otherwise):

- `mtbench`: MT-Bench's 80 first turns, grouped by category;
- `humaneval`: HumanEval's 164 function stubs, asked as "Complete this Python function.";
- `sharegpt`: ShareGPT's held-out first turns (records from position 12,000 on, never training data, and below
  12,671, where the development set's band starts, `assets.SHAREGPT_DEV_POSITION`), of which the first
  `max(4 x count, 64)` are read (400 at most, however many prompts a run asks for).

Every suite's pool is encoded first and `count` prompts taken evenly spaced over those within the token limit, so
a small run spans the categories (how the first three were drawn before: docs/design-notes.md, "Bench prompts").

Three more (`ALL_SUITES`), each read by nothing else (not training, the datastore, calibration or the development
set):

- `copy`: a long text to summarise, rewrite, correct or answer from, the case where copying from the prompt pays.
  The text is the first assistant reply (800 to 3,000 characters) of each held-out ShareGPT record at positions
  13,000 to 13,999 (`assets.SHAREGPT_SUITES_POSITION`; 373 of them, 371 within 1,024 tokens), pasted after one
  of the four `COPY_INSTRUCTIONS` (chosen by the record's position, modulo 4). Prompts up to 1,024 tokens.
- `multiturn`: MT-Bench's 80 second turns, each after its first turn and the *target's own* greedy answer to it
  (`MULTITURN_ANSWER_TOKENS` new tokens at most), so the prompts depend on the target and need it
  (`suite_prompts(..., target=)`). Each prompt carries that answer's token ids as `generate` would add them to a
  growing datastore (`SuitePrompt.earlier_outputs`); the bench grows the datastore methods' store with them.
  Prompts up to 1,024 tokens.
- `math`: CHAMP's 270 competition math problems (`assets.champ_problems`; the `champ-dataset` package), grouped by
  category. The held-out ShareGPT records hold too few math word problems for a suite (fewer than ten of the
  1,210 held-out first turns), and no package found on the index ships GSM8K as a file (`aviary-gsm8k` downloads
  it).

All come from installed packages (`assets`). The comparison, the batch bench, the round profile, `treespark
calibrate` and `scripts/compare_drafters.py` draw from here, so a suite's name means the same prompts everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

SUITES = ("mtbench", "humaneval", "sharegpt")  # the default of `--suites`
ALL_SUITES = SUITES + ("copy", "multiturn", "math")
SUITE_LABELS = {"mtbench": "MT-Bench", "humaneval": "HumanEval", "sharegpt": "ShareGPT (held-out)",
                "copy": "Copy (held-out)", "multiturn": "MT-Bench turn 2", "math": "Math (CHAMP)"}
DEFAULT_MAX_PROMPT_TOKENS = 512
SUITE_MAX_PROMPT_TOKENS = {"copy": 1024, "multiturn": 1024}  # suites whose prompts carry a long text or history
TARGET_SUITES = ("multiturn",)  # suites whose prompts need the target (its own earlier answers)

COPY_INSTRUCTIONS = (
    "Summarise the following text in a few sentences.",
    "Rewrite the following text so that it reads more clearly, keeping every point it makes.",
    "Correct any spelling, grammar or punctuation mistakes in the following text and give the corrected text in "
    "full.",
    "Answer from the text below only: what are its main points? Quote the sentences that state them.",
)
COPY_CHARS = (800, 3000)  # the pasted text's length, in characters (shortest, longest)
MULTITURN_ANSWER_TOKENS = 128  # new tokens at most in the target's answer to a first turn


@dataclass(frozen=True)
class SuitePrompt:
    """One benchmark prompt: `inputs` (`{"input_ids": [1, T], "attention_mask": [1, T]}`, chat-formatted) and the
    target's own earlier outputs in its conversation (`multiturn`; else empty), each as `generate` adds an output to
    a growing datastore: the last `datastore.HEADER_TOKENS` prompt tokens, then the answer."""

    inputs: dict
    earlier_outputs: tuple[list[int], ...] = field(default=())


def suite_max_prompt_tokens(suite: str) -> int:
    """The longest prompt, in tokens, a run of `suite` takes by default."""
    return SUITE_MAX_PROMPT_TOKENS.get(suite, DEFAULT_MAX_PROMPT_TOKENS)


def _check(suite: str) -> None:
    if suite not in ALL_SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(ALL_SUITES)}")


def _spread(pool: list, count: int) -> list:
    """`count` items of `pool` evenly spaced (all of them when `count >= len(pool)`)."""
    if count >= len(pool):
        return list(pool)
    return [pool[i * len(pool) // count] for i in range(count)]


@lru_cache(maxsize=1)
def copy_sources() -> tuple[tuple[int, str], ...]:
    """`(ShareGPT file position, prompt)` of every `copy` prompt, in file order (read once per process)."""
    from ..hub import assets

    shortest, longest = COPY_CHARS
    return tuple((position, f"{COPY_INSTRUCTIONS[position % len(COPY_INSTRUCTIONS)]}\n\n{text.strip()}")
                 for _, position, text in assets.sharegpt_replies(min_chars=shortest)
                 if len(text.strip()) <= longest)


def _pool(suite: str, count: int) -> list[str]:
    from ..hub import assets

    if suite == "mtbench":
        return assets.mtbench_prompts()
    if suite == "humaneval":
        return [f"Complete this Python function.\n\n```python\n{p}```" for p in assets.humaneval_prompts()]
    if suite == "sharegpt":  # never into the development set's band (a run of more than 100 prompts would reach it)
        return [text for _, position, text in assets.sharegpt_first_turns("heldout", limit=max(4 * count, 64))
                if position < assets.SHAREGPT_DEV_POSITION]
    if suite == "copy":
        return [prompt for _, prompt in copy_sources()]
    if suite == "math":
        return assets.champ_problems()
    raise ValueError("the multiturn suite's prompts hold the target's own answers to the first turns: draw them "
                     "with suite_inputs(tokenizer, 'multiturn', count, target=target)")


def select_prompts(suite: str, count: int) -> list[str]:
    """`count` prompts spread evenly over the suite (MT-Bench, HumanEval and CHAMP are grouped by category).
    `multiturn` has no prompt without the target: `suite_inputs(..., target=)`."""
    _check(suite)
    return _spread(_pool(suite, count), count)


def suite_prompts(tokenizer, suite: str, count: int, max_prompt_tokens: int | None = None, target=None,
                  progress: bool = False) -> list[SuitePrompt]:
    """`count` prompts of `suite` no longer than `max_prompt_tokens` (None: the suite's own limit,
    `SUITE_MAX_PROMPT_TOKENS`), chat-formatted. `multiturn` needs `target` (it answers the first turns)."""
    from ..hub import assets

    _check(suite)
    limit = max_prompt_tokens if max_prompt_tokens is not None else suite_max_prompt_tokens(suite)
    if suite == "multiturn":
        if target is None:
            raise ValueError("the multiturn suite needs the target: its prompts hold the target's own greedy answers "
                             "to the first turns (suite_inputs(..., target=target))")
        return multiturn_prompts(target, tokenizer, count, limit, progress=progress)
    encoded = (assets.chat_inputs(tokenizer, p) for p in _pool(suite, count))
    return _spread([SuitePrompt(inputs) for inputs in encoded if inputs["input_ids"].shape[1] <= limit], count)


def suite_inputs(tokenizer, suite: str, count: int, max_prompt_tokens: int | None = None, target=None) -> list[dict]:
    """The inputs of `suite_prompts`: each `{"input_ids": [1, T], "attention_mask": [1, T]}`."""
    return [p.inputs for p in suite_prompts(tokenizer, suite, count, max_prompt_tokens, target)]


def multiturn_prompts(target, tokenizer, count: int, max_prompt_tokens: int = SUITE_MAX_PROMPT_TOKENS["multiturn"],
                      answer_tokens: int | None = None, progress: bool = False) -> list[SuitePrompt]:
    """`count` MT-Bench second turns, evenly spaced over the conversations that fit, each after its first turn and
    `target`'s greedy answer to it (at most `answer_tokens` new tokens, None: `MULTITURN_ANSWER_TOKENS`; plain
    `generate`, one prompt at a time).

    A conversation fits when its two turns, an answer of `answer_tokens` and the template stay within
    `max_prompt_tokens`; one whose answered prompt still runs over (re-tokenised text) is dropped."""
    import torch
    from tqdm.auto import tqdm

    from ..hub import assets
    from ..sources.datastore import HEADER_TOKENS

    answer_tokens = answer_tokens if answer_tokens is not None else MULTITURN_ANSWER_TOKENS

    def length(messages: list[dict]) -> int:
        return assets.conversation_inputs(tokenizer, messages)["input_ids"].shape[1]

    fitting = [(first, second) for first, second in assets.mtbench_conversations()
               if length([{"role": "user", "content": first}, {"role": "assistant", "content": ""},
                          {"role": "user", "content": second}]) + answer_tokens <= max_prompt_tokens]
    device = next(target.parameters()).device
    prompts = []
    for first, second in tqdm(_spread(fitting, count), desc="multiturn: the target answers the first turns",
                              disable=not progress):
        asked = assets.chat_inputs(tokenizer, first)
        with torch.no_grad():
            ids = target.generate(**{k: v.to(device) for k, v in asked.items()}, do_sample=False,
                                  max_new_tokens=answer_tokens)[0].cpu()
        prompt_len = asked["input_ids"].shape[1]
        answer = tokenizer.decode(ids[prompt_len:], skip_special_tokens=True).strip()
        inputs = assets.conversation_inputs(tokenizer, [{"role": "user", "content": first},
                                                        {"role": "assistant", "content": answer},
                                                        {"role": "user", "content": second}])
        if inputs["input_ids"].shape[1] <= max_prompt_tokens:
            prompts.append(SuitePrompt(inputs, (ids[max(0, prompt_len - HEADER_TOKENS):].tolist(),)))
    return prompts
