"""`treespark datastore`: text files, chat JSONL and id JSONL in; an existing store is kept unless told otherwise."""

from __future__ import annotations

import json

import pytest
from conftest import VOCAB, make_drafter, make_target
from transformers import AutoTokenizer

from hf_treespark.cli import commands as cli
from hf_treespark.hub import assets
from hf_treespark.sources.datastore import DATASTORE_FILE, HEADER_TOKENS, Datastore, describe_tokenizer

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Teal is a calm blue-green colour."},
                  {"role": "user", "content": "Another one?"},
                  {"role": "assistant", "content": "Saffron, a warm yellow-orange."}]},
    {"conversations": [{"from": "human", "value": "What is a quokka?"},
                       {"from": "gpt", "value": "A small wallaby from Rottnest Island."}]},
]
VOCAB_SIZE = 49152  # the offline default target's: a directory without a drafter config gets it


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(assets.default_target_path())


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def assistant_turn(tokenizer, messages: list[dict], answer: str) -> list[int]:
    """What the store should hold for one assistant answer: the assistant header, the answer, its end of turn."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(prompt[-HEADER_TOKENS:]) + tokenizer(answer, add_special_tokens=False)["input_ids"] + \
        [tokenizer.eos_token_id]


def test_chat_jsonl_is_indexed_as_its_assistant_turns_in_the_targets_chat_template(tmp_path, tokenizer, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    assert cli.main(["datastore", "--data", data, "--output", str(tmp_path / "store")]) == 0
    assert "3 assistant turns" in capsys.readouterr().out
    store = Datastore.load(tmp_path / "store", VOCAB_SIZE)
    first = CHATS[0]["messages"]
    sharegpt = [{"role": "user", "content": "What is a quokka?"}]
    expected = [assistant_turn(tokenizer, first[:2], first[2]["content"]),
                assistant_turn(tokenizer, first[:4], first[4]["content"]),
                assistant_turn(tokenizer, sharegpt, "A small wallaby from Rottnest Island.")]
    assert [seq.tolist() for seq in store.sequences()] == expected
    # the user's words are context, not indexed: they propose nothing
    asked = tokenizer("What is a quokka", add_special_tokens=False)["input_ids"]
    assert store.lookup(asked)[0] == 0
    header = expected[0][:HEADER_TOKENS + 2]  # the assistant header and "Teal is": the answer follows
    assert store.lookup(header)[1][0].tolist()[:2] == expected[0][HEADER_TOKENS + 2: HEADER_TOKENS + 4]


def test_text_files_and_id_files_are_indexed_together(tmp_path, tokenizer, capsys):
    text = "Here is a list:\n\n1. First item\n2. Second item\n"
    (tmp_path / "notes.txt").write_text(text, encoding="utf-8")
    ids = write_jsonl(tmp_path / "refs.jsonl", [{"prompt_ids": [1, 2, 3, 4, 5, 6], "response_ids": [7, 8, 9]}])
    assert cli.main(["datastore", "--data", str(tmp_path / "notes.txt"), ids, "--output", str(tmp_path / "s")]) == 0
    assert "1 response, 1 text file" in capsys.readouterr().out
    store = Datastore.load(tmp_path / "s", VOCAB_SIZE)
    assert [seq.tolist() for seq in store.sequences()] == [
        tokenizer(text, add_special_tokens=False)["input_ids"], [3, 4, 5, 6, 7, 8, 9]]


def test_an_existing_store_is_kept_unless_force_replaces_it_or_append_adds_to_it(tmp_path, capsys):
    drafter_dir = tmp_path / "drafter"
    make_drafter(make_target("llama")).save_pretrained(drafter_dir)
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt_ids": [1, 2], "response_ids": [10, 11, 12]}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt_ids": [3], "response_ids": [20, 21]}])
    assert cli.main(["datastore", "--data", first, "--output", str(drafter_dir)]) == 0
    path = drafter_dir / DATASTORE_FILE
    before = path.read_bytes()
    capsys.readouterr()

    assert cli.main(["datastore", "--data", second, "--output", str(drafter_dir)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"treespark: error: --output {str(drafter_dir)!r} already holds a datastore "
                           f"({path}, 5 tokens): give --append to add these outputs to it, or --force to replace it")
    assert path.read_bytes() == before  # nothing the user made is lost

    assert cli.main(["datastore", "--data", second, "--output", str(drafter_dir), "--append"]) == 0
    assert "3 tokens added to the 5 already there" in capsys.readouterr().out
    merged = Datastore.load(drafter_dir, VOCAB)
    assert [s.tolist() for s in merged.sequences()] == [[1, 2, 10, 11, 12], [3, 20, 21]]

    assert cli.main(["datastore", "--data", second, "--output", str(drafter_dir), "--force"]) == 0
    assert [s.tolist() for s in Datastore.load(drafter_dir, VOCAB).sequences()] == [[3, 20, 21]]

    with pytest.raises(SystemExit) as done:
        cli.main(["datastore", "--data", second, "--output", str(drafter_dir), "--force", "--append"])
    assert done.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

    (drafter_dir / DATASTORE_FILE).write_bytes(b"cut")  # appending to a damaged store: refused, file named
    assert cli.main(["datastore", "--data", second, "--output", str(drafter_dir), "--append"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "damaged" in err and "--force" in err
    assert path.read_bytes() == b"cut"


@pytest.mark.parametrize(("files", "options", "message"), [
    ({"x.jsonl": '{"prompt": "hi"}\n'}, [],
     "x.jsonl:1: a record needs prompt_ids and response_ids (token ids) or messages / conversations (a chat); "
     "it has prompt"),
    ({"x.jsonl": json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"}, [],
     "x.jsonl:1: the conversation has no assistant turn: nothing of the target's to index"),
    ({"x.txt": "  \n"}, [], "x.txt: no text in it"),
    ({"x.txt": b"\xff\xfe"}, [], "x.txt: not UTF-8 text"),
    ({"x.txt": "Hello world"}, ["--vocab-size", "100"],
     "x.txt: the tokenizer of --target gave token id"),
    ({}, [], "--data 'missing.txt': no such file"),
    ({"x.txt": "Hello"}, ["--target", "/no/such/target"], "--target '/no/such/target': no tokenizer loads from it"),
])
def test_bad_datastore_inputs_are_refused_naming_the_file(files, options, message, tmp_path, capsys):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    data = [str(tmp_path / name) for name in files] or ["missing.txt"]
    assert cli.main(["datastore", "--data", *data, "--output", str(tmp_path / "out"), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treespark: error: ") and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out" / DATASTORE_FILE).exists()


def test_chat_content_given_as_text_parts_is_indexed_as_its_text(tmp_path, tokenizer, capsys):
    as_parts = [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Teal is a calm blue-green colour."},
                                          {"type": "image_url", "image_url": {"url": "teal.png"}}]}]}]
    data = write_jsonl(tmp_path / "parts.jsonl", as_parts)
    assert cli.main(["datastore", "--data", data, "--output", str(tmp_path / "store")]) == 0
    asked = [{"role": "user", "content": "Name a colour."}]
    assert [seq.tolist() for seq in Datastore.load(tmp_path / "store", VOCAB_SIZE).sequences()] == [
        assistant_turn(tokenizer, asked, "Teal is a calm blue-green colour.")]


@pytest.mark.parametrize(("content", "message"), [
    (None, "x.jsonl:2: message 2 has no content (null): give the turn's text, or leave the record out"),
    (7, "x.jsonl:2: message 2's content is 7, not text or a list of text parts"),
])
def test_chat_content_that_is_null_or_not_text_is_refused_naming_the_record(content, message, tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]}
    data = write_jsonl(tmp_path / "x.jsonl", [good, bad])
    assert cli.main(["datastore", "--data", data, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def write_drafter_config(directory, target_name: str | None, vocab_size: int = VOCAB_SIZE) -> None:
    """The fields of a drafter's config.json that `treespark datastore` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "treespark", "target_vocab_size": vocab_size, "target_name_or_path": target_name}))


