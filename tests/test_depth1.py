"""The depth-1 head's own training (`training/depth1.py`): extracted positions, the head's loss, resuming, refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_round_trip_decodes_exactly, make_drafter, make_target

from hf_treespark.decoding.engine import target_features
from hf_treespark.training.data import ReferenceSequence
from hf_treespark.training.depth1 import (
    Depth1Trainer,
    PositionShards,
    block_signature,
    extract,
    grow_depth1_head,
)


def references(count: int = 6, seed: int = 0) -> list[ReferenceSequence]:
    gen = torch.Generator().manual_seed(seed)
    refs = []
    for i in range(count):
        prompt = torch.randint(4, 128, (5 + i,), generator=gen).tolist()
        motif = torch.randint(4, 128, (4,), generator=gen).tolist()
        refs.append(ReferenceSequence(id=f"r{i}", input_ids=prompt + (motif * 6)[: 12 + i], prompt_len=len(prompt)))
    return refs


@pytest.fixture
def grown():
    target = make_target("qwen3")
    drafter = grow_depth1_head(make_drafter(target), 32).bind_target(target).eval()
    return target, drafter


def test_extracted_positions_are_what_the_drafter_reads_at_every_anchor(grown, tmp_path):
    target, drafter = grown
    refs = references()
    shards = PositionShards(tmp_path, block_signature(drafter))
    state = extract(target, drafter, refs, shards, shard_positions=20, progress=False)
    data = shards.load()
    assert state["references_done"] == len(refs) and state["shards"] > 1
    assert len(data["label"]) == sum(len(r.input_ids) - 1 - r.prompt_len for r in refs)
    first = shards.load(limit=27)  # a cut inside the second shard (20 positions each): the same rows
    assert all(torch.equal(first[k], data[k][:27]) for k in data)
    ref, t = refs[2], refs[2].prompt_len + 3  # one position of the third reference
    row = sum(len(r.input_ids) - 1 - r.prompt_len for r in refs[:2]) + 3
    ids = torch.tensor([ref.input_ids])
    feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    assert data["token"][row] == ref.input_ids[t] and data["label"][row] == ref.input_ids[t + 1]
    assert torch.allclose(data["features"][row].float(), feats[0, t - 1], atol=0.05, rtol=0.02)
    with torch.no_grad():
        drafter.depth1_head.out.weight.normal_(0.0, 0.5)  # what it reads is the state before the head
        out = drafter(anchor_ids=ids[:, t:t + 1], anchor_positions=torch.tensor([[t]]), target_features=feats)
        trainer = Depth1Trainer(drafter, tmp_path / "run")
        # the trainer's logits for that row are the drafter's own depth-1 logits (bf16 shards: close, not equal)
        mine = trainer.logits(data, torch.tensor([row]))[0]
    theirs = out.depth_logits[0, 0] + drafter.markov_bias(ids[0, t])
    assert torch.allclose(mine, theirs, atol=0.1), (mine - theirs).abs().max()


def test_the_head_learns_its_positions_and_a_stopped_run_resumes_where_it_was(grown, tmp_path):
    target, drafter = grown
    shards = PositionShards(tmp_path / "positions", block_signature(drafter))
    extract(target, drafter, references(8), shards, progress=False)
    data = shards.load()
    trainer = Depth1Trainer(drafter, tmp_path / "run", lr=3e-3, batch_size=16, warmup=5)
    before = trainer.top1(data)
    curve = trainer.train(data, 40, {"train": data}, eval_every=20, save_every=20, progress=False)
    assert [row["step"] for row in curve] == [0, 20, 40]
    assert curve[-1]["train_top1"] > before + 20  # repeated motifs: the head fits them
    head = {k: v.clone() for k, v in drafter.depth1_head.state_dict().items()}

    again = grow_depth1_head(make_drafter(target), 32).bind_target(target)
    resumed = Depth1Trainer(again, tmp_path / "run", lr=3e-3, batch_size=16, warmup=5)
    assert resumed.resume() and resumed.step == 40
    for name, value in again.depth1_head.state_dict().items():
        assert torch.equal(value, head[name]), name


def test_positions_of_another_drafter_and_damaged_files_are_refused(grown, tmp_path):
    target, drafter = grown
    shards = PositionShards(tmp_path, block_signature(drafter))
    extract(target, drafter, references(2), shards, progress=False)
    other = grow_depth1_head(make_drafter(target, seed=5), 32)
    with pytest.raises(ValueError, match="another drafter"):
        PositionShards(tmp_path, block_signature(other)).load()
    shard = tmp_path / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match="shard_00000.safetensors is damaged"):
        shards.load()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="checkpoint.pt is damaged"):
        Depth1Trainer(drafter, tmp_path / "run").resume()


def test_a_drafter_without_a_head_is_grown_to_draft_exactly_as_before():
    target = make_target("llama")
    plain = make_drafter(target).bind_target(target)
    grown = grow_depth1_head(plain, 16).bind_target(target)
    assert grown.config.depth1_head == 16 and plain.config.depth1_head == 0
    ids = torch.randint(4, 128, (1, 10))
    feats, _ = target_features(target, plain.config.target_layer_ids, ids, torch.ones_like(ids))
    kwargs = dict(anchor_ids=ids[:, 9:], anchor_positions=torch.tensor([[9]]), target_features=feats[:, :9],
                  context_cache=None)
    with torch.no_grad():
        assert torch.equal(plain(**kwargs).depth_logits, grown(**kwargs).depth_logits)
    with pytest.raises(ValueError, match="no depth-1 head"):
        Depth1Trainer(plain, "unused")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_drafter_with_a_trained_head_round_trips_and_decodes_exactly(arch, tmp_path):
    """A head that matters (non-zero output) survives save/load, and greedy decoding with it, batch 1 and a ragged
    batch, is plain greedy decoding."""
    target = make_target(arch)
    drafter = grow_depth1_head(make_drafter(target), 16)
    with torch.no_grad():
        drafter.depth1_head.out.weight.normal_(0.0, 0.5)
    loaded = assert_round_trip_decodes_exactly(drafter, target, tmp_path / "d")
    assert loaded.config.depth1_head == 16


def test_batches_of_fewer_positions_than_the_batch_size_take_them_all_and_none_is_refused(grown, tmp_path):
    _, drafter = grown
    trainer = Depth1Trainer(drafter, tmp_path, batch_size=256)
    rows = []
    for batch in trainer.batches(10, total_steps=3):  # the trainer counts the steps
        rows.append(batch)
        trainer.step += 1
    assert len(rows) == 3 and all(sorted(r.tolist()) == list(range(10)) for r in rows)
    with pytest.raises(ValueError, match="no positions to train on"):
        next(iter(trainer.batches(0, total_steps=1)))
