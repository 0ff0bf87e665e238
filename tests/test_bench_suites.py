"""The benchmark's later suites (`copy`, `multiturn`, `math`): enough distinct prompts from the real offline tokenizer,
read from records nothing else reads, a long pasted text in every `copy` prompt, the target's own first answers in the
`multiturn` prompts and in the datastore the bench's datastore methods read, and unknown names refused with the list."""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers
from conftest import make_drafter
from transformers import AutoTokenizer

from hf_treespark.bench import methods as bench_methods
from hf_treespark.bench import run as bench
from hf_treespark.bench import suites as bench_suites
from hf_treespark.bench.suites import ALL_SUITES, SUITES, SuitePrompt
from hf_treespark.cli import commands as cli
from hf_treespark.hub import assets
from hf_treespark.sources.datastore import HEADER_TOKENS, Datastore
from hf_treespark.training.evaluate import DEV_PROMPTS

CALIBRATION_PROMPTS = slice(200, 400)  # `treespark calibrate`'s held-out first turns (cli._calibration_prompts)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(assets.default_target_path())


@pytest.fixture(scope="module")
def heldout_records() -> dict[int, dict]:
    """The held-out band's records by file position, read here apart from the code under test (once: parsing the
    file up to the band takes seconds)."""
    records = {}
    for position, record in assets.iter_sharegpt(assets.SHAREGPT_HELDOUT_POSITION):
        if position >= assets.SHAREGPT_TAIL_POSITION:
            break
        records[position] = record
    return records


@pytest.fixture(autouse=True)
def _sharegpt_read_once(heldout_records, monkeypatch):
    """The suites read the held-out band from the records already read (every reader here starts inside it)."""
    def iter_sharegpt(min_position: int = 0):
        assert min_position >= assets.SHAREGPT_HELDOUT_POSITION, "a reader outside the held-out band"
        return ((position, record) for position, record in heldout_records.items() if position >= min_position)

    monkeypatch.setattr(assets, "iter_sharegpt", iter_sharegpt)