@pytest.mark.parametrize(("target_name", "vocab_size", "names"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", VOCAB_SIZE, ["Qwen/Qwen2.5-0.5B-Instruct", "smollm2-135m-instruct"]),
    (None, VOCAB, [f"{VOCAB} ids", f"{VOCAB_SIZE} ids"]),
])
def test_a_tokenizer_other_than_the_drafters_targets_is_refused_and_force_keeps_the_good_store(
        target_name, vocab_size, names, tmp_path, capsys):
    drafter_dir = tmp_path / "drafter"
    write_drafter_config(drafter_dir, target_name, vocab_size)
    good = write_jsonl(tmp_path / "ids.jsonl", [{"prompt_ids": [1, 2], "response_ids": [10, 11, 12]}])
    assert cli.main(["datastore", "--data", good, "--output", str(drafter_dir)]) == 0
    before = (drafter_dir / DATASTORE_FILE).read_bytes()
    (tmp_path / "notes.txt").write_text("Here is a list of colours: teal, saffron.", encoding="utf-8")
    capsys.readouterr()

    assert cli.main(["datastore", "--data", str(tmp_path / "notes.txt"), "--output", str(drafter_dir),
                     "--force"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer" in err and all(name in err for name in names), err
    assert (drafter_dir / DATASTORE_FILE).read_bytes() == before
    assert sorted(p.name for p in drafter_dir.iterdir()) == ["config.json", DATASTORE_FILE]


def test_the_store_records_its_tokenizer_and_refuses_to_add_text_of_another(tmp_path, tokenizer, monkeypatch,
                                                                              capsys):
    drafter_dir = tmp_path / "drafter"
    write_drafter_config(drafter_dir, "HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "notes.txt").write_text("Here is a list of colours: teal, saffron.", encoding="utf-8")
    assert cli.main(["datastore", "--data", str(tmp_path / "notes.txt"), "--output", str(drafter_dir)]) == 0
    recorded = Datastore.load(drafter_dir, VOCAB_SIZE).tokenizer
    assert recorded["name_or_path"] == tokenizer.name_or_path and recorded["size"] == len(tokenizer)
    assert len(recorded["fingerprint"]) == 16
    before = (drafter_dir / DATASTORE_FILE).read_bytes()

    class Renumbered:  # the same name and size, two tokens' ids swapped: another tokenizer
        name_or_path = tokenizer.name_or_path
        __len__, __call__ = (lambda self: len(tokenizer)), (lambda self, *a, **k: tokenizer(*a, **k))

        def get_vocab(self):
            vocab = tokenizer.get_vocab()
            return {**vocab, "a": vocab["b"], "b": vocab["a"]}

    monkeypatch.setattr("hf_treespark.training.datastore_inputs.load_tokenizer", lambda name: Renumbered())
    (tmp_path / "more.txt").write_text("Saffron is a warm colour.", encoding="utf-8")
    assert cli.main(["datastore", "--data", str(tmp_path / "more.txt"), "--output", str(drafter_dir), "--append"]) == 2
    err = capsys.readouterr().err
    assert f"--output's datastore was built with {describe_tokenizer(recorded)}, not the tokenizer of" in err, err
    assert (drafter_dir / DATASTORE_FILE).read_bytes() == before


def test_the_same_file_given_twice_or_appended_again_is_skipped_and_said_so(tmp_path, capsys):
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt_ids": [1, 2], "response_ids": [10, 11, 12]}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt_ids": [3], "response_ids": [20, 21]}])
    copy = write_jsonl(tmp_path / "copy.jsonl", [{"prompt_ids": [1, 2], "response_ids": [10, 11, 12]}])
    same = str(tmp_path / "." / "a.jsonl")
    out = tmp_path / "store"
    assert cli.main(["datastore", "--data", first, same, copy, "--output", str(out), "--vocab-size", "64"]) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 files" in printed and "given twice" in printed and "same content as" in printed, printed
    assert [s.tolist() for s in Datastore.load(out, 64).sequences()] == [[1, 2, 10, 11, 12]]

    assert cli.main(["datastore", "--data", first, second, "--output", str(out), "--vocab-size", "64",
                     "--append"]) == 0
    printed = capsys.readouterr().out
    assert "skipped 1 file" in printed and "already in the store" in printed, printed
    assert [s.tolist() for s in Datastore.load(out, 64).sequences()] == [[1, 2, 10, 11, 12], [3, 20, 21]]
    before = (out / DATASTORE_FILE).read_bytes()

    assert cli.main(["datastore", "--data", second, "--output", str(out), "--vocab-size", "64", "--append"]) == 0
    printed = capsys.readouterr().out
    assert "already in the store" in printed and "nothing new to index" in printed, printed
    assert (out / DATASTORE_FILE).read_bytes() == before


@pytest.mark.parametrize("made_by", ["the command", "the user"])
def test_a_refused_build_leaves_no_folder_it_created(made_by, tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"prompt": "hi"}\n')
    output = tmp_path / "new" / "deeper" / "out"
    if made_by == "the user":
        output.mkdir(parents=True)
    assert cli.main(["datastore", "--data", str(tmp_path / "x.jsonl"), "--output", str(output)]) == 2
    assert "x.jsonl:1" in capsys.readouterr().err
    if made_by == "the user":
        assert output.is_dir() and not any(output.iterdir())
    else:
        assert not (tmp_path / "new").exists()
