"""Soft targets for the depth-1 head (`training/soft_targets.py`): the target's top-K recorded at extraction (by
`train-depth1` and `distil`, with and without a draft vocabulary), the mixed loss against a hand computation, weight 0
as the hard loss bit for bit, both verbs end to end with resuming, and positions without soft targets refused."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_drafter, make_target
from test_depth1 import references
from test_depth1_cli import write_references
from test_distill import CharTokenizer, motif_sequences

from hf_treespark.cli import commands as cli
from hf_treespark.training import cli as training_cli
from hf_treespark.training import distill
from hf_treespark.training.depth1 import Depth1Trainer, PositionShards, block_signature, extract, grow_depth1_head
from hf_treespark.training.distill_extract import distil_batch, distil_to_shards, position_bytes
from hf_treespark.training.distill_sources import TextSequence
from hf_treespark.training.distill_stream import DistilTrainer, StreamConfig, distil_stream
from hf_treespark.training.soft_targets import (
    SOFT_FIELDS,
    head_loss,
    soft_cross_entropy,
    soft_signature,
    top_k_targets,
)

K = 5


def grown_drafter(target, restricted: bool):
    """A drafter with a depth-1 head of width 32, restricted to 40 of the 128 ids in a shuffled order when asked."""
    drafter = grow_depth1_head(make_drafter(target), 32).bind_target(target).eval()
    if restricted:
        drafter.restrict_vocabulary(torch.randperm(128, generator=torch.Generator().manual_seed(7))[:40].tolist())
    return drafter


def expected_top_k(target, drafter, ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Independently: the target's full forward, softmax over all 128 ids, the draft vocabulary's columns (indices
    into S), the K largest at `positions`."""
    with torch.no_grad():
        probs = torch.softmax(target(torch.tensor([ids])).logits[0].double(), dim=-1)  # [T, V]
    if drafter.draft_vocab_ids is not None:
        probs = probs[:, drafter.draft_vocab_ids]  # [T, |S|]
    top, index = probs[positions].topk(K, dim=-1)
    return index, top