def tiny_target(tokenizer, seed: int = 0):
    """A random 2-layer Llama over the real tokenizer's vocabulary (its answers are gibberish, but its own)."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharp logits: greedy answers without near-ties, and no early end of turn
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.mark.parametrize("suite", ["copy", "math"])
def test_each_new_suite_draws_20_distinct_prompts_within_its_limit_from_a_larger_pool(tokenizer, suite):
    limit = bench_suites.suite_max_prompt_tokens(suite)
    available = bench_suites.suite_prompts(tokenizer, suite, 10_000)
    chosen = bench_suites.suite_prompts(tokenizer, suite, 20)
    assert len(available) >= 40 and len(chosen) == 20
    assert all(p.inputs["input_ids"].shape == p.inputs["attention_mask"].shape for p in chosen)
    assert all(p.inputs["input_ids"].shape[1] <= limit and p.earlier_outputs == () for p in available)
    texts = [tuple(p.inputs["input_ids"][0].tolist()) for p in chosen]
    assert len(set(texts)) == 20 and set(texts) <= {tuple(p.inputs["input_ids"][0].tolist()) for p in available}
    # spread over the whole pool (categories, positions), not its first 20
    assert texts[-1] == tuple(available[19 * len(available) // 20].inputs["input_ids"][0].tolist())
    # suite_inputs is the same prompts' inputs
    assert [tuple(i["input_ids"][0].tolist()) for i in bench_suites.suite_inputs(tokenizer, suite, 20)] == texts


def test_copy_prompts_paste_a_long_held_out_reply_after_one_of_the_instructions(tokenizer, heldout_records):
    sources = bench_suites.copy_sources()
    used = set()
    for prompt in bench_suites.suite_prompts(tokenizer, "copy", 20):
        decoded = tokenizer.decode(prompt.inputs["input_ids"][0])
        ((position, text),) = [(position, text) for position, text in sources if text in decoded]  # whole
        instruction, pasted = text.split("\n\n", 1)
        turns = heldout_records[position]["conversations"]
        assert turns[0]["from"] == "human" and turns[1]["from"] in ("gpt", "chatgpt")
        assert pasted == turns[1]["value"].strip() and len(pasted) >= 800  # the record's first reply, verbatim
        assert instruction in bench_suites.COPY_INSTRUCTIONS
        used.add(instruction)
    assert len(used) >= 3  # a mix of tasks, not one instruction 20 times


def test_the_new_suites_read_records_that_training_development_calibration_and_sharegpt_do_not(
        heldout_records, monkeypatch):
    copy_positions = [position for position, _ in bench_suites.copy_sources()]
    lowest = min(copy_positions)
    # training (and the datastore built from its answers) reads records outside the held-out band only
    assert assets.SHAREGPT_SUITES_POSITION <= lowest and max(copy_positions) < assets.SHAREGPT_TAIL_POSITION
    assert assets.SHAREGPT_HELDOUT_POSITION < assets.SHAREGPT_SUITES_POSITION
    # the held-out first turns the development set and calibration read all lie below the copy suite's records
    first_turns = [(position, record["conversations"][0]["value"]) for position, record in heldout_records.items()
                   if (record.get("conversations") or [{}])[0].get("from") == "human"
                   and len(record["conversations"][0].get("value", "")) >= 16]
    assert [t for _, t in first_turns[:50]] == assets.sharegpt_prompts("heldout", limit=50)
    for readers in (DEV_PROMPTS, CALIBRATION_PROMPTS):
        assert max(position for position, _ in first_turns[readers]) < lowest
    # the sharegpt suite stops before the band however many prompts a run asks for, and keeps its earlier prompts
    full = [("", position, text) for position, text in first_turns]
    monkeypatch.setattr(assets, "sharegpt_first_turns", lambda split="heldout", limit=None, min_chars=16: full[:limit])
    positions = {}
    for position, text in first_turns:  # a text some records repeat is read at its first position
        positions.setdefault(text, position)
    assert max(positions[t] for t in bench_suites.select_prompts("sharegpt", 1000)) < lowest
    first_80 = [text for _, text in first_turns[:80]]
    assert bench_suites.select_prompts("sharegpt", 20) == [first_80[i * 4] for i in range(20)]
    # math and multiturn read no ShareGPT record: CHAMP's problems and MT-Bench's questions
    assert bench_suites.select_prompts("math", 300) == assets.champ_problems() and len(assets.champ_problems()) == 270


def test_multiturn_prompts_hold_the_targets_own_greedy_answer_to_the_first_turn(tokenizer):
    target = tiny_target(tokenizer)
    prompts = bench_suites.multiturn_prompts(target, tokenizer, 20, answer_tokens=8)
    conversations = assets.mtbench_conversations()
    assert len(prompts) == 20 and len(conversations) == 80
    assert len({tuple(p.inputs["input_ids"][0].tolist()) for p in prompts}) == 20
    for i in (0, 7, 19):  # (each check generates again: a few of them)
        prompt = prompts[i]
        first, second = conversations[i * 80 // 20]  # spread over the categories
        asked = assets.chat_inputs(tokenizer, first)
        answer_ids = target.generate(**asked, do_sample=False, max_new_tokens=8)[0, asked["input_ids"].shape[1]:]
        (earlier,) = prompt.earlier_outputs  # as generate adds an output: the assistant header, then the answer
        assert earlier[HEADER_TOKENS:] == answer_ids.tolist() and len(answer_ids) == 8
        assert earlier[:HEADER_TOKENS] == asked["input_ids"][0, -HEADER_TOKENS:].tolist()
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
        text = tokenizer.decode(prompt.inputs["input_ids"][0])
        assert answer and text.endswith(f"<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n{answer}"
                                        f"<|im_end|>\n<|im_start|>user\n{second}<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="needs the target"):
        bench_suites.suite_inputs(tokenizer, "multiturn", 2)
    with pytest.raises(ValueError, match="target"):
        bench_suites.select_prompts("multiturn", 2)


def test_the_datastore_methods_read_a_copy_of_the_store_grown_with_the_first_answers():
    store = Datastore.build([[10, 11, 12, 13, 14]] * 2, 64)
    answer = [20, 21, 22, 23, 24, 25]
    drafter = type("Drafter", (), {"datastore": store})()
    prompts = [SuitePrompt({}, (answer,)), SuitePrompt({}, ([30, 31, 32],))]
    grown = bench._grown_datastores({"treespark": drafter, "dspark": object()}, prompts)
    assert set(grown) == {"treespark"}
    copy = grown["treespark"]
    n, follow = copy.lookup([20, 21, 22])
    assert n == 3 and follow[0, :3].tolist() == [23, 24, 25]  # the answer is found
    assert copy.lookup([10, 11])[0] == 2  # and the shipped index still is
    assert store.lookup([20, 21, 22])[0] == 0 and store.grown == []  # the drafter's own store is left as it was
    copy.add([40, 41, 42, 43])  # frozen: what generate adds during the suite is not kept
    assert copy.lookup([40, 41, 42])[0] == 0
    assert bench._grown_datastores({"treespark": drafter}, [SuitePrompt({})]) == {}  # single-turn suites
    with_store = bench._with_datastore(bench_methods.METHODS["treespark_datastore"], grown)
    assert with_store.kwargs["tree_datastore"] is copy and with_store.name == "treespark_datastore"
    lookup_only = bench_methods.METHODS["treespark_lookup"]
    assert bench._with_datastore(lookup_only, grown) is lookup_only
    assert bench_methods.METHODS["treespark_datastore"].kwargs["tree_datastore"] is True


def test_a_multiturn_bench_gives_the_datastore_method_the_grown_store_and_stays_exact(tokenizer, monkeypatch):
    monkeypatch.setattr(bench_suites, "MULTITURN_ANSWER_TOKENS", 8)  # short first answers: a quick test
    target = tiny_target(tokenizer, seed=1)
    drafter = make_drafter(target, tree_budget=4)
    drafter.datastore = Datastore.build([[5, 6, 7, 8]] * 2, len(tokenizer))
    seen = []
    generate = target.generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("tree_datastore"))
        return generate(*args, **kwargs)

    target.generate = spy
    report = bench.run_benchmark(target, tokenizer, {"treespark": drafter}, suites=["multiturn"],
                                 methods=["plain", "treespark_datastore"], num_prompts=2, max_new_tokens=4,
                                 budget=4, progress=False)
    stores = [s for s in seen if isinstance(s, Datastore)]
    assert len(stores) == 2 and stores[0] is stores[1]  # one grown store, for both prompts
    prompts = bench_suites.suite_prompts(tokenizer, "multiturn", 2, target=target)
    assert [g.tolist() for g in stores[0].grown] == [ids for p in prompts for ids in p.earlier_outputs]
    assert stores[0].index is drafter.datastore.index and drafter.datastore.grown == []
    assert report["violations"] == [] and report["config"]["max_prompt_tokens"] == {"multiturn": 1024}
    assert {(r["suite"], r["method"], r["prompts"], r["exact"]) for r in report["results"]} == {
        ("multiturn", "plain", 2, 2), ("multiturn", "treespark_datastore", 2, 2)}


def test_unknown_suites_are_refused_with_every_name_and_the_new_ones_are_accepted(monkeypatch, capsys, tmp_path):
    assert SUITES == ("mtbench", "humaneval", "sharegpt") and ALL_SUITES[:3] == SUITES
    with pytest.raises(ValueError) as err:
        bench_suites.select_prompts("nosuch", 1)
    assert all(name in str(err.value) for name in ALL_SUITES)
    assert cli.main(["bench", "--suites", "copy,nosuch"]) == 2
    message = capsys.readouterr().err
    assert "unknown suite 'nosuch'" in message and all(name in message for name in ALL_SUITES)
    assert set(bench_suites.SUITE_LABELS) == set(ALL_SUITES)
    # the batch bench and the profile make no first answers: refused before any model is loaded
    assert cli.main(["bench", "--suites", "mtbench,multiturn", "--batch-size", "2"]) == 2
    assert "--suites multiturn" in capsys.readouterr().err

    class Loaded(Exception):
        pass

    def load_target(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr("hf_treespark.hub.loading.load_target", load_target)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--suites", "copy,multiturn,math", "--output-dir", str(tmp_path / "out")])
    with pytest.raises(Loaded):  # past every check of the options, to the loading of the target
        bench.run_from_args(args)
