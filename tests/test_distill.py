"""Distilling the depth-1 head from any text (`training/distill.py`): the target's teacher-forced argmax as labels,
batched extraction, which positions each source labels, streamed training that resumes, stored shards within a disk
budget, and refusals before anything loads."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark.hub import assets
from hf_treespark.training import distill, distill_extract, distill_stream
from hf_treespark.training.data import ReferenceSequence
from hf_treespark.training.depth1 import PositionShards, block_signature, extract, grow_depth1_head
from hf_treespark.training.distill_extract import distil_batch, distil_to_shards, position_bytes
from hf_treespark.training.distill_sources import TextSequence, sources_fingerprint, text_sequences
from hf_treespark.training.distill_stream import DistilTrainer, StreamConfig, distil_stream

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def grown():
    target = make_target("qwen3")
    drafter = grow_depth1_head(make_drafter(target), 32).bind_target(target).eval()
    return target, drafter


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets.default_target_path())


def anchored_text(tokenizer, sequence: TextSequence) -> str:
    return tokenizer.decode([t for t, on in zip(sequence.input_ids, sequence.labelled, strict=True) if on])


def motif_sequences(count: int, length: int = 24, seed: int = 0) -> list[TextSequence]:
    """Texts of a repeated 4-token motif each, every position after the first labelled."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        motif = torch.randint(4, 128, (4,), generator=gen).tolist()
        out.append(TextSequence(f"m{i}", (motif * length)[:length], [a > 0 for a in range(length)]))
    return out


class CharTokenizer:
    """A stand-in tokenizer for the tiny target's 128 ids: one id per character."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False, **kwargs):
        return {"input_ids": [4 + ord(c) % 120 for c in text]}

    def __len__(self):
        return 128


def test_distilled_positions_of_the_targets_own_continuation_are_what_extract_writes(grown, tmp_path):
    target, drafter = grown
    gen = torch.Generator().manual_seed(0)
    refs = []
    for i in range(3):  # different lengths: the batched forward pads
        prompt = torch.randint(4, 128, (1, 4 + 3 * i), generator=gen)
        ids = target.generate(prompt, do_sample=False, max_new_tokens=9 + 5 * i, pad_token_id=0)[0].tolist()
        refs.append(ReferenceSequence(id=f"r{i}", input_ids=ids, prompt_len=prompt.shape[1]))
    assert all(len(r.input_ids) - r.prompt_len >= 4 for r in refs)
    shards = PositionShards(tmp_path, block_signature(drafter))
    extract(target, drafter, refs, shards, progress=False)
    want = shards.load()
    sequences = [TextSequence(r.id, r.input_ids, [r.prompt_len <= a < len(r.input_ids) - 1
                                                  for a in range(len(r.input_ids))]) for r in refs]
    seconds = {}
    got = distil_batch(target, drafter, sequences, chunk=5, pieces_per_pass=3, seconds=seconds)  # rows share passes
    assert set(got) == set(want) and seconds["target"] > 0 and seconds["drafter"] > 0
    assert torch.equal(got["token"], want["token"])
    assert torch.equal(got["label"], want["label"])  # on its own greedy text the target's argmax is the next token
    for field in ("features", "hidden"):
        assert got[field].dtype == torch.bfloat16
        assert torch.allclose(got[field].float(), want[field].float(), atol=0.02, rtol=0.02), field


def test_a_bf16_targets_drafter_passes_run_in_bf16_and_match_float32_passes(grown, monkeypatch):
    """With a half-precision target the drafter's passes run under autocast to it (as at inference): `h_1` then
    differs from float32 passes on the same features only by bf16's rounding."""
    target, drafter = grown
    target = target.to(torch.bfloat16)
    sequences = motif_sequences(3)
    seen, references, real = [], [], distill_extract._anchor_states

    def spy(d, ids, features, *rest):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        with torch.autocast("cpu", enabled=False):
            references.append(real(d, ids, features.float(), *rest))
        return real(d, ids, features, *rest)

    monkeypatch.setattr(distill_extract, "_anchor_states", spy)
    got = distil_batch(target, drafter, sequences, anchors="all")
    assert seen == [torch.bfloat16] and drafter.fc.weight.dtype == torch.float32
    full = {"hidden": references[0].to(torch.bfloat16)}
    assert torch.allclose(got["hidden"].float(), full["hidden"].float(), atol=0.05, rtol=0.05)
    assert not torch.equal(got["hidden"], full["hidden"])  # computed in bf16, not merely stored in it


