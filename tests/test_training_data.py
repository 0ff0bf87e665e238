"""Training data: prompt sources and mixtures, resumable regeneration with a tiny target, reference batches."""

from __future__ import annotations

import copy
import json
import logging
import sys
import types
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_treespark.hub import assets
from hf_treespark.training.data import (
    Prompt,
    ReferenceDataset,
    ReferenceSequence,
    collate_references,
    hf_dataset_prompts,
    jsonl_prompts,
    load_references,
    mix_prompts,
    parse_mixture,
    parse_mixture_spec,
    regenerate_responses,
    sharegpt_chat_prompts,
    sharegpt_later_turn_prompts,
)
from hf_treespark.training.held_out import evaluated_texts, normalised

REPO_REGEN = Path(__file__).resolve().parents[1] / "training_data" / "sharegpt_turns_smollm2_regen.jsonl.gz"


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def make_prompts(texts: list[str], prefix: str = "p") -> list[Prompt]:
    return [Prompt(id=f"{prefix}{i}", messages=[{"role": "user", "content": t}], source="test")
            for i, t in enumerate(texts)]


# ----- prompt sources ----------------------------------------------------------------------------------------


def test_jsonl_prompts_reads_messages_conversations_and_prompt_shapes(tmp_path):
    path = write_jsonl(tmp_path / "mix.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a prime."},
                      {"role": "assistant", "content": "7"}]},
        {"id": "sg1", "conversations": [{"from": "human", "value": "What is Rust?"},
                                        {"from": "gpt", "value": "A language."},
                                        {"from": "human", "value": "Who made it?"}]},
        "",
        {"prompt": "Write a haiku."},
    ])
    prompts = jsonl_prompts(path)
    assert [p.id for p in prompts] == ["mix:1", "sg1", "mix:4"]
    # The final assistant turn is the answer, not part of the prompt; earlier ones stay.
    assert [m["role"] for m in prompts[0].messages] == ["system", "user", "assistant", "user"]
    assert prompts[0].text == "Name a prime."
    assert prompts[1].messages == [{"role": "user", "content": "What is Rust?"},
                                   {"role": "assistant", "content": "A language."},
                                   {"role": "user", "content": "Who made it?"}]
    assert prompts[2].messages == [{"role": "user", "content": "Write a haiku."}]
    assert {p.source for p in prompts} == {str(path)}
    assert [p.id for p in jsonl_prompts(path, limit=2)] == ["mix:1", "sg1"]


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "no known field"}', "none of 'messages', 'conversations', 'prompt'"),
    ('{"prompt": "cut off', "line 1 column"),  # invalid JSON
    ('{"conversations": [{"from": "gpt", "value": "only an answer"}]}', "no user turn"),
    ('{"conversations": [{"from": "alien", "value": "?"}]}', "unknown ShareGPT speaker"),
    ('["a list"]', "expected a JSON object"),
])
def test_jsonl_prompts_error_names_the_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, {"prompt": "also fine"}, bad_line])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        jsonl_prompts(path)


def test_hf_dataset_prompts_asks_to_install_datasets_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        hf_dataset_prompts("some/dataset")


def test_hf_dataset_prompts_loads_files_by_extension_and_reads_every_shape(monkeypatch, tmp_path):
    calls = []
    rows = [{"id": 7, "chat": [{"from": "human", "value": "Sort a list."}, {"from": "gpt", "value": "sorted()"}]},
            {"chat": "Reverse a string."}]

    def load_dataset(path, data_files=None, split=None):
        calls.append((path, data_files, split))
        return rows

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    data_file = tmp_path / "code.jsonl"
    data_file.write_text("")
    prompts = hf_dataset_prompts(data_file, split="train", messages_field="chat")
    assert calls == [("json", str(data_file), "train")]
    assert [p.id for p in prompts] == ["7", f"{data_file}:1"]
    assert [p.messages for p in prompts] == [[{"role": "user", "content": "Sort a list."}],
                                             [{"role": "user", "content": "Reverse a string."}]]
    assert prompts[0].source == f"hf:{data_file}"

    hf_dataset_prompts("org/name", split="test", limit=1, messages_field="chat")
    assert calls[-1] == ("org/name", None, "test")
    with pytest.raises(ValueError, match=r"record 0: record has no field 'messages'"):
        hf_dataset_prompts("org/name", messages_field="messages")


