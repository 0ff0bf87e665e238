"""`treespark train --data` on text (`training/text_references.py`): chats become one reference per assistant turn,
.txt files windows, regeneration files read as before; `--labels target` trains L_ce towards the target's own argmax."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark.decoding.engine import target_features
from hf_treespark.hub import assets
from hf_treespark.training import cli as train_cli
from hf_treespark.training import objective as objective_module
from hf_treespark.training.data import load_references
from hf_treespark.training.losses import reference_ce_loss
from hf_treespark.training.objective import LossConfig, TrainingObjective
from hf_treespark.training.text_references import load_training_data
from hf_treespark.training.trainer import replay_policy

CHAT = {"messages": [{"role": "user", "content": "What colour is the sky?"},
                     {"role": "assistant", "content": "Blue, like the sea."},
                     {"role": "user", "content": "And grass?"},
                     {"role": "assistant", "content": "Green."}]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets.default_target_path())


def test_a_chat_gives_one_reference_per_assistant_turn_after_its_templated_prompt(tokenizer, tmp_path):
    (tmp_path / "chats.jsonl").write_text(json.dumps(CHAT) + "\n")
    refs = load_training_data([tmp_path / "chats.jsonl"], lambda: tokenizer, max_length=512)
    assert [r.id for r in refs] == ["chats.jsonl:1#0", "chats.jsonl:1#1"]
    for ref, k in zip(refs, (1, 3), strict=True):
        prompt = tokenizer.apply_chat_template(CHAT["messages"][:k], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        assert ref.input_ids[:ref.prompt_len] == list(prompt)
        assert tokenizer.decode(ref.input_ids[ref.prompt_len:]) == CHAT["messages"][k]["content"] + "<|im_end|>"
    whole = tokenizer.apply_chat_template(CHAT["messages"], tokenize=True, return_dict=False)
    assert refs[1].input_ids == list(whole)[:len(refs[1].input_ids)]  # the second turn sees the first one

    short = load_training_data([tmp_path / "chats.jsonl"], lambda: tokenizer, max_length=8)[1]
    turn = tokenizer("Green.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert short.input_ids[short.prompt_len:] == turn  # the turn is whole; the prompt gave way
    assert len(short.input_ids) == 8 and short.input_ids[:short.prompt_len] == refs[1].input_ids[
        refs[1].prompt_len - short.prompt_len:refs[1].prompt_len]
    assert tokenizer.decode(short.input_ids[:short.prompt_len]).endswith("<|im_start|>assistant\n")


def test_text_files_are_windows_and_regeneration_files_read_as_before(tokenizer, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. " * 12
    (tmp_path / "notes.txt").write_text(text)
    regen = [{"id": "r1", "prompt_ids": [5, 6, 7], "response_ids": list(range(10, 40))},
             {"id": "r2", "prompt_ids": [5], "response_ids": [8]}]  # too short: dropped, as load_references drops it
    (tmp_path / "refs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in regen))
    refs = load_training_data([tmp_path / "notes.txt", tmp_path / "refs.jsonl"], lambda: tokenizer, max_length=32)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [r for r in refs if r.id.startswith("notes.txt#")]
    assert [w.id for w in windows] == [f"notes.txt#{i}" for i in range(len(windows))]
    assert sum((w.input_ids for w in windows), []) == ids[:sum(len(w.input_ids) for w in windows)]
    assert all(w.prompt_len == 1 and len(w.input_ids) <= 32 for w in windows)
    assert refs[len(windows):] == load_references(tmp_path / "refs.jsonl", max_length=32)
    assert len(load_training_data([tmp_path / "notes.txt", tmp_path / "refs.jsonl"], lambda: tokenizer,
                                  max_length=32, limit=3)) == 3


def test_a_regeneration_file_never_loads_the_tokenizer(tmp_path):
    (tmp_path / "refs.jsonl").write_text(json.dumps({"prompt_ids": [5, 6], "response_ids": [7, 8, 9]}) + "\n")
    refs = load_training_data([tmp_path / "refs.jsonl"], lambda: pytest.fail("loaded a tokenizer"), max_length=64)
    assert [r.input_ids for r in refs] == [[5, 6, 7, 8, 9]]


@pytest.mark.parametrize("name, content, message", [
    ("chats.jsonl", {"messages": [{"role": "user", "content": "hi"}]}, "chats.jsonl:1: the conversation has no "
                                                                        "assistant turn"),
    ("odd.jsonl", {"prompt": "hi"}, "odd.jsonl:1: a record needs prompt_ids and response_ids (token ids) or "
                                    "messages / conversations"),
    ("ids.jsonl", {"prompt_ids": [1], "response_ids": [2, 99999]}, "ids.jsonl:1: 'response_ids' holds token id "
                                                                   "99999"),
])
def test_unreadable_records_are_refused_naming_file_and_line(tokenizer, tmp_path, name, content, message):
    (tmp_path / name).write_text(json.dumps(content) + "\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_training_data([tmp_path / name], lambda: tokenizer, vocab_size=len(tokenizer))


def test_a_text_that_is_not_utf8_is_refused(tokenizer, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape("latin1.txt: not UTF-8 text (byte 4)")):
        load_training_data([tmp_path / "latin1.txt"], lambda: tokenizer)


def _ce_targets(monkeypatch, labels: str, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The targets `L_ce` is computed against, for `input_ids` `[1, T]` and `anchors` `[1, A]`, as `[A, B]`."""
    target = make_target("llama")
    drafter = make_drafter(target).float().bind_target(target)
    captured = {}

    def capture(logits, targets, weights):
        captured["targets"] = targets
        return reference_ce_loss(logits, targets, weights)

    monkeypatch.setattr(objective_module, "reference_ce_loss", capture)
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        features, hidden = target_features(target, drafter.config.target_layer_ids, input_ids, mask)
        TrainingObjective(drafter, LossConfig(surv=0.0, cov=0.0), replay_policy(drafter.config), labels=labels)(
            input_ids, mask, torch.tensor([input_ids.shape[1]]), features.float(), hidden.float(), anchors,
            torch.ones_like(anchors, dtype=torch.bool))
    return captured["targets"].view(anchors.shape[1], -1), target


