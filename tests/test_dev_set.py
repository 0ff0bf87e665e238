"""The development set (`training/dev_set.py`): the committed file holds at least 200 prompts of every kind, made
from records that no training reader, benchmark suite or calibration reads; and the paired comparison of two
drafters on it (`training/dev_compare.py`), its standard error clustered by prompt."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import AutoTokenizer

from hf_treespark.bench import suites as bench_suites
from hf_treespark.cli import commands as cli_commands
from hf_treespark.hub import assets
from hf_treespark.training import data as training_data
from hf_treespark.training import dev_set, distill_sources, prompt_supply
from hf_treespark.training.data import ReferenceSequence
from hf_treespark.training.depth1 import grow_depth1_head, head_off
from hf_treespark.training.dev_compare import clustered_ratio, compare_depth1, depth1_hits, markdown_table

REPO = Path(__file__).resolve().parents[1]


def _position(prompt_id: str) -> int:
    """The ShareGPT file position in an id `"{record id}@{position}[#turn][/alone]"`."""
    return int(prompt_id.rsplit("@", 1)[1].split("#")[0].split("/")[0])


@pytest.fixture(scope="module")
def committed() -> list[dict]:
    with gzip.open(dev_set.DEV_SET_PATH, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def sharegpt():
    """The ShareGPT file parsed once for every reader of this module (each would parse all of it again)."""
    records = list(assets.iter_sharegpt())
    patch = pytest.MonkeyPatch()
    patch.setattr(assets, "iter_sharegpt",
                  lambda min_position=0: ((p, r) for p, r in records if p >= min_position))
    yield records
    patch.undo()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(assets.default_target_path())


@pytest.fixture(scope="module")
def prompts(sharegpt, tokenizer) -> list[dev_set.DevPrompt]:
    return dev_set.dev_prompts(tokenizer)


def _texts(prompt: dev_set.DevPrompt) -> list[str]:
    """The texts a development prompt asks: its user turns."""
    return [m["content"].strip() for m in prompt.messages] + ([prompt.follow_up.strip()] if prompt.follow_up else [])


def test_the_committed_dev_set_holds_200_prompts_or_more_of_every_kind_with_unique_ids(committed):
    kinds = [record["kind"] for record in committed]
    assert len(committed) >= 200
    assert set(kinds) == set(dev_set.DEV_KINDS)
    assert min(kinds.count(kind) for kind in dev_set.DEV_KINDS) >= 20  # roughly balanced
    assert len({record["id"] for record in committed}) == len(committed)
    assert all(record["response_ids"] and record["prompt_ids"] for record in committed)
    assert max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in committed) <= dev_set.DEV_MAX_LENGTH
    assert max(len(r["response_ids"]) for r in committed) <= dev_set.MAX_NEW_TOKENS
    references = dev_set.load_dev_set()  # every record whole: none dropped, none cut
    assert [r.id for r in references] == [record["id"] for record in committed]
    assert dev_set.dev_kinds() == {record["id"]: record["kind"] for record in committed}


def test_the_committed_file_answers_the_prompts_the_selection_makes(committed, prompts, tokenizer):
    assert [(p.id, p.kind) for p in prompts] == [(r["id"], r["kind"]) for r in committed]
    for prompt, record in zip(prompts, committed, strict=True):
        if prompt.kind != "second_turn":
            assert record["prompt_ids"] == tokenizer.apply_chat_template(
                list(prompt.messages), add_generation_prompt=True, tokenize=True, return_dict=False), prompt.id
        else:  # the first turn, the target's answer to it, then the follow-up
            text = tokenizer.decode(record["prompt_ids"])
            first, follow_up = _texts(prompt)
            assert first[:200] in text and follow_up[:200] in text and text.count("<|im_start|>assistant") == 2


def test_dev_records_lie_in_the_reserved_band_or_are_champ_concepts(prompts):
    sharegpt = [p for p in prompts if p.kind != "math"]
    assert all(assets.SHAREGPT_DEV_POSITION <= _position(p.id) < assets.SHAREGPT_SUITES_POSITION for p in sharegpt)
    assert assets.SHAREGPT_HELDOUT_POSITION < assets.SHAREGPT_DEV_POSITION < assets.SHAREGPT_SUITES_POSITION
    assert len({_position(p.id) for p in sharegpt}) == len(sharegpt)  # a record gives one prompt at most
    concepts = {f"champ:{identifier}" for identifier, _, _ in assets.champ_concepts()}
    assert all(p.id in concepts for p in prompts if p.kind == "math")


def test_no_training_reader_reads_a_dev_record(prompts, sharegpt):
    positions = {_position(p.id) for p in prompts if p.kind != "math"}
    first_turns = {p.messages[0]["content"].strip() for p in prompts}
    read = {position for position, _ in prompt_supply.sharegpt_positions()}  # `treespark answers`' ShareGPT sources
    assert read and not read & positions
    for prompt_list in (training_data.sharegpt_chat_prompts("train"), training_data.sharegpt_chat_prompts("tail"),
                        training_data.sharegpt_later_turn_prompts(split="train"),
                        training_data.sharegpt_later_turn_prompts(split="tail")):
        assert prompt_list and not {_position(p.id) for p in prompt_list} & positions
        assert not {p.text.strip() for p in prompt_list} & first_turns
    conversations = list(distill_sources._sharegpt_conversations())  # `treespark distil --sources sharegpt`
    assert conversations and not {_position(key) for key, _ in conversations} & positions


def test_no_committed_training_file_holds_a_dev_prompt(committed):
    dev_ids = {record["id"] for record in committed}
    dev_prompts = {tuple(record["prompt_ids"]) for record in committed}
    dev_positions = {_position(i) for i in dev_ids if "@" in i}
    files = sorted(p for p in (REPO / "training_data").rglob("*.jsonl.gz") if "dev" not in p.parts)
    assert files
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                assert tuple(record["prompt_ids"]) not in dev_prompts, (path, record["id"])
                if "@" in record["id"]:
                    assert _position(record["id"]) not in dev_positions, (path, record["id"])


def test_no_bench_suite_or_calibration_reads_a_dev_prompt(prompts, sharegpt, monkeypatch):
    read = set()
    for suite in ("mtbench", "humaneval", "sharegpt", "copy", "math"):  # each suite's whole pool
        read.update(text.strip() for text in bench_suites.select_prompts(suite, 10_000))
    read.update(turn.strip() for conversation in assets.mtbench_conversations() for turn in conversation)  # multiturn
    read.update(problem.strip() for problem in assets.champ_problems())
    calibrated = []
    monkeypatch.setattr(assets, "chat_inputs", lambda tokenizer, text: calibrated.append(text) or
                        {"input_ids": torch.zeros(1, 1)})
    for suite in ("sharegpt", "mtbench", "humaneval", "copy", "math"):  # `treespark calibrate --suite`
        cli_commands._calibration_prompts(argparse.Namespace(suite=suite, num_prompts=10_000), None)
    assert len(calibrated) > 1000
    read.update(text.strip() for text in calibrated)
    asked = [text for p in prompts for text in _texts(p)]
    assert not read & {p.messages[0]["content"].strip() for p in prompts}
    assert not [text for text in asked if text in read and len(text) > 40]  # no question of the bench's either
    pool = assets.sharegpt_first_turns("heldout", limit=40_000)  # the bench and calibration stop below the band
    assert pool[399][1] < assets.SHAREGPT_DEV_POSITION
    first_seen = {}
    for _, position, text in pool:  # a text some records repeat is read at its first position
        first_seen.setdefault(text, position)
    assert max(first_seen[text] for text in bench_suites.select_prompts("sharegpt", 10_000)) < \
        assets.SHAREGPT_DEV_POSITION


def test_prompt_kinds_sort_code_writing_and_chat():
    assert dev_set.prompt_kind("How do I make an HTTP request in Javascript?") == "code"
    assert dev_set.prompt_kind("improve this:\n```\nx = 1\n```") == "code"
    assert dev_set.prompt_kind("Write a poem about the sea") == "writing"
    assert dev_set.prompt_kind("Can you draft an email to my landlord about the heating?") == "writing"
    assert dev_set.prompt_kind("Who really collects baby teeth placed under a pillow?") == "chat"


def test_the_training_commands_default_to_the_committed_set_for_the_default_target(tmp_path):
    assert dev_set.default_dev_set("default", tmp_path) == dev_set.DEV_SET_PATH
    assert dev_set.default_dev_set("org/other-model", tmp_path) == tmp_path / "dev_set.jsonl.gz"
    from hf_treespark.training import cli as train_cli
    from hf_treespark.training import depth1, distill

    for add in (train_cli.add_arguments, depth1.add_arguments, distill.add_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        help_text = next(a.help for a in parser._actions if a.dest == "dev_data")
        assert "training_data/dev/dev_set.jsonl.gz" in help_text and "400-431" not in help_text


def test_the_clustered_standard_error_matches_a_hand_computation():
    a = {"p1": (5, 10), "p2": (12, 20), "p3": (4, 10), "p4": (0, 0)}
    b = {"p1": (4, 10), "p2": (10, 20), "p3": (4, 10), "p4": (0, 0)}
    rows = compare_depth1(a, b, {"p1": "chat", "p2": "chat", "p3": "code", "p4": "code"})
    assert [(r.kind, r.prompts, r.anchors) for r in rows] == [("chat", 2, 30), ("code", 1, 10), ("all", 3, 40)]
    overall = rows[-1]
    # by hand: A = 21/40; residuals h - A n = -0.25, 1.5, -1.25; SE = sqrt(3/2 * 3.875) / 40
    assert overall.a.value == pytest.approx(0.525) and overall.a.se == pytest.approx(math.sqrt(1.5 * 3.875) / 40)
    assert overall.b.value == pytest.approx(0.45)
    # B - A: d = -1, -2, 0; D = -3/40; residuals d - D n = -0.25, -0.5, 0.75; SE = sqrt(3/2 * 0.875) / 40
    assert overall.diff.value == pytest.approx(-0.075)
    assert overall.diff.se == pytest.approx(math.sqrt(1.5 * 0.875) / 40) == pytest.approx(0.0286411, abs=1e-7)
    assert math.isnan(rows[1].diff.se)  # one prompt: no error over prompts
    table = markdown_table(rows)
    assert table.splitlines()[0].startswith("| kind | prompts | anchors |")
    assert "| all | 3 | 40 | 52.50 ± 6.03 | 45.00 ± " in table
    # one anchor per prompt: the ordinary standard error of a mean
    hits = [1, 0, 1, 1, 0, 1, 1]
    assert clustered_ratio(hits, [1] * 7).se == pytest.approx(statistics.stdev(hits) / math.sqrt(7))
    with pytest.raises(ValueError, match="other prompts"):
        compare_depth1(a, {"p1": (1, 10)})
    with pytest.raises(ValueError, match="other anchors"):
        compare_depth1({"p1": (1, 10)}, {"p1": (1, 11)})


def test_depth1_hits_take_every_anchor_and_the_drafters_own_depth1_prediction():
    target = make_target("qwen3")
    drafter = grow_depth1_head(make_drafter(target), 32).bind_target(target).eval()
    with torch.no_grad():
        drafter.depth1_head.out.weight.normal_(0.0, 0.5)  # a head that changes the prediction
    gen = torch.Generator().manual_seed(3)
    refs = []
    for i in range(3):
        prompt = torch.randint(4, 128, (5 + i,), generator=gen).tolist()
        full = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12 + i, eos_token_id=None)
        refs.append(ReferenceSequence(id=f"r{i}", input_ids=full[0].tolist(), prompt_len=len(prompt)))
    hits = depth1_hits(target, [drafter], refs, chunk=7)[0]
    assert [n for _, n in hits] == [len(r.input_ids) - 1 - r.prompt_len for r in refs]
    expected = []
    for ref in refs:  # one anchor at a time, as the head's own measure reads it: argmax(U_1 + W2(W1[x_a]))
        ids = torch.tensor([ref.input_ids])
        from hf_treespark.decoding.engine import target_features

        feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
        right = 0
        for t in range(ref.prompt_len, len(ref.input_ids) - 1):
            with torch.no_grad():
                out = drafter(anchor_ids=ids[:, t:t + 1], anchor_positions=torch.tensor([[t]]), target_features=feats)
                logits = out.depth_logits[0, 0] + drafter.markov_bias(ids[0, t])
            right += int(drafter.to_target_ids(logits.argmax(-1)) == ref.input_ids[t + 1])
        expected.append(right)
    assert [h for h, _ in hits] == expected
    with head_off(drafter):
        without = depth1_hits(target, [drafter], refs)[0]
    assert [n for _, n in without] == [n for _, n in hits] and without != hits