def test_hf_dataset_prompts_with_the_real_datasets_package(tmp_path):
    pytest.importorskip("datasets")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "one"}, {"messages": [{"role": "user", "content": "two"}]}])
    assert [p.text for p in hf_dataset_prompts(path)] == ["one", "two"]


def test_sharegpt_prompts_split_at_position_12000_like_the_shared_data():
    train = sharegpt_chat_prompts("train")
    heldout = sharegpt_chat_prompts("heldout", limit=5)
    train_positions = [int(p.id.rsplit("@", 1)[1]) for p in train]
    heldout_positions = [int(p.id.rsplit("@", 1)[1]) for p in heldout]
    assert train_positions == sorted(train_positions) and max(train_positions) < 12_000
    assert min(heldout_positions) >= 12_000 and len(heldout) == 5
    assert len({p.id for p in train}) == len(train)  # ids stay unique although ShareGPT ids repeat
    assert all(len(p.text) >= 16 and p.source == "sharegpt" for p in train + heldout)
    # The same selection as the assets' plain-text helper, for both splits, less (in training) what evaluation asks
    # where ShareGPT repeats it (`held_out.evaluated_texts`)
    evaluated = evaluated_texts()
    kept = [text for text in assets.sharegpt_prompts("train") if normalised(text) not in evaluated]
    assert [p.text for p in train] == kept and len(kept) < len(assets.sharegpt_prompts("train"))
    assert [p.text for p in heldout] == assets.sharegpt_prompts("heldout", limit=5)


# ----- mixtures ----------------------------------------------------------------------------------------------


def test_mix_prompts_follows_the_weights_and_samples_without_replacement_first():
    a, b = make_prompts(["a"] * 50, "a"), make_prompts(["b"] * 30, "b")
    mixed = mix_prompts([(a, 3.0), (b, 2.0)], total=40, seed=1)  # weights are normalised: 0.6 / 0.4
    assert len(mixed) == 40
    assert sum(p.id.startswith("a") for p in mixed) == 24 and sum(p.id.startswith("b") for p in mixed) == 16
    assert len({p.id for p in mixed}) == 40 and "#" not in "".join(p.id for p in mixed)
    assert [p.id[0] for p in mixed] != sorted(p.id[0] for p in mixed)  # sources are interleaved

    # b must give 50 prompts but has 30: each appears once or twice, repeats renamed so ids stay unique.
    mixed = mix_prompts([(a, 0.5), (b, 0.5)], total=100, seed=1)
    from_b = [p.id for p in mixed if p.id.startswith("b")]
    assert len(from_b) == 50 and len(set(from_b)) == 50
    base_counts = {}
    for pid in from_b:
        base_counts[pid.split("#")[0]] = base_counts.get(pid.split("#")[0], 0) + 1
    assert len(base_counts) == 30 and set(base_counts.values()) == {1, 2}
    assert sorted(p.id for p in mixed if p.id.startswith("a")) == sorted(p.id for p in a)


def test_mix_prompts_is_deterministic_for_a_seed():
    a, b = make_prompts(["x"] * 20, "a"), make_prompts(["y"] * 20, "b")
    first = [p.id for p in mix_prompts([(a, 0.7), (b, 0.3)], total=15, seed=3)]
    assert first == [p.id for p in mix_prompts([(a, 0.7), (b, 0.3)], total=15, seed=3)]
    assert first != [p.id for p in mix_prompts([(a, 0.7), (b, 0.3)], total=15, seed=4)]


@pytest.mark.parametrize("weights", [(-1.0, 1.0), (0.0, 0.0), (float("nan"), 1.0)])
def test_mix_prompts_rejects_bad_weights(weights):
    with pytest.raises(ValueError, match="weights"):
        mix_prompts([(make_prompts(["x"]), weights[0]), (make_prompts(["y"]), weights[1])], total=4)


def test_mix_prompts_rejects_an_empty_source_that_has_weight():
    with pytest.raises(ValueError, match="no prompts"):
        mix_prompts([(make_prompts(["x"]), 1.0), ([], 1.0)], total=4)