def assert_same_top_k(got_ids, got_probs, want_ids, want_probs):
    assert got_ids.dtype == torch.int32 and got_probs.dtype == torch.float16
    assert torch.equal(got_ids.long(), want_ids)
    assert torch.allclose(got_probs.double(), want_probs, rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("restricted", [False, True], ids=["whole-vocabulary", "draft-vocabulary"])
def test_extracted_soft_targets_are_the_targets_softmax_top_k(restricted, tmp_path):
    target = make_target("qwen3")
    drafter = grown_drafter(target, restricted)
    refs = references(3)
    shards = PositionShards(tmp_path, soft_signature(block_signature(drafter), K))
    extract(target, drafter, refs, shards, progress=False, soft_k=K)
    data = shards.load()
    assert data["soft_ids"].shape == data["soft_probs"].shape == (len(data["label"]), K)
    row = 0
    for ref in refs:
        anchors = list(range(ref.prompt_len, len(ref.input_ids) - 1))
        want_ids, want_probs = expected_top_k(target, drafter, ref.input_ids, anchors)
        got = slice(row, row + len(anchors))
        assert_same_top_k(data["soft_ids"][got], data["soft_probs"][got], want_ids, want_probs)
        row += len(anchors)
    assert float(data["soft_probs"].float().sum(-1).max()) <= 1.002  # true probabilities, not renormalised


@pytest.mark.parametrize("restricted", [False, True], ids=["whole-vocabulary", "draft-vocabulary"])
def test_distilled_soft_targets_are_the_targets_softmax_top_k_at_every_kept_anchor(restricted):
    target = make_target("qwen3")
    drafter = grown_drafter(target, restricted)
    gen = torch.Generator().manual_seed(3)
    own = target.generate(torch.randint(4, 128, (1, 5), generator=gen), do_sample=False, max_new_tokens=9,
                          pad_token_id=0)[0].tolist()  # the target's own text: its anchors agree
    texts = [own, *(torch.randint(4, 128, (n,), generator=gen).tolist() for n in (9, 17))]  # padded: other lengths
    sequences = [TextSequence(f"t{i}", ids, [a > 0 for a in range(len(ids))]) for i, ids in enumerate(texts)]
    every = distil_batch(target, drafter, sequences, anchors="all", soft_k=K)
    row = 0
    for s in sequences:
        anchors = list(range(1, len(s.input_ids)))
        want_ids, want_probs = expected_top_k(target, drafter, s.input_ids, anchors)
        got = slice(row, row + len(anchors))
        assert_same_top_k(every["soft_ids"][got], every["soft_probs"][got], want_ids, want_probs)
        row += len(anchors)
    assert row == len(every["label"])
    # agreeing anchors (x_a the target's argmax at a - 1): the same rows of the same soft targets
    kept = distil_batch(target, drafter, sequences, anchors="agreeing", soft_k=K)
    with torch.no_grad():
        mask = torch.cat([target(torch.tensor([s.input_ids])).logits[0, :-1].argmax(-1)
                          == torch.tensor(s.input_ids[1:]) for s in sequences])
    assert 0 < int(mask.sum()) < row
    for field in ("label", *SOFT_FIELDS):
        assert torch.equal(kept[field], every[field][mask]), field
    plain = distil_batch(target, drafter, sequences, anchors="all")  # off: the fields of before, the same values
    assert set(plain) == set(every) - set(SOFT_FIELDS)
    assert all(torch.equal(plain[k], every[k]) for k in ("token", "label", "features"))


def test_more_soft_targets_than_the_draft_vocabulary_are_refused():
    with pytest.raises(ValueError, match="--soft-targets 6 asks for more ids than the drafter's 5-token draft"):
        top_k_targets(torch.randn(3, 10), 6, torch.tensor([1, 2, 3, 4, 5]))


def test_the_soft_loss_is_the_cross_entropy_against_the_renormalised_top_k():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.0, 1.0, 0.0, 3.0]])
    soft_ids = torch.tensor([[0, 3], [3, 1]], dtype=torch.int32)
    soft_probs = torch.tensor([[0.6, 0.2], [0.3, 0.3]], dtype=torch.float16)
    by_hand = 0.0
    for row, (ids, probs) in enumerate(zip(soft_ids.tolist(), [[0.6, 0.2], [0.3, 0.3]], strict=True)):
        log_z = math.log(sum(math.exp(v) for v in logits[row].tolist()))
        by_hand += -sum(p / sum(probs) * (logits[row, i].item() - log_z) for i, p in zip(ids, probs, strict=True))
    by_hand /= 2
    got = soft_cross_entropy(logits, soft_ids, soft_probs)
    assert abs(got.item() - by_hand) < 1e-3  # fp16 storage of 0.6 and 0.2 rounds their ratio
    assert soft_cross_entropy(logits[:1], soft_ids[:1], torch.zeros(1, 2)).item() == 0.0  # no mass: adds nothing
    labels = torch.tensor([0, -100])  # the second label lies outside S: ignored by the hard term only
    data, rows = {"soft_ids": soft_ids, "soft_probs": soft_probs}, torch.arange(2)
    hard = -torch.log_softmax(logits[0], -1)[0]
    assert torch.allclose(head_loss(logits, labels, data, rows, 0.25), 0.75 * hard + 0.25 * got)
    assert torch.equal(head_loss(logits, labels, data, rows, 1.0), got)
    with pytest.raises(ValueError, match="--soft-weight needs positions with soft targets"):
        head_loss(logits, labels, {"label": labels}, rows, 0.5)


def test_weight_zero_is_the_hard_loss_bit_for_bit_and_a_weight_changes_the_training(tmp_path):
    target = make_target("qwen3")
    drafter = grown_drafter(target, restricted=True)
    shards = PositionShards(tmp_path / "positions", soft_signature(block_signature(drafter), K))
    extract(target, drafter, references(4), shards, progress=False, soft_k=K)
    data = shards.load()
    hard_only = {k: v for k, v in data.items() if k not in SOFT_FIELDS}  # positions as extracted before

    logits = torch.randn(6, 40, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 7, 39, 1])
    rows = torch.arange(6)
    mixed = head_loss(logits, labels, data, rows, 0.0)
    (mine,) = torch.autograd.grad(mixed, logits)
    today = F.cross_entropy(logits, labels, ignore_index=-100)
    (theirs,) = torch.autograd.grad(today, logits)
    assert torch.equal(mixed, today) and torch.equal(mine, theirs)

    def train(positions, run: str, weight: float) -> dict[str, torch.Tensor]:
        head = grown_drafter(target, restricted=True)
        trainer = Depth1Trainer(head, tmp_path / run, lr=3e-3, batch_size=16, warmup=2, soft_weight=weight)
        trainer.train(positions, 6, {}, eval_every=100, save_every=100, progress=False)
        return head.depth1_head.state_dict()

    before, off, on = train(hard_only, "before", 0.0), train(data, "off", 0.0), train(data, "on", 0.5)
    assert all(torch.equal(before[k], off[k]) for k in before)
    assert not all(torch.equal(before[k], on[k]) for k in before)