def test_a_distilled_label_is_the_targets_argmax_at_that_position_of_any_text(grown):
    target, drafter = grown
    gen = torch.Generator().manual_seed(3)
    sequences = [TextSequence(f"t{i}", torch.randint(4, 128, (n,), generator=gen).tolist(), [a > 0 for a in range(n)])
                 for i, n in enumerate((9, 17, 12))]
    got = distil_batch(target, drafter, sequences, anchors="all")
    with torch.no_grad():
        argmax = [target(torch.tensor([s.input_ids])).logits[0, 1:].argmax(-1) for s in sequences]
    assert len(got["label"]) == 8 + 16 + 11
    assert torch.equal(got["label"], torch.cat(argmax))
    following = torch.cat([torch.tensor(s.input_ids[2:] + [-1]) for s in sequences])
    assert not torch.equal(got["label"], following)  # the target's own choice, not the text's next token
    assert torch.equal(got["token"], torch.cat([torch.tensor(s.input_ids[1:]) for s in sequences]))


def test_agreeing_anchors_are_the_positions_whose_token_is_the_targets_argmax_at_the_one_before(grown):
    target, drafter = grown
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, 128, (1, 5), generator=gen)
    own = target.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)[0].tolist()
    noise = torch.randint(4, 128, (14,), generator=gen).tolist()
    texts = [own, noise, own[:9] + noise[:6]]  # the target's own text, noise, and its text turning to noise
    sequences = [TextSequence(f"t{i}", ids, [a > 0 for a in range(len(ids))]) for i, ids in enumerate(texts)]
    every = distil_batch(target, drafter, sequences, anchors="all")
    kept = distil_batch(target, drafter, sequences, anchors="agreeing")
    with torch.no_grad():
        before = [target(torch.tensor([ids])).logits[0, :-1].argmax(-1) for ids in texts]
    agree = torch.cat([b == torch.tensor(ids[1:]) for b, ids in zip(before, texts, strict=True)])
    assert 0 < int(agree.sum()) < len(agree)
    for field in ("token", "label"):
        assert torch.equal(kept[field], every[field][agree])
    assert torch.equal(kept["features"], every["features"][agree])
    assert torch.allclose(kept["hidden"].float(), every["hidden"][agree].float(), atol=0.02, rtol=0.02)
    assert bool(agree[4:16].all())  # the target's own continuation agrees at every anchor after its prompt
    with pytest.raises(ValueError, match="anchors"):
        distil_batch(target, drafter, sequences, anchors="some")


def test_chat_files_label_their_assistant_turns_and_text_files_every_position(tokenizer, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sea."},
        {"role": "user", "content": "assistant"}, {"role": "assistant", "content": "Green."}]}) + "\n\n"
        + json.dumps({"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]})
        + "\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("Plain text is labelled everywhere.\n")
    sequences = list(text_sequences([str(chats), str(notes)], tokenizer, "assistant", 512))
    assert [s.id for s in sequences] == ["chats.jsonl:1#0", "chats.jsonl:3#0", "notes.txt#0"]
    assert anchored_text(tokenizer, sequences[0]) == "Blue, like the sea.Green."
    assert sequences[0].input_ids == tokenizer.apply_chat_template(
        json.loads(chats.read_text().splitlines()[0])["messages"], tokenize=True, return_dict=False)
    assert anchored_text(tokenizer, sequences[1]) == "4"
    assert sequences[2].labelled == [False] + [True] * (len(sequences[2].input_ids) - 1)

    windows = list(text_sequences([str(chats)], tokenizer, "all", 16))
    assert all(len(w.input_ids) <= 16 and not w.labelled[0] and all(w.labelled[1:]) for w in windows)
    assert [t for w in windows if w.id.startswith("chats.jsonl:1#") for t in w.input_ids] == sequences[0].input_ids
    cut, whole = {w.id: w for w in text_sequences([str(chats)], tokenizer, "assistant", 24)}, sequences[0]
    assert "chats.jsonl:1#0" not in cut  # the system prompt and the first question: no anchor, no window
    for w in range(0, math.ceil(len(whole.input_ids) / 24)):
        flags = [False] + whole.labelled[24 * w + 1:24 * (w + 1)]
        if any(flags):
            assert cut[f"chats.jsonl:1#{w}"].input_ids == whole.input_ids[24 * w:24 * (w + 1)]
            assert cut[f"chats.jsonl:1#{w}"].labelled == flags
        else:
            assert f"chats.jsonl:1#{w}" not in cut


def test_regenerated_answers_label_their_response_tokens_whatever_the_positions(tokenizer, tmp_path):
    """A regeneration file (the target's own answers, tokenised) is a source: the prompt is context, every response
    token an anchor, in windows like any text; `--positions all` changes nothing there."""
    regen = tmp_path / "references.jsonl"
    regen.write_text(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11]}) + "\n"
                     + json.dumps({"prompt_ids": [], "response_ids": [12, 13]}) + "\n")
    for positions in ("assistant", "all"):
        sequences = list(text_sequences([str(regen)], tokenizer, positions, 512))
        assert [s.id for s in sequences] == ["references.jsonl:1#0", "references.jsonl:2#0"]
        assert sequences[0].input_ids == [5, 6, 7, 8, 9, 10, 11]
        assert sequences[0].labelled == [False] * 3 + [True] * 4
        assert sequences[1].labelled == [False, True]  # position 0 has no features before it
    windows = list(text_sequences([str(regen)], tokenizer, "assistant", 3))  # a window's first position: context
    assert [(w.id, w.input_ids, w.labelled) for w in windows] == [
        ("references.jsonl:1#1", [8, 9, 10], [False, True, True]), ("references.jsonl:2#0", [12, 13], [False, True])]