def test_parse_mixture_loads_each_source_with_its_weight(tmp_path):
    code = write_jsonl(tmp_path / "code.jsonl", [{"prompt": "def f():"}, {"prompt": "class A:"}])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "hello"}])
    sources = parse_mixture(f"{code}:0.4, {chat}:0.6")
    assert [(len(prompts), w) for prompts, w in sources] == [(2, 0.4), (1, 0.6)]
    entries = parse_mixture_spec(f"sharegpt:1,hf:org/name:0.5,{code}:0")
    assert [(e.kind, e.name, e.weight) for e in entries] == [("sharegpt", "sharegpt", 1.0), ("hf", "org/name", 0.5),
                                                            ("jsonl", str(code), 0.0)]


@pytest.mark.parametrize("spec, error, message", [
    ("sharegpt", ValueError, "must be SOURCE:WEIGHT"),
    ("sharegpt:lots", ValueError, "'lots' is not a number"),
    ("sharegpt:-0.5", ValueError, "finite and >= 0"),
    ("sharegpt:inf", ValueError, "finite and >= 0"),
    ("sharegpt:0.5,", ValueError, "empty item"),
    ("hf::0.5", ValueError, "needs a dataset name"),
    ("sharegpt:0,sharegpt:0", ValueError, "no positive weight"),
    ("missing/code.jsonl:0.4", FileNotFoundError, "no such JSONL file 'missing/code.jsonl'"),
])
def test_parse_mixture_rejects_bad_specs_before_loading_anything(spec, error, message):
    with pytest.raises(error, match=message):
        parse_mixture(spec)


# ----- regeneration ------------------------------------------------------------------------------------------

MAX_NEW = 10
TEXTS = ["hi", "Write a poem about the sea and the sky in spring.", "What is 2+2?",
         "Explain quantum computing to a child in simple words, please.", "ok",
         "Translate 'good morning' into French, Spanish and German."]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(assets.default_target_path())


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model generation gains nothing from intra-op threads, and on a busy 2-core machine two threads make
    every small matmul wait for a descheduled peer (measured: 8.3 s vs 0.13 s for one regeneration run)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_target(tokenizer, one_thread):
    """A 2-layer random Llama over SmolLM2's real 49,152-id vocabulary, fp32.

    initializer_range=0.3 makes continuations depend on the prompt (at 0.02 most prompts continue alike, which
    would hide padding bugs). A token that greedy decoding of TEXTS[1] emits at step 4 is made an extra EOS, so
    some responses stop early and others run to the cap in the same batch.
    """
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, initializer_range=0.3,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    ids = chat_ids(tokenizer, TEXTS[1])
    continuation = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):]
    model.generation_config.eos_token_id = [2, int(continuation[3])]
    return model


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def read_records(path: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "an id was written twice"
    return by_id


def test_regenerated_responses_equal_unbatched_greedy_generate(tiny_target, tokenizer, tmp_path):
    long_prompt = "Summarise this: " + "lorem ipsum dolor sit amet " * 30
    prompts = make_prompts(TEXTS + [long_prompt])
    out = regenerate_responses(tiny_target, tokenizer, prompts, tmp_path / "regen.jsonl", batch_size=3,
                               max_new_tokens=MAX_NEW, max_prompt_tokens=64, progress=False)
    records = read_records(out)
    assert sorted(records) == [f"p{i}" for i in range(len(TEXTS))]  # the long prompt is skipped
    eos_ids = tiny_target.generation_config.eos_token_id
    for prompt in prompts[: len(TEXTS)]:
        ids = chat_ids(tokenizer, prompt.text)
        alone = tiny_target.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids):]
        record = records[prompt.id]
        assert record["prompt_ids"] == ids and record["prompt"] == prompt.text
        assert record["response_ids"] == alone.tolist(), prompt.id
        assert record["response"] == tokenizer.decode(alone, skip_special_tokens=True)
    lengths = [len(r["response_ids"]) for r in records.values()]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW  # early EOS and full-length rows were batched
    for r in records.values():  # cut after the first EOS, which is kept
        assert not set(r["response_ids"][:-1]) & set(eos_ids)
        assert len(r["response_ids"]) == MAX_NEW or r["response_ids"][-1] in eos_ids
    # The output is training data as it stands.
    references = load_references([out], max_length=1024)
    assert {r.id for r in references} == set(records)