def test_an_interrupted_soft_stream_resumes_to_the_uninterrupted_runs_head(tmp_path):
    """The buffer refilled at resume holds the soft targets again: the resumed run ends as the uninterrupted one."""
    target = make_target("qwen3")
    sequences = motif_sequences(24)

    def fresh():
        return grown_drafter(target, restricted=False)

    config = StreamConfig(batch_size=4, buffer_positions=128, passes=2.0, max_positions=300, eval_every=1000,
                          save_every=5, anchors="all", soft_targets=K)
    dev = {"dev": distil_batch(target, fresh(), sequences[:2], anchors="all")}
    options = dict(fingerprint="f", lr=3e-3, batch_size=32, warmup=3, soft_weight=0.5)
    whole = DistilTrainer(fresh(), tmp_path / "whole", **options)
    distil_stream(target, whole.drafter, iter(sequences), whole, dev, config, progress=False)

    def crashing():
        for i, sequence in enumerate(sequences):
            if i == 12:
                raise KeyboardInterrupt
            yield sequence

    first = DistilTrainer(fresh(), tmp_path / "run", **options)
    with pytest.raises(KeyboardInterrupt):
        distil_stream(target, first.drafter, crashing(), first, dev, config, progress=False)
    resumed = DistilTrainer(fresh(), tmp_path / "run", **options)
    assert resumed.resume() and resumed.step > 0
    distil_stream(target, resumed.drafter, iter(sequences), resumed, dev, config, progress=False)
    assert resumed.step == whole.step
    for key, value in whole.drafter.depth1_head.state_dict().items():
        assert torch.allclose(resumed.drafter.depth1_head.state_dict()[key], value, atol=1e-6, rtol=0), key


def test_stored_distilled_soft_targets_count_in_the_disk_budget(tmp_path):
    target = make_target("qwen3")
    drafter = grown_drafter(target, restricted=True)
    assert position_bytes(drafter, K) == position_bytes(drafter) + 6 * K
    shards = PositionShards(tmp_path, soft_signature("signature", K))
    state = distil_to_shards(target, drafter, motif_sequences(6), shards, max_positions=50, batch_size=2,
                             shard_positions=20, progress=False, anchors="all", soft_k=K)
    data = shards.load()
    assert state["positions"] == 50 and data["soft_ids"].shape == (50, K)
    assert int(data["soft_ids"].max()) < 40  # indices into the 40-token draft vocabulary
    with pytest.raises(ValueError, match="extracted with --soft-targets 5, not no --soft-targets"):
        PositionShards(tmp_path, "signature").load()


# ----- the verbs ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A saved tiny Llama target and drafter, a training file and a development file."""
    root = tmp_path_factory.mktemp("soft")
    target = make_target("llama")
    target.save_pretrained(root / "target")
    make_drafter(target).save_pretrained(root / "drafter")
    return {"target": root / "target", "drafter": root / "drafter", "data": write_references(root / "a.jsonl", 6, 1),
            "dev": write_references(root / "dev.jsonl", 2, 3)}