def test_sharegpt_is_distilled_whole_and_never_from_the_heldout_band(tokenizer, monkeypatch):
    def conversation(p):
        return {"id": f"r{p}", "conversations": [{"from": "human", "value": f"question {p}"},
                                                 {"from": "gpt", "value": f"answer {p}"},
                                                 {"from": "human", "value": "more"}, {"from": "gpt", "value": "yes"}]}

    records = [(p, conversation(p)) for p in (0, 11999, 12000, 13999, 14000)]
    records.insert(1, (5, {"id": "odd", "conversations": [{"from": "gpt", "value": "no human turn first"}]}))
    monkeypatch.setattr(assets, "iter_sharegpt", lambda start=0: iter(r for r in records if r[0] >= start))
    sequences = list(text_sequences(["sharegpt"], tokenizer, "assistant", 512))
    assert [s.id for s in sequences] == ["sharegpt:r0@0#0", "sharegpt:r11999@11999#0", "sharegpt:r14000@14000#0"]
    assert anchored_text(tokenizer, sequences[2]) == "answer 14000yes"


def test_the_fingerprint_follows_the_sources_their_contents_and_the_options(tokenizer, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_text("some text")
    b.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    first = sources_fingerprint([str(a), str(b)], "assistant", 512, tokenizer)
    assert first == sources_fingerprint([str(a), str(b)], "assistant", 512, tokenizer)
    others = {sources_fingerprint([str(b), str(a)], "assistant", 512, tokenizer),
              sources_fingerprint([str(a), str(b)], "all", 512, tokenizer),
              sources_fingerprint([str(a), str(b)], "assistant", 256, tokenizer),
              sources_fingerprint([str(a), str(b), "sharegpt"], "assistant", 512, tokenizer),
              sources_fingerprint([str(a), str(b)], "assistant", 512, CharTokenizer())}
    a.write_text("other text")
    others.add(sources_fingerprint([str(a), str(b)], "assistant", 512, tokenizer))
    assert first not in others and len(others) == 6


def test_streamed_training_learns_and_a_stopped_run_resumes_at_its_stream_position(grown, tmp_path, monkeypatch):
    target, drafter = grown
    sequences = motif_sequences(40)
    dev = {"dev": distil_batch(target, drafter, sequences[:4], anchors="all")}
    config = StreamConfig(batch_size=4, buffer_positions=256, passes=3.0, max_positions=600, eval_every=20,
                          save_every=10, anchors="all")

    def crashing():
        for i, sequence in enumerate(sequences):
            if i == 14:
                raise KeyboardInterrupt
            yield sequence

    first = DistilTrainer(drafter, tmp_path / "run", fingerprint="f1", lr=3e-3, batch_size=32, warmup=5)
    with pytest.raises(KeyboardInterrupt):
        distil_stream(target, drafter, crashing(), first, dev, config, progress=False)

    again = grow_depth1_head(make_drafter(target), 32).bind_target(target).eval()
    with pytest.raises(ValueError, match="other --sources"):
        DistilTrainer(again, tmp_path / "run", fingerprint="f2").resume()
    resumed = DistilTrainer(again, tmp_path / "run", fingerprint="f1", lr=3e-3, batch_size=32, warmup=5)
    assert resumed.resume()
    at, step = resumed.stream["sequences_done"], resumed.step
    assert 0 < at < 14 and step > 0 and step % 10 == 0
    distilled = []
    real = distill_stream.distil_batch
    monkeypatch.setattr(distill_stream, "distil_batch",
                        lambda t, d, batch, **kw: distilled.extend(batch) or real(t, d, batch, **kw))
    windows = resumed.stream["buffer"]["windows"]
    replayed, first = sum(count for _, count, _ in windows), windows[0][0]
    curve = distil_stream(target, again, iter(sequences), resumed, dev, config, progress=False)
    # the windows whose positions the shuffle buffer held are distilled again, then the stream goes on where the
    # checkpoint says
    assert [s.id for s in distilled[:replayed]] == [s.id for s in sequences[first:at]]
    assert distilled[replayed].id == sequences[at].id
    assert resumed.stream["positions_seen"] == 600 and resumed.step == math.ceil(3.0 * 600 / 32)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[-1] == curve[-1] and rows[-1]["step"] == resumed.step
    assert all(r["positions_per_s"] > 0 and r["positions_seen"] <= 600 for r in rows[1:])
    assert rows[-1]["positions_seen"] == 600
    assert rows[-1]["dev_top1"] > rows[0]["dev_top1"] + 20  # repeated motifs: the head learns them
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == resumed.step and state["stream"]["positions_seen"] == 600


def test_stored_positions_stay_within_their_budget_and_resume_without_repeats(grown, tmp_path):
    target, drafter = grown
    width = drafter.config.num_target_features * drafter.config.target_hidden_size
    assert position_bytes(drafter) == 2 * width + 2 * drafter.config.hidden_size + 16
    shards = PositionShards(tmp_path, "signature")
    sequences = motif_sequences(12)
    state = distil_to_shards(target, drafter, sequences, shards, max_positions=50, batch_size=1, shard_positions=20,
                             progress=False, anchors="all")
    assert state["positions"] == 50 and state["references_done"] == 3 and state["shards"] == 3  # 23, 23, then 4
    first = shards.load()
    state = distil_to_shards(target, drafter, sequences, shards, max_positions=120, batch_size=2, shard_positions=20,
                             progress=False, anchors="all")
    data = shards.load()
    assert state["positions"] == len(data["label"]) == 120 and state["references_done"] == 7
    assert all(torch.equal(data[k][:50], first[k]) for k in first)
    tokens = [s.input_ids[1:] for s in sequences]  # the window cut at the limit counts as done: never taken again
    expected = tokens[0] + tokens[1] + tokens[2][:4] + tokens[3] + tokens[4] + tokens[5] + tokens[6][:1]
    assert data["token"].tolist() == expected


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def test_help_says_which_labels_it_uses():
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "the target's argmax at each position of the given text, teacher-forced (nothing is generated)" in text


@pytest.mark.parametrize("argv, message", [
    (["--sources", "data.csv"], "give 'sharegpt', a .txt file or a .jsonl"),
    (["--sources", "missing.txt"], "missing.txt: no such file"),
    (["--sources", "sharegpt", "sharegpt"], "'sharegpt' is listed twice"),
    (["--max-length", "1"], "--max-length"),
    (["--batch-size", "0"], "--batch-size"),
    (["--passes", "nan"], "--passes"),
    (["--buffer-positions", "100"], "--buffer-positions 100 is smaller than --train-batch-size 256"),
    (["--max-positions", "0"], "--max-positions"),
    (["--max-disk-gb", "0"], "--max-disk-gb"),
    (["--lr", "-1"], "--lr"),
    (["--drafter", "."], "has no config.json"),
    (["--dev-data", "missing.jsonl"], "missing.jsonl: no such file"),
    (["--sources", "garbage.jsonl"], "garbage.jsonl:2: not a JSON line"),
    (["--sources", "prompts.jsonl"], "prompts.jsonl:1: a record needs 'messages' or 'conversations' (a chat)"),
    (["--sources", "regen.jsonl"], "regen.jsonl:1: 'response_ids' must be a list of token ids"),
    (["--sources", "latin1.txt"], "latin1.txt: not UTF-8 text (byte 4)"),
    (["--device", "gpu"], "--device 'gpu' is not a device: use cpu, cuda or cuda:N"),
    (["--device", "cuda:7"], "--device cuda:7: this machine has"),
])
def test_bad_arguments_are_refused_before_anything_loads(tmp_path, monkeypatch, argv, message):
    from hf_treespark.training import cli as training_cli

    monkeypatch.setattr(training_cli, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage.jsonl").write_text(json.dumps({"messages": []}) + "\n{not json\n")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (tmp_path / "regen.jsonl").write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": "3 4"}) + "\n")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(message)):
        distill.run(parse("--output-dir", tmp_path / "out", *argv))
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        distill.run(parse("--output-dir", tmp_path / "file"))