def test_regeneration_resumes_after_an_interruption(tiny_target, tokenizer, tmp_path, monkeypatch):
    prompts = make_prompts(TEXTS)
    complete = read_records(regenerate_responses(tiny_target, tokenizer, prompts, tmp_path / "full.jsonl",
                                                 batch_size=2, max_new_tokens=MAX_NEW, progress=False))

    calls = []
    real_generate = tiny_target.generate

    def crashing_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        if len(calls) == 3:
            raise RuntimeError("simulated crash in the 3rd batch")
        return real_generate(*args, **kwargs)

    out = tmp_path / "resumed.jsonl"
    monkeypatch.setattr(tiny_target, "generate", crashing_generate)
    with pytest.raises(RuntimeError, match="simulated crash"):
        regenerate_responses(tiny_target, tokenizer, prompts, out, batch_size=2, max_new_tokens=MAX_NEW,
                             progress=False)
    assert len(read_records(out)) == 4  # two whole batches were flushed before the crash

    calls.clear()
    monkeypatch.setattr(tiny_target, "generate", real_generate)
    regenerate_responses(tiny_target, tokenizer, prompts, out, batch_size=2, max_new_tokens=MAX_NEW, progress=False)
    assert read_records(out) == complete
    regenerate_responses(tiny_target, tokenizer, prompts, out, batch_size=2, max_new_tokens=MAX_NEW, progress=False)
    assert read_records(out) == complete  # a finished file is left alone


def test_regeneration_repairs_a_truncated_last_line(tiny_target, tokenizer, tmp_path):
    prompts = make_prompts(TEXTS[:4])
    out = regenerate_responses(tiny_target, tokenizer, prompts, tmp_path / "regen.jsonl", batch_size=2,
                               max_new_tokens=MAX_NEW, progress=False)
    complete = read_records(out)
    lines = out.read_text().splitlines(keepends=True)

    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # crash in the middle of a record
    regenerate_responses(tiny_target, tokenizer, prompts, out, batch_size=2, max_new_tokens=MAX_NEW, progress=False)
    assert read_records(out) == complete

    out.write_text("".join(lines)[:-1])  # crash between a record and its newline: kept, newline restored
    regenerate_responses(tiny_target, tokenizer, prompts, out, batch_size=2, max_new_tokens=MAX_NEW, progress=False)
    assert out.read_text() == "".join(lines)


def test_regeneration_passes_chat_template_kwargs_for_the_deployed_mode(tiny_target, tokenizer, tmp_path):
    thinking = copy.deepcopy(tokenizer)  # a Qwen3-like template switch
    thinking.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                              "{% endfor %}<|im_start|>assistant\n"
                              "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                              "{% endif %}")
    prompts = make_prompts(["hi"])
    on = read_records(regenerate_responses(tiny_target, thinking, prompts, tmp_path / "on.jsonl", max_new_tokens=2,
                                           progress=False))
    off = read_records(regenerate_responses(tiny_target, thinking, prompts, tmp_path / "off.jsonl", max_new_tokens=2,
                                            progress=False, chat_template_kwargs={"enable_thinking": False}))
    assert thinking.decode(off["p0"]["prompt_ids"]).endswith("<think>\n\n</think>\n\n")
    assert off["p0"]["prompt_ids"][: len(on["p0"]["prompt_ids"])] == on["p0"]["prompt_ids"]


def test_regeneration_refuses_a_corrupt_middle_line_and_duplicate_ids(tiny_target, tokenizer, tmp_path):
    out = write_jsonl(tmp_path / "regen.jsonl", [{"id": "a"}, "{not json", {"id": "b"}])
    with pytest.raises(ValueError, match=r"regen\.jsonl:2: malformed line"):
        regenerate_responses(tiny_target, tokenizer, make_prompts(["x"]), out, progress=False)
    with pytest.raises(ValueError, match="duplicate prompt id 'p0'"):
        regenerate_responses(tiny_target, tokenizer, make_prompts(["x"]) * 2, tmp_path / "new.jsonl",
                             progress=False)


# ----- references --------------------------------------------------------------------------------------------


