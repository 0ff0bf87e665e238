"""The prompt supply of `treespark answers` (`training/prompt_supply.py`, `training/answers_cli.py`): no source
reaches a held-out record, written questions are filtered and deduplicated, and a run resumes without repeats."""

from __future__ import annotations

import argparse
import gzip
import json
from itertools import islice

import pytest
import torch
from conftest import make_target

from hf_treespark.hub import assets
from hf_treespark.training import answers_cli
from hf_treespark.training.prompt_supply import QuestionFilter, self_prompts, standalone_turn_prompts


def test_the_sharegpt_sources_never_yield_a_held_out_record(monkeypatch):
    """Records at every position are offered; only those below the held-out band or from the tail come out."""
    records = [(p, {"id": f"r{p}", "conversations": [
        {"from": "human", "value": "first question here"}, {"from": "gpt", "value": "an answer"},
        {"from": "human", "value": f"a later question {p}"}]}) for p in range(0, 20_000, 500)]
    monkeypatch.setattr(assets, "iter_sharegpt", lambda start=0: ((p, r) for p, r in records if p >= start))
    positions = [int(prompt.id.split("@")[1].split("#")[0]) for prompt in standalone_turn_prompts()]
    assert positions and all(not assets.SHAREGPT_HELDOUT_POSITION <= p < assets.SHAREGPT_TAIL_POSITION
                             for p in positions)
    assert min(positions) == 0 and max(positions) == 19_500  # both sides of the band are read
    prompt = next(standalone_turn_prompts())
    assert prompt.messages == [{"role": "user", "content": "a later question 0"}]  # asked alone


def test_the_question_filter_keeps_text_and_refuses_short_garbled_duplicate_and_near_duplicate_questions():
    kept = QuestionFilter()
    question = "How do I sort a list of dictionaries by the value of one key in Python?"
    assert kept.keep(question)
    assert not kept.keep("Hi?")
    assert not kept.keep("@@@ ### $$$ %%% ^^^ &&& *** ~~~ {}{}{}")
    assert not kept.keep("  how do I sort a LIST of dictionaries, by the value of one key in python  ")
    assert not kept.keep(question.replace("Python?", "Python, please?"))
    assert kept.keep("Write a short poem about the sea at night, with rhymes in every second line.")
    assert kept.refused == {"length": 1, "letters": 1, "duplicate": 1, "near-duplicate": 1}


class _Tokenizer:
    """A character tokenizer with a chat template: what `self_prompts` and `answers_cli` use of a tokenizer."""

    eos_token_id = 2

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, return_dict=False):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                              else "")
        return self(text)["input_ids"] if tokenize else text

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [4 + ord(c) % 120 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) if i % 7 else " " for i in ids)


def test_self_written_questions_are_seeded_and_a_restart_goes_on_from_where_it_stopped():
    target = make_target("llama")
    tokenizer = _Tokenizer()
    eos = [int(target(torch.tensor([[5, 6, 7]])).logits[0, -1].argsort()[-2])]  # a likely token ends questions

    def draw(start=0, count=6):
        kept = QuestionFilter(min_chars=2, min_letters=0.0, near=1.1)
        return list(islice(self_prompts(target, tokenizer, eos, seed=4, slots=3, max_question_tokens=12,
                                        question_filter=kept, start=start), count))

    first = draw()
    assert [p.id for p in first] == [p.id for p in draw()]  # seeded
    assert all(p.source == "self" and p.id.startswith("self:4:") for p in first)
    later = draw(start=int(first[2].id.rsplit(":", 1)[1]) + 1, count=3)
    assert [p.id for p in later] == [p.id for p in first[3:6]]


def test_the_answers_command_writes_shards_resumes_and_refuses_other_options(tmp_path, monkeypatch, capsys):
    from hf_treespark.core.cpu_gemm import model_is_packed, packing_available, unpack_linear_layers
    from hf_treespark.training import cli as training_cli

    target = make_target("llama")
    monkeypatch.setattr(training_cli, "load_target", lambda name, with_tokenizer, device: (target, _Tokenizer()))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"}]})
                             + "\n" for i in range(9)))
    parser = argparse.ArgumentParser()
    answers_cli.add_arguments(parser)

    def run(*extra):
        return answers_cli.run(parser.parse_args(["--prompts", str(chats), "--slots", "3", "--max-new-tokens", "5",
                                                  "--shard-answers", "2", "--output-dir", str(tmp_path / "out"),
                                                  *extra]))

    assert run("--num-prompts", "5") == 0
    assert model_is_packed(target) == packing_available()  # --cpu-pack auto: packed on a CPU with oneDNN
    shards = sorted((tmp_path / "out").glob("answers-*.jsonl.gz"))
    records = [json.loads(line) for path in shards for line in gzip.open(path, "rt")]
    assert len(shards) == 3 and len(records) == 5
    assert all(r["prompt_ids"] == _Tokenizer().apply_chat_template(
        [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True) for r in records)
    assert run("--num-prompts", "9") == 0
    ids = [json.loads(line)["id"] for path in sorted((tmp_path / "out").glob("answers-*")) for line in
           gzip.open(path, "rt")]
    assert sorted(ids) == [f"c{i}" for i in range(9)]  # the first five kept, the other four added, none twice
    assert "4 answers" in capsys.readouterr().out
    with pytest.raises(ValueError, match="other max_new_tokens"):
        run("--num-prompts", "9", "--max-new-tokens", "6")
    unpack_linear_layers(target)
    assert run("--num-prompts", "10", "--cpu-pack", "off") == 0  # the answers' options are the same: it goes on
    assert not model_is_packed(target)


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "sharegpt_heldout"], "neither a source"),
    (["--prompts", "self,self"], "listed twice"),
    (["--slots", "0"], "--slots must be at least 1"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
])
def test_bad_options_are_refused_before_anything_loads(tmp_path, monkeypatch, argv, message):
    from hf_treespark.training import cli as training_cli

    monkeypatch.setattr(training_cli, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    parser = argparse.ArgumentParser()
    answers_cli.add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        answers_cli.run(parser.parse_args([*argv, "--output-dir", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists()

