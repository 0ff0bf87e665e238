"""The continuous-batching answer generator (`training/answers.py`): every answer is what `target.generate` gives
the prompt alone, whatever row it ran in, whenever rows were refilled or the cache rolled; shards resume."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from conftest import make_target

from hf_treespark.training.answers import AnswerConfig, AnswerGenerator, AnswerShards


def _prompts(count: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (count,), generator=gen).tolist()
    return [(f"p{i}", torch.randint(4, 128, (n,), generator=gen).tolist()) for i, n in enumerate(lengths)]


def _alone(target, ids: list[int], eos: int, max_new: int) -> list[int]:
    out = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    row = out[0, len(ids):].tolist()
    return row[: next((i + 1 for i, t in enumerate(row) if t == eos), len(row))]


@pytest.mark.parametrize("arch, attn, chunk_rows", [("llama", "sdpa", 2), ("llama", "sdpa", 0), ("qwen3", "eager", 2),
                                                    ("mistral", "sdpa", 16), ("qwen2", "sdpa", 1)])
def test_every_answer_is_what_the_prompt_alone_gets_greedily(arch, attn, chunk_rows):
    """Three rows for 14 prompts of 1-12 tokens: rows are refilled as answers end (some at an EOS, some at the
    cap), the cache rolls (2 spare slots) and sorts its rows, and sdpa targets read each chunk of rows' own window
    of the cache (`chunk_rows`), yet each answer is plain greedy decoding's, token for token."""
    target = make_target(arch, attn=attn)
    prompts, max_new = _prompts(14), 10
    # an EOS that some answers reach early: a token the first prompts' capped answers produce mid-way
    firsts = [_alone(target, ids, eos=-1, max_new=max_new) for _, ids in prompts[:4]]
    eos = next(row[3] for row in firsts if len(row) > 3)
    config = AnswerConfig(slots=3, max_new_tokens=max_new, max_prompt_tokens=12, spare=2, chunk_rows=chunk_rows,
                          sort_every=3)
    generator = AnswerGenerator(target, [eos], config)
    assert generator.ragged == (attn == "sdpa" and chunk_rows > 0)
    answers = list(generator.run(iter(prompts)))
    assert sorted(a.key for a in answers) == sorted(k for k, _ in prompts)
    by_key = {a.key: a for a in answers}
    ended_early = 0
    for key, ids in prompts:
        expected = _alone(target, ids, eos, max_new)
        assert by_key[key].prompt_ids == ids
        assert by_key[key].response_ids == expected, key
        ended_early += len(expected) < max_new
    assert 0 < ended_early < len(prompts)  # both ways of ending were exercised
    assert generator.prefills > 1 and generator.rolls > 1 and generator.sorts > generator.rolls * generator.ragged
    assert generator.steps < sum(len(a.response_ids) for a in answers)  # rows decoded together


def test_a_prompt_longer_than_the_limit_is_refused_naming_it():
    generator = AnswerGenerator(make_target("llama"), [2], AnswerConfig(slots=2, max_prompt_tokens=4))
    with pytest.raises(ValueError, match="prompt 'long' has 5 tokens: a prompt needs 1 to max_prompt_tokens=4"):
        list(generator.run([("long", [5, 6, 7, 8, 9])]))


def test_sampling_is_seeded_and_answers_end_at_the_cap():
    target = make_target("llama")
    config = AnswerConfig(slots=2, max_new_tokens=6, max_prompt_tokens=12, do_sample=True, temperature=1.0, seed=3)
    runs = [{a.key: a.response_ids for a in AnswerGenerator(target, [-5], config).run(_prompts(5))}
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(r) == 6 for r in runs[0].values())
    greedy = {a.key: a.response_ids for a in AnswerGenerator(target, [-5], AnswerConfig(
        slots=2, max_new_tokens=6, max_prompt_tokens=12)).run(_prompts(5))}
    assert greedy != runs[0]


def test_shards_are_written_whole_and_list_what_is_done(tmp_path):
    shards = AnswerShards(tmp_path / "out", shard_answers=2)
    for i in range(5):
        shards.add({"id": f"a{i}", "source": "s", "prompt_ids": [1], "response_ids": [2, 3]})
    assert len(shards.paths()) == 2 and shards.done() == {"a0", "a1", "a2", "a3"}
    shards.flush()
    assert shards.done() == {f"a{i}" for i in range(5)} and not list((tmp_path / "out").glob(".*"))
    with gzip.open(shards.paths()[-1], "rt") as f:
        assert [json.loads(line)["id"] for line in f] == ["a4"]