def test_load_references_truncates_and_drops_sequences_without_a_response(tmp_path):
    path = write_jsonl(tmp_path / "refs.jsonl", [
        {"id": "keep", "prompt_ids": [1, 2, 3, 4, 5], "response_ids": list(range(10, 20))},
        {"id": "one_left", "prompt_ids": list(range(7)), "response_ids": [10, 11, 12]},  # 1 response token at 8
        {"id": "prompt_too_long", "prompt_ids": list(range(12)), "response_ids": [10, 11]},
        {"id": "short", "prompt_ids": [1, 2], "response_ids": [10, 11]},
        {"prompt_ids": [1], "response_ids": [5, 6, 7]},
    ])
    refs = load_references([path], max_length=8)
    assert [(r.id, r.input_ids, r.prompt_len) for r in refs] == [
        ("keep", [1, 2, 3, 4, 5, 10, 11, 12], 5), ("short", [1, 2, 10, 11], 2), ("refs:5", [1, 5, 6, 7], 1)]
    assert [r.id for r in load_references(path, max_length=8, limit=2)] == ["keep", "short"]
    assert [r.id for r in load_references([path, path], max_length=8)] == ["keep", "short", "refs:5"] * 2


@pytest.mark.parametrize("bad_line, message", [
    ('{"id": "x", "prompt_ids": [1, 2]', "Expecting"),
    ('{"id": "x", "prompt_ids": [1, 2]}', "'response_ids' must be a list of token ids"),
    ('{"id": "x", "prompt_ids": [1, "2"], "response_ids": [3, 4]}', "'prompt_ids' must be a list of token ids"),
])
def test_load_references_names_file_and_line_of_a_malformed_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "refs.jsonl", [{"prompt_ids": [1], "response_ids": [2, 3]}, bad_line])
    with pytest.raises(ValueError, match=rf"refs\.jsonl:2: .*{message}"):
        load_references([path])


def test_load_references_reads_the_regenerated_data_the_repository_ships():
    refs = load_references([REPO_REGEN], max_length=256, limit=3)
    assert len(refs) == 3 and all(len(r.input_ids) <= 256 and len(r.input_ids) - r.prompt_len >= 2 for r in refs)
    assert refs[0].input_ids[: refs[0].prompt_len][-4:] == [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


def test_collate_references_right_pads_a_batch():
    dataset = ReferenceDataset([ReferenceSequence("a", [5, 6, 7, 8, 9], 2), ReferenceSequence("b", [5, 6, 7], 1)])
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=partial(collate_references, pad_id=2))
    batch = next(iter(loader))
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, 5)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["prompt_lens"].tolist() == [2, 1] and batch["lengths"].tolist() == [5, 3]


def test_regeneration_says_why_a_prompt_got_no_reference(tiny_target, tokenizer, tmp_path, caplog, capsys):
    """`--regenerate ... --num-prompts 2` producing 1 reference says why (here: a prompt over 384 tokens)."""
    from hf_treespark.training import cli as train_cli

    source = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "What is 2+2?"},
                                                      {"prompt": "Summarise: " + "lorem ipsum dolor sit amet " * 90}])
    args = types.SimpleNamespace(regenerate=f"{source}:1", num_prompts=2, seed=0, regen_batch_size=2,
                                 regen_max_new_tokens=MAX_NEW, regen_max_prompt_tokens=384)
    accelerator = types.SimpleNamespace(is_main_process=True, device=torch.device("cpu"),
                                        wait_for_everyone=lambda: None)
    with caplog.at_level(logging.WARNING):
        out = train_cli.regenerate(args, tiny_target, tokenizer, accelerator, tmp_path)
    assert len(read_records(out)) == 1
    assert "skipping 1 of 2 prompts: longer than max_prompt_tokens=384 tokens" in caplog.text
    assert (f"[regenerate] 1 of 2 prompts answered in {out} (the warnings above say why the others are missing)"
            in capsys.readouterr().out)
    # --regen-max-prompt-tokens raises the cap: the same run, resumed, now answers the long prompt too
    args.regen_max_prompt_tokens = 1024
    out = train_cli.regenerate(args, tiny_target, tokenizer, accelerator, tmp_path)
    assert len(read_records(out)) == 2
    assert "[regenerate] 2 of 2 prompts answered" in capsys.readouterr().out