def depth1_argv(files, out: Path, *extra: str) -> list[str]:
    return ["train-depth1", "--target", str(files["target"]), "--drafter", str(files["drafter"]),
            "--data", str(files["data"]), "--dev-data", str(files["dev"]), "--width", "16", "--batch-size", "16",
            "--epochs", "1", "--eval-every", "5", "--output-dir", str(out), *extra]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_train_depth1_with_soft_targets_trains_resumes_and_refuses_other_soft_options(files, tmp_path, capsys,
                                                                                        monkeypatch):
    out = tmp_path / "run"
    assert cli.main(depth1_argv(files, out, "--soft-targets", "4")) == 0
    signature = json.loads((out / "positions" / "progress.json").read_text())["signature"]
    assert signature.endswith("-soft4")
    stored = PositionShards(out / "positions", signature).load()
    assert stored["soft_ids"].shape == (len(stored["label"]), 4)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["soft_weight"] == 0.5  # the default weight
    assert (out / "final" / "model.safetensors").is_file()
    step = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    capsys.readouterr()
    assert cli.main(depth1_argv(files, out, "--soft-targets", "4", "--epochs", "2")) == 0
    assert f"resumed at step {step}" in capsys.readouterr().out

    monkeypatch.setattr(training_cli, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    assert cli.main(depth1_argv(files, out, "--soft-targets", "4", "--soft-weight", "0.2", "--epochs", "3")) == 2
    err = one_line_error(capsys)
    assert f"{out / 'checkpoint.pt'} holds a head trained with --soft-weight 0.5, not 0.2" in err
    assert cli.main(depth1_argv(files, out)) == 2  # the soft positions are not trained on as plain ones
    err = one_line_error(capsys)
    assert f"{out / 'positions'} holds positions extracted with --soft-targets 4, not no --soft-targets" in err
    assert "--output-dir" in err


def test_soft_targets_on_positions_extracted_without_them_are_refused_before_the_target_loads(files, tmp_path,
                                                                                              capsys, monkeypatch):
    out = tmp_path / "run"
    assert cli.main(depth1_argv(files, out)) == 0  # today's run: no soft targets
    assert "soft_ids" not in PositionShards(out / "positions", json.loads(
        (out / "positions" / "progress.json").read_text())["signature"]).load()
    capsys.readouterr()
    monkeypatch.setattr(training_cli, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    assert cli.main(depth1_argv(files, out, "--soft-targets", "8")) == 2
    err = one_line_error(capsys)
    assert f"{out / 'positions'} holds positions extracted without soft targets" in err
    assert "fresh --output-dir" in err and f"delete {out / 'positions'}" in err


def test_a_soft_weight_without_soft_targets_is_refused_in_one_line(files, tmp_path, capsys):
    assert cli.main(depth1_argv(files, tmp_path / "run", "--soft-weight", "0.3")) == 2
    assert "--soft-weight 0.3 needs --soft-targets K > 0" in one_line_error(capsys)
    with pytest.raises(SystemExit):
        cli.main(depth1_argv(files, tmp_path / "run", "--soft-targets", "8", "--soft-weight", "2"))
    assert "argument --soft-weight: must be a number in [0, 1], got '2'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


@pytest.mark.parametrize("verb", ["train-depth1", "distil"])
def test_both_verbs_help_names_the_soft_options_and_what_they_do(verb, capsys):
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--soft-targets K" in text and "--soft-weight W" in text
    assert "(1 - W) * CE(label) + W * soft CE" in text and "renormalised to sum 1" in text


def test_distil_with_soft_targets_streams_stores_resumes_and_refuses_other_soft_options(tmp_path, monkeypatch,
                                                                                         capsys):
    target = make_target("qwen3")
    grow_depth1_head(make_drafter(target), 16).save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr(training_cli, "load_target", lambda name, with_tokenizer, device: (target, CharTokenizer()))
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 20)
    (tmp_path / "dev.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11, 12]}))

    def argv(out: str, *extra, soft: int = 4) -> list:
        return ["--drafter", tmp_path / "drafter", "--sources", tmp_path / "a.txt", "--dev-data",
                tmp_path / "dev.jsonl", "--max-length", 64, "--batch-size", 2, "--train-batch-size", 16,
                "--buffer-positions", 64, "--max-positions", 120, "--eval-every", 5, "--anchors", "all",
                "--soft-targets", soft, "--output-dir", tmp_path / out, *extra]

    assert distill.run(parse(*argv("streamed"))) == 0
    state = torch.load(tmp_path / "streamed" / "checkpoint.pt", weights_only=True)
    assert state["step"] == math.ceil(120 / 16) and state["fingerprint"].endswith("-soft4")
    assert distill.run(parse(*argv("streamed"))) == 0
    assert f"resumed at step {state['step']}" in capsys.readouterr().out
    for other in (("--soft-weight", 0.2), ("--soft-targets", 8)):
        with pytest.raises(ValueError, match=re.escape("other --soft-targets or --soft-weight: give the same")):
            distill.run(parse(*argv("streamed"), *other))

    assert distill.run(parse(*argv("stored", "--max-disk-gb", 1))) == 0
    signature = json.loads((tmp_path / "stored" / "positions" / "progress.json").read_text())["signature"]
    stored = PositionShards(tmp_path / "stored" / "positions", signature).load()
    assert stored["soft_ids"].shape == (120, 4) and stored["soft_probs"].dtype == torch.float16

    assert distill.run(parse(*argv("plain", "--max-disk-gb", 1, soft=0))) == 0  # a run of today: no soft targets
    with pytest.raises(ValueError, match=re.escape("other --soft-targets or --soft-weight: give the same options to "
                                                   "resume it, or another --output-dir")):
        distill.run(parse(*argv("plain", "--max-disk-gb", 1)))