def test_a_distil_run_trains_saves_and_a_rerun_resumes(tmp_path, monkeypatch, capsys, device_under_test):
    """On the device under test (`TREESPARK_TEST_DEVICE`: the device check runs it on a GPU too)."""
    from hf_treespark import TreeSparkDrafter
    from hf_treespark.training import cli as training_cli

    target = make_target("qwen3")
    grow_depth1_head(make_drafter(target), 16).save_pretrained(tmp_path / "drafter")
    asked = []

    def load_target(name, with_tokenizer, device):
        asked.append(device)
        return target.to(device), CharTokenizer()

    monkeypatch.setattr(training_cli, "load_target", load_target)
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 20)
    (tmp_path / "dev.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11, 12]}))
    argv = ["--drafter", tmp_path / "drafter", "--sources", tmp_path / "a.txt", "--dev-data", tmp_path / "dev.jsonl",
            "--max-length", 64, "--batch-size", 2, "--train-batch-size", 16, "--buffer-positions", 64,
            "--max-positions", 200, "--eval-every", 5, "--anchors", "all", "--device", str(device_under_test),
            "--output-dir", tmp_path / "out"]
    assert distill.run(parse(*argv)) == 0
    assert asked == [str(device_under_test)]
    out = capsys.readouterr().out
    assert "200 positions" in out and "resumed" not in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == math.ceil(200 / 16) and rows[-1]["positions_seen"] == 200
    loaded = TreeSparkDrafter.from_pretrained(tmp_path / "out" / "final")
    assert loaded.config.depth1_head == 16
    assert distill.run(parse(*argv)) == 0
    assert f"resumed at step {rows[-1]['step']}" in capsys.readouterr().out
    for other in (("--positions", "all"), ("--anchors", "agreeing")):
        with pytest.raises(ValueError, match="other --sources, --positions, --anchors, --max-length or --target"):
            distill.run(parse(*argv, *other))
    with pytest.raises(ValueError, match=re.escape("other --max-disk-gb (stored or streamed)")):
        distill.run(parse(*argv, "--max-disk-gb", 1))

    assert distill.run(parse(*argv[:-1], tmp_path / "stored", "--max-disk-gb", 1e-9 * 150 * 5000)) == 0
    assert "positions stored" in capsys.readouterr().out


def test_the_throughput_script_refuses_bad_arguments_before_loading():
    done = subprocess.run([sys.executable, "scripts/distil_throughput.py", "--batch-sizes", "4,0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--batch-sizes" in done.stderr.strip().splitlines()[-1]


def test_the_throughput_script_times_each_phase_of_a_batch(grown):
    import importlib.util

    spec = importlib.util.spec_from_file_location("distil_throughput", REPO / "scripts" / "distil_throughput.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    target, drafter = grown
    args = argparse.Namespace(batches=2, train_steps=2, train_batch_size=16, passes=1.0, anchors="all")
    row = script.measure(target, drafter, iter(motif_sequences(9)), 3, args)
    assert row["positions"] == 3 * 23 and row["tokens"] == 3 * 24
    assert all(row[k] > 0 for k in ("target", "drafter", "train", "end_to_end"))
    assert row["end_to_end"] < min(row["target"], row["drafter"], row["train"])


def test_an_interrupted_streamed_run_resumes_with_its_shuffle_buffer_and_ends_as_an_uninterrupted_one(tmp_path):
    """The positions in the shuffle buffer at the checkpoint are not lost: the resumed run refills the buffer with
    them (re-distilling their windows, not counting them again) and trains on what the uninterrupted run would."""
    target = make_target("qwen3")
    sequences = motif_sequences(40)

    def fresh():
        return grow_depth1_head(make_drafter(target), 32).bind_target(target).eval()

    config = StreamConfig(batch_size=4, buffer_positions=256, passes=3.0, max_positions=600, eval_every=1000,
                          save_every=10, anchors="all")
    dev = {"dev": distil_batch(target, fresh(), sequences[:4], anchors="all")}
    whole = DistilTrainer(fresh(), tmp_path / "whole", fingerprint="f", lr=3e-3, batch_size=32, warmup=5)
    distil_stream(target, whole.drafter, iter(sequences), whole, dev, config, progress=False)

    def crashing():
        for i, sequence in enumerate(sequences):
            if i == 22:
                raise KeyboardInterrupt
            yield sequence

    first = DistilTrainer(fresh(), tmp_path / "run", fingerprint="f", lr=3e-3, batch_size=32, warmup=5)
    with pytest.raises(KeyboardInterrupt):
        distil_stream(target, first.drafter, crashing(), first, dev, config, progress=False)
    resumed = DistilTrainer(fresh(), tmp_path / "run", fingerprint="f", lr=3e-3, batch_size=32, warmup=5)
    assert resumed.resume() and resumed.step % 10 == 0 and resumed.step > 0
    distil_stream(target, resumed.drafter, iter(sequences), resumed, dev, config, progress=False)
    assert resumed.step == whole.step and resumed.stream["positions_seen"] == whole.stream["positions_seen"] == 600
    for key, value in whole.drafter.depth1_head.state_dict().items():
        assert torch.allclose(resumed.drafter.depth1_head.state_dict()[key], value, atol=1e-6, rtol=0), key


def _cli_argv(tmp_path, source: Path, *extra) -> list:
    return ["--drafter", tmp_path / "drafter", "--sources", source, "--dev-data", tmp_path / "dev.jsonl",
            "--max-length", 64, "--batch-size", 2, "--train-batch-size", 16, "--buffer-positions", 64,
            "--max-positions", 200, "--eval-every", 5, "--anchors", "all", "--output-dir", tmp_path / "out", *extra]


@pytest.fixture
def cli_files(tmp_path, monkeypatch):
    """A saved tiny drafter, a development file and the tiny target behind `load_target`."""
    from hf_treespark.training import cli as training_cli

    target = make_target("qwen3")
    grow_depth1_head(make_drafter(target), 16).save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr(training_cli, "load_target", lambda name, with_tokenizer, device: (target, CharTokenizer()))
    (tmp_path / "dev.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11, 12]}))
    return tmp_path


@pytest.mark.parametrize("stored", [False, True])
def test_a_distil_run_with_nothing_to_learn_from_fails_and_saves_nothing(cli_files, stored):
    """Sources that yield no labelled position used to end in exit 0 and an untrained `final/`."""
    tmp_path = cli_files
    (tmp_path / "empty.txt").write_text("")
    extra = ("--max-disk-gb", 1) if stored else ()
    with pytest.raises(ValueError, match=re.escape(f"no position to learn from in --sources {tmp_path / 'empty.txt'}")):
        distill.run(parse(*_cli_argv(tmp_path, tmp_path / "empty.txt", *extra)))
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.parametrize("content, message", [
    ("{", "is not JSON"), ("[1]", "holds a JSON list, not an object"),
    ('{"mode": "streamed", "sources": 3, "drafter": "x"}', "field 'sources' is 3, not a fingerprint"),
    (b"\xff", "is not UTF-8 text"),
])
def test_a_damaged_distil_json_is_refused_naming_the_file_and_the_field(cli_files, content, message):
    tmp_path = cli_files
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 20)
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / "distil.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(message)):
        distill.run(parse(*_cli_argv(tmp_path, tmp_path / "a.txt")))


def test_a_disk_budget_too_small_for_one_step_says_what_the_run_needs(cli_files):
    tmp_path = cli_files
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 20)
    with pytest.raises(ValueError) as refused:
        distill.run(parse(*_cli_argv(tmp_path, tmp_path / "a.txt", "--max-disk-gb", 1e-9)))
    text = str(refused.value)
    drafter = grow_depth1_head(make_drafter(make_target("qwen3")), 16)
    each = position_bytes(drafter)
    assert f"--max-disk-gb 1e-09 holds 0 positions of {each:,} bytes" in text
    assert f"--train-batch-size 16 needs at least {16 * each / 1e9:.3g} GB" in text
    assert f"--max-positions 200 needs {200 * each / 1e9:.3g} GB" in text
    assert not (tmp_path / "out" / "final").exists() and not (tmp_path / "out" / "positions").exists()