def test_the_sharegpt_tail_lies_beyond_everything_evaluation_reads():
    """Bench, calibration and the development set read held-out first turns; the tail (training data again)
    starts past the last of them with a margin, and the held-out split stops where the tail starts."""
    from hf_treespark.training.evaluate import DEV_PROMPTS

    heldout = assets.sharegpt_first_turns("heldout")
    evaluated = max(DEV_PROMPTS.stop, 400, 4 * 20)  # dev 400-432, calibration 200-400, bench's pool of 80
    assert heldout[evaluated - 1][1] < assets.SHAREGPT_TAIL_POSITION - 1000
    assert max(position for _, position, _ in heldout) < assets.SHAREGPT_TAIL_POSITION
    tail = sharegpt_chat_prompts("tail", limit=50)
    assert len(tail) == 50 and all(int(p.id.rsplit("@", 1)[1]) >= assets.SHAREGPT_TAIL_POSITION for p in tail)
    turns = sharegpt_later_turn_prompts(limit=20, split="tail")
    assert len(turns) == 20 and all(p.source == "sharegpt_tail_turns" for p in turns)
    assert all(int(p.id.rsplit("#", 1)[0].rsplit("@", 1)[1]) >= assets.SHAREGPT_TAIL_POSITION for p in turns)
    assert [e.kind for e in parse_mixture_spec("sharegpt_tail:1,sharegpt_tail_turns:1")] == [
        "sharegpt_tail", "sharegpt_tail_turns"]
    with pytest.raises(ValueError, match="split must be"):
        sharegpt_chat_prompts("test")


def test_sharegpt_later_turns_carry_their_history_and_stay_below_the_held_out_boundary():
    prompts = sharegpt_later_turn_prompts(limit=300)
    assert len(prompts) == 300 and len({p.id for p in prompts}) == 300
    records = dict(assets.iter_sharegpt())
    for p in prompts:
        rid_at_position, turn = p.id.rsplit("#", 1)
        position = int(rid_at_position.rsplit("@", 1)[1])
        assert position < assets.SHAREGPT_HELDOUT_POSITION
        assert p.source == "sharegpt_turns" and int(turn) >= 2 and len(p.messages) == int(turn) + 1
        assert [m["role"] for m in p.messages] == ["user", "assistant"] * (len(p.messages) // 2) + ["user"]
        # the history is the record's own turns, up to and including this human turn
        assert [m["content"] for m in p.messages] == [t["value"] for t in records[position]["conversations"]][
            : len(p.messages)]
        assert len(p.text) >= 16
    assert parse_mixture_spec("sharegpt_turns:1")[0].kind == "sharegpt_turns"


def test_load_references_says_how_many_sequences_it_dropped_and_why(tmp_path, caplog):
    path = write_jsonl(tmp_path / "refs.jsonl", [{"prompt_ids": [1, 2], "response_ids": [10, 11, 12]},
                                                 {"prompt_ids": [1, 2], "response_ids": [2]},
                                                 {"prompt_ids": list(range(9)), "response_ids": [10, 11]}])
    with caplog.at_level(logging.WARNING):
        assert len(load_references(path, max_length=8)) == 1
    assert "refs.jsonl: 2 sequence(s) dropped: fewer than 2 response tokens within max_length=8" in caplog.text


def test_load_references_reads_gzip_compressed_files_and_refuses_a_cut_short_one(tmp_path):
    import gzip

    records = [{"id": f"r{i}", "prompt_ids": [1, 2, i], "response_ids": list(range(10, 15 + i))} for i in range(40)]
    plain = write_jsonl(tmp_path / "refs.jsonl", records)
    packed = tmp_path / "refs.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_references([packed]) == load_references([plain])
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: not a complete gzip file"):
        load_references([cut])
    named = tmp_path / "plain.jsonl.gz"  # plain JSONL under a .gz name: said so, not "after line 0"
    named.write_bytes(plain.read_bytes())
    with pytest.raises(ValueError, match=r"plain\.jsonl\.gz: not a gzip file .*, though its name ends in \.gz"):
        load_references([named])


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_line_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path, suffix):
    """The codec's bare message used to come out, without file or line (and text-mode decoding of 8 KB chunks
    would blame an earlier line)."""
    import gzip

    good = [json.dumps({"id": f"r{i}", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "prompt": "hi"}).encode()
            for i in range(299)]
    bad = b'{"id": "latin1", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "prompt": "caf\xe9"}'
    data = b"\r\n".join([*good, bad, *good[:5]]) + b"\r\n"  # Windows line ends are read as before
    path = tmp_path / f"refs{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    column = bad.index(b"\xe9") + 1
    message = rf"refs{suffix.replace('.', '[.]')}:300: not UTF-8 text \(byte 0xe9 at byte {column} of the line\)"
    with pytest.raises(ValueError, match=message):
        load_references([path])
    with pytest.raises(ValueError, match=message):
        jsonl_prompts(path)
    data = b"\r\n".join(good) + b"\r\n"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    assert len(load_references([path])) == 299