def test_target_labels_are_the_targets_own_argmax_at_each_position_of_the_text(monkeypatch):
    text = torch.randint(4, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([[3, 7, 12]])  # from 3 on, the greedy text below is the target's own
    block = make_drafter(make_target("llama")).config.block_size
    positions = anchors[0, :, None] + torch.arange(block)  # the target's distribution at a + k - 1 predicts y_k

    by_text, _ = _ce_targets(monkeypatch, "text", text, anchors)
    assert torch.equal(by_text, text[0, positions + 1])
    by_target, target = _ce_targets(monkeypatch, "target", text, anchors)
    with torch.no_grad():
        argmax = target(text).logits.argmax(-1)[0]
    assert torch.equal(by_target, argmax[positions])
    assert not torch.equal(by_target, by_text)  # random text is not what the target would write

    greedy = target.generate(text[:, :4], do_sample=False, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(_ce_targets(monkeypatch, "target", greedy, anchors)[0],
                       _ce_targets(monkeypatch, "text", greedy, anchors)[0])  # on its own answers: the same


def test_train_reads_text_with_target_labels_and_refuses_unknown_files(tmp_path, monkeypatch, capsys):
    target = make_target("llama")

    class CharTokenizer:  # the tiny target's 128 ids: one per character
        chat_template = None

        def __call__(self, text, add_special_tokens=False, **kwargs):
            return {"input_ids": [4 + ord(c) % 120 for c in text]}

    monkeypatch.setattr(train_cli, "load_target", lambda name, with_tokenizer: (target, None))
    monkeypatch.setattr("hf_treespark.training.datastore_inputs.load_tokenizer", lambda name: CharTokenizer())
    (tmp_path / "notes.txt").write_text("the cat sat on the mat. " * 12)
    tiny = ["--mixed-precision", "no", "--draft-layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
            "--intermediate-size", "64", "--markov-rank", "16", "--mask-token-id", "3", "--anchors", "8"]
    argv = ["--data", str(tmp_path / "notes.txt"), "--max-length", "64", "--max-steps", "2", "--batch-size", "2",
            "--output-dir", str(tmp_path / "run"), *tiny]
    assert train_cli.main([*argv, "--labels", "target"]) == 0
    assert "trained 2 steps" in capsys.readouterr().out
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert state["config"]["labels"] == "target"
    assert train_cli.main([*argv, "--max-steps", "3", "--labels", "text"]) == 2  # a resume under other labels
    assert "labels 'target' there, 'text' here" in capsys.readouterr().err

    (tmp_path / "notes.csv").write_text("a,b\n")
    assert train_cli.main(["--data", str(tmp_path / "notes.csv"), "--output-dir", str(tmp_path / "other")]) == 2
    assert "--data" in capsys.readouterr().err and not (tmp_path / "other").exists()


def test_help_says_which_labels_train_uses(capsys):
    with pytest.raises(SystemExit):
        train_cli.main(["--help"], prog="train_drafter.py")
    text = " ".join(capsys.readouterr().out.split())
    assert "--labels {text,target}" in text
    assert "the target's own most likely token at that position, teacher-forced on the given text" in text
    assert "chat JSONL (messages or conversations: one sequence per assistant turn" in text