def test_sharegpt_later_turns_skip_records_that_do_not_alternate_or_name_an_unknown_speaker(monkeypatch):
    def turn(speaker, text):
        return {"from": speaker, "value": text}

    records = [
        (0, {"id": "ok", "conversations": [turn("human", "first question here"), turn("gpt", "an answer"),
                                           turn("human", "a follow-up question"), turn("gpt", "another")]}),
        (1, {"id": "two_humans", "conversations": [turn("human", "first question here"),
                                                   turn("human", "a follow-up question")]}),
        (2, {"id": "robot", "conversations": [turn("human", "first question here"), turn("robot", "beep"),
                                              turn("human", "a follow-up question")]}),
        (3, {"id": "gpt_first", "conversations": [turn("gpt", "hello"), turn("human", "first question here"),
                                                  turn("gpt", "an answer")]}),
        (4, {"id": "short", "conversations": [turn("human", "first question here"), turn("gpt", "an answer"),
                                              turn("human", "ok")]}),
        (assets.SHAREGPT_HELDOUT_POSITION, {"id": "held_out", "conversations": [
            turn("human", "a held-out question"), turn("gpt", "an answer"), turn("human", "a follow-up question")]}),
    ]
    monkeypatch.setattr(assets, "iter_sharegpt", lambda start=0: iter(records))
    prompts = sharegpt_later_turn_prompts()
    assert [p.id for p in prompts] == ["ok@0#2"]
    assert [m["content"] for m in prompts[0].messages] == ["first question here", "an answer", "a follow-up question"]
    assert sharegpt_later_turn_prompts(limit=1) == prompts


def test_the_committed_later_turn_data_loads_and_holds_training_records_only():
    path = Path(__file__).resolve().parents[1] / "training_data" / "sharegpt_turns_smollm2_regen.jsonl.gz"
    refs = load_references([path], max_length=1024)
    assert len(refs) == 2812  # 2,843 made, 31 dropped for asking a text evaluation asks (training_data/README.md)
    for ref in refs:
        rid_at_position, turn = ref.id.rsplit("#", 1)
        assert int(rid_at_position.rsplit("@", 1)[1]) < assets.SHAREGPT_HELDOUT_POSITION and int(turn) >= 2
        assert ref.input_ids[: ref.prompt_len][-4:] == [1, 520, 9531, 198]  # "<|im_start|>assistant\n"
        assert ref.prompt_len <= 384 and len(ref.input_ids) - ref.prompt_len <= 256


def test_chat_content_given_as_text_parts_is_read_as_its_text_and_null_content_is_refused(tmp_path):
    parts = [{"type": "text", "text": "Name a prime."}, {"type": "image_url", "image_url": {"url": "x.png"}},
             {"text": "Just one."}]
    path = write_jsonl(tmp_path / "parts.jsonl", [
        {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "7"}]},
        {"conversations": [{"from": "human", "value": [{"type": "text", "text": "What is Rust?"}]}]},
    ])
    prompts = jsonl_prompts(path)
    assert prompts[0].messages == [{"role": "user", "content": "Name a prime.\nJust one."}]
    assert prompts[1].messages == [{"role": "user", "content": "What is Rust?"}]

    null = write_jsonl(tmp_path / "null.jsonl", [
        {"prompt": "fine"},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "Well?"}]},
    ])
    with pytest.raises(ValueError, match=r"null\.jsonl:2: message 2 has no content \(null\)"):
        jsonl_prompts(null)
    number = write_jsonl(tmp_path / "number.jsonl", [{"messages": [{"role": "user", "content": 42}]}])
    with pytest.raises(ValueError, match=r"number\.jsonl:1: message 1's content is 42, not text"):
        jsonl_prompts(number)
    bad_part = write_jsonl(tmp_path / "part.jsonl", [{"messages": [{"role": "user", "content": ["hi"]}]}])
    with pytest.raises(ValueError, match=r"part\.jsonl:1: message 1's content part 1 is 'hi', not a text part"):
        jsonl_prompts(bad_part)
