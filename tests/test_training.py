"""Drafter training: each loss on hand-computed cases, replay = the inference tree policy, trainer behaviour."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_setup import tiny_trainer

from hf_treespark.core.tree import TreePolicy, build_tree
from hf_treespark.training import objective as objective_module
from hf_treespark.training.losses import (
    confidence_loss,
    coverage_loss,
    depth_weights,
    l1_distribution_loss,
    normalise,
    reference_ce_loss,
    survival_loss,
)
from hf_treespark.training.objective import LossConfig, replay_losses
from hf_treespark.training.trainer import PRESETS, TrainConfig, sample_anchors


def test_depth_weights():
    w = depth_weights(7, 4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4) for k in range(7)]))


def test_reference_ce_loss_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]], requires_grad=True)
    targets = torch.tensor([0, 2])
    weights = torch.tensor([1.0, 0.5])
    num, den = reference_ce_loss(logits, targets, weights)
    ce0 = -math.log(math.exp(2) / (math.exp(2) + 2))
    ce1 = -math.log(1 / (2 + math.e))
    assert num.item() == pytest.approx(ce0 + 0.5 * ce1, rel=1e-6)
    assert den.item() == pytest.approx(1.5)


def test_l1_loss_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    q = torch.tensor([[0.25, 0.25, 0.5]])
    num, den = l1_distribution_loss(logits, q, torch.tensor([2.0]))
    assert num.item() == pytest.approx(2.0 * 0.5, rel=1e-6) and den.item() == 2.0


def test_confidence_target_is_stop_gradient_overlap():
    logits = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    q = torch.tensor([[1.0, 0.0]])
    conf = torch.tensor([0.3], requires_grad=True)
    num, den = confidence_loss(conf, logits, q, torch.tensor([1.0]))
    target = 1 - 0.5 * 1.0  # overlap = 1 - TV = 0.5
    sig = torch.sigmoid(conf).item()
    expected = -(target * math.log(sig) + (1 - target) * math.log(1 - sig))
    assert num.item() == pytest.approx(expected, rel=1e-6)
    num.backward()
    assert logits.grad is None or torch.all(logits.grad == 0)  # the target carries no gradient
    assert conf.grad is not None and conf.grad.abs().item() > 0


def test_survival_counts_packed_edges_only_and_detaches_mass():
    child_logp = torch.tensor([-0.1, -1.0, -2.0], requires_grad=True)
    mass = torch.tensor([0.6, 0.3, 0.1], requires_grad=True)
    packed = torch.tensor([True, False, True])
    num, den = survival_loss(child_logp, mass, packed)
    assert num.item() == pytest.approx(0.6 * 0.1 + 0.1 * 2.0, rel=1e-6)
    assert den.item() == pytest.approx(0.7)
    num.backward()
    assert child_logp.grad.tolist() == pytest.approx([-0.6, 0.0, -0.1])
    assert mass.grad is None


def test_coverage_hinge_margin_cap_and_detached_threshold():
    parent_logp = torch.log(torch.tensor([[0.7, 0.2, 0.05, 0.05]])).requires_grad_(True)
    threshold = torch.tensor([math.log(0.2)], requires_grad=True)
    top_tokens = torch.tensor([[0, 2, 3]])
    top_probs = torch.tensor([[0.5, 0.3, 0.2]])
    margin, cap = 0.5, 1.2
    num, den = coverage_loss(parent_logp, threshold, top_tokens, top_probs, torch.tensor([0.8]), margin, cap)
    h = [min(cap, max(0.0, margin + math.log(0.2) - math.log(p))) for p in (0.7, 0.05, 0.05)]
    assert h[0] == 0.0 and h[1] == cap  # above the threshold: no penalty; far below: capped
    assert num.item() == pytest.approx(0.8 * (0.5 * h[0] + 0.3 * h[1] + 0.2 * h[2]), rel=1e-5)
    assert den.item() == pytest.approx(0.8 * 1.0)
    num.backward()
    assert threshold.grad is None
    assert parent_logp.grad[0, 0] == 0 and parent_logp.grad[0, 2] == 0  # no penalty / capped: no gradient


def test_normalise_divides_by_the_global_denominator():
    num, den = torch.tensor(3.0), torch.tensor(2.0)
    assert normalise(num, den).item() == 1.5
    # two ranks: rank holds num 3, den 2; the other rank's den is 4 -> global den 6, DDP averages x2
    assert normalise(num, den, reduce_fn=lambda x: x + 4.0, world_size=2).item() == pytest.approx(3.0 * 2 / 6)


class _Markov:
    draft_vocab_ids = None  # the whole vocabulary

    def __init__(self, vocab, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(vocab, 3, generator=gen)
        self.w2 = torch.randn(vocab, 3, generator=gen)

    def markov_bias(self, tokens):
        return self.w1[tokens] @ self.w2.T


def test_replay_uses_the_inference_tree_policy(monkeypatch):
    vocab, n, depth = 20, 3, 4
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, depth, vocab, generator=gen, requires_grad=True)
    roots = torch.randint(0, vocab, (n,), generator=gen)
    q = torch.softmax(torch.randn(n, depth, vocab, generator=gen), -1)
    policy = TreePolicy(topk=3, frontier=2, budget=5, depth=depth)
    calls = []
    real = objective_module.build_tree

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(objective_module, "build_tree", spy)
    drafter = _Markov(vocab)
    replay_losses(drafter, logits, roots, q, torch.ones(n, depth, dtype=torch.bool), policy,
                  depth_weights(depth, 4.0), LossConfig())
    assert len(calls) == 1
    direct = build_tree(logits.detach(), drafter.markov_bias, roots, policy)
    assert torch.equal(calls[0].tokens, direct.tokens) and torch.equal(calls[0].parents, direct.parents)


def test_replay_survival_mass_and_coverage_over_every_expanded_parent():
    vocab, depth = 12, 3
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, depth, vocab, generator=gen, requires_grad=True)
    roots = torch.tensor([0])
    q = torch.softmax(torch.randn(1, depth, vocab, generator=gen) * 2, -1)
    policy = TreePolicy(topk=2, frontier=2, budget=3, depth=depth)  # tiny budget: most parents get nothing packed
    drafter = _Markov(vocab, 2)
    cfg = LossConfig(coverage_top_j=3)
    w = depth_weights(depth, 4.0)
    terms = replay_losses(drafter, logits, roots, q, torch.ones(1, depth, dtype=torch.bool), policy, w, cfg)
    tree = build_tree(logits.detach(), drafter.markov_bias, roots, policy)
    # survival: by hand over the packed nodes, mass = product of q along the path
    num, den = 0.0, 0.0
    for i in range(1, tree.num_nodes + 1):
        mass, node = 1.0, i
        while node > 0:
            mass *= q[0, int(tree.depths[0, node]) - 1, tree.tokens[0, node]].item()
            node = int(tree.parents[0, node])
        parent = int(tree.parents[0, i])
        logp = torch.log_softmax(logits[0, int(tree.depths[0, i]) - 1] + drafter.markov_bias(tree.tokens[0, parent]),
                                 -1)[tree.tokens[0, i]]
        num -= mass * logp.item()
        den += mass
    assert terms["surv"][0].item() == pytest.approx(num, rel=1e-5)
    assert terms["surv"][1].item() == pytest.approx(den, rel=1e-5)
    # coverage: every expanded parent counts (1 at depth 1, then 2 per depth), packed or not
    expected_den = sum(w[k].item() * parents * q[0, k].topk(3).values.sum().item()
                       for k, parents in enumerate([1, 2, 2]))
    assert terms["cov"][1].item() == pytest.approx(expected_den, rel=1e-5)
    assert tree.num_nodes == 3


def test_presets_are_one_switch_each():
    assert TrainConfig(preset="dspark").loss.surv == 0 and TrainConfig(preset="dspark").loss.cov == 0
    assert TrainConfig(preset="no_survival").loss.surv == 0 and TrainConfig(preset="no_survival").loss.cov > 0
    assert TrainConfig(preset="no_coverage").loss.cov == 0 and TrainConfig(preset="no_coverage").loss.surv > 0
    assert PRESETS["dspark"][1]["head_dim"] == 128 and PRESETS["treespark"][1]["head_dim"] == 192
    assert PRESETS["dspark"][1]["tree_topk"] == 1  # chain policy
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig(preset="nope")


def test_anchors_depend_on_the_sequence_not_the_batch():
    lengths, prompts = torch.tensor([20, 12]), torch.tensor([5, 4])
    a, valid = sample_anchors(lengths, prompts, torch.tensor([7, 3]), 6, seed=0, epoch=1)
    b, _ = sample_anchors(lengths[1:], prompts[1:], torch.tensor([3]), 6, seed=0, epoch=1)
    assert torch.equal(a[1], b[0])
    assert ((a >= prompts[:, None]) | ~valid).all() and ((a <= lengths[:, None] - 2) | ~valid).all()


def _snapshot(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped_drafter().state_dict().items()}


def _batch_parts(trainer):
    """The objective's `(numerator, denominator)` terms and its inputs on a fixed batch, without updating."""
    from hf_treespark.training.trainer import _collate, target_features

    refs = trainer.references[:4]
    batch = _collate(list(enumerate(refs)))
    feats, hidden = target_features(trainer.target, trainer.drafter.config.target_layer_ids,
                                    batch["input_ids"], batch["attention_mask"])
    anchors, valid = sample_anchors(batch["lengths"], batch["prompt_lens"], batch["indices"], 8, 0, 0)
    with torch.no_grad():
        parts = trainer.objective(batch["input_ids"], batch["attention_mask"], batch["lengths"], feats, hidden,
                                  anchors, valid)
    return parts, batch, anchors, valid


def _evaluate(trainer):
    """All loss terms on a fixed batch, without updating."""
    parts, _, _, _ = _batch_parts(trainer)
    return {k: (n / d).item() for k, (n, d) in parts.items()}


def test_a_draft_vocabulary_of_every_id_trains_exactly_as_the_full_vocabulary(tmp_path):
    """Restricting to a permutation of the whole vocabulary permutes every distribution: all five terms agree."""
    full = tiny_trainer(tmp_path / "full")
    vocab = full.target.config.vocab_size
    permuted = torch.randperm(vocab, generator=torch.Generator().manual_seed(3)).tolist()
    restricted = tiny_trainer(tmp_path / "restricted", draft_vocab=permuted)
    assert restricted.drafter.draft_vocab_size == vocab
    a, _, _, _ = _batch_parts(full)
    b, _, _, _ = _batch_parts(restricted)
    assert set(a) == set(b) == {"ce", "l1", "conf", "surv", "cov"}
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5), (name, x, y)


def test_reference_tokens_outside_the_draft_vocabulary_leave_only_the_ce_term(tmp_path):
    trainer = tiny_trainer(tmp_path, draft_vocab=list(range(0, 128, 2)))  # every even id of the 128
    parts, batch, anchors, anchor_valid = _batch_parts(trainer)
    bsz = trainer.drafter.config.block_size
    pos = anchors[:, :, None] + torch.arange(1, bsz + 1)
    valid = (pos < batch["lengths"][:, None, None]) & anchor_valid[:, :, None]
    tokens = batch["input_ids"].gather(1, pos.clamp(max=batch["input_ids"].shape[1] - 1).flatten(1)).view_as(pos)
    w = depth_weights(bsz, LossConfig().gamma)
    in_vocab = tokens % 2 == 0
    assert 0 < in_vocab[valid].float().mean() < 1  # the batch has tokens on both sides
    assert torch.isclose(parts["ce"][1], (w * (valid & in_vocab)).sum())
    assert torch.isclose(parts["l1"][1], (w * valid).sum())  # distributions on S are compared on every row
    assert all(torch.isfinite(n) for n, _ in parts.values())


@pytest.mark.parametrize("draft_vocab", [None, "even ids"])
def test_short_run_lowers_the_losses_and_keeps_the_target_frozen(tmp_path, draft_vocab):
    kept = None if draft_vocab is None else list(range(0, 128, 2))
    trainer = tiny_trainer(tmp_path, max_steps=40, save_every=100, draft_vocab=kept)
    target_before = {k: v.clone() for k, v in trainer.target.state_dict().items()}
    drafter_before = _snapshot(trainer)
    before = _evaluate(trainer)
    trainer.train(resume=False, progress=False)
    after = _evaluate(trainer)
    for name in ("ce", "l1", "surv", "cov"):
        assert after[name] < before[name], (name, before[name], after[name])
    # the confidence target (1 - TV(p, q)) moves as p is trained, so its BCE need not fall monotonically
    assert after["conf"] < before["conf"] + 0.01, (before["conf"], after["conf"])
    assert not trainer.target.training
    assert all(not p.requires_grad and p.grad is None for p in trainer.target.parameters())
    assert all(torch.equal(v, target_before[k]) for k, v in trainer.target.state_dict().items())
    changed = [k for k, v in _snapshot(trainer).items() if not torch.equal(v, drafter_before[k])]
    assert "markov_head.markov_w2.weight" in changed and "fc.weight" in changed
    assert (tmp_path / "metrics.jsonl").is_file()


def test_resume_reaches_the_same_parameters(tmp_path):
    full = tiny_trainer(tmp_path / "full", max_steps=6)
    full.train(resume=False, progress=False)
    expected = _snapshot(full)

    first = tiny_trainer(tmp_path / "split", max_steps=6)
    first.train(resume=False, progress=False, stop_after=4)  # checkpoint at step 3, "crash" after step 4
    assert first.latest_checkpoint().name == "step-00000003"
    resumed = tiny_trainer(tmp_path / "split", max_steps=6)
    assert resumed.resume() and resumed.step == 3
    resumed.train(resume=False, progress=False)
    got = _snapshot(resumed)
    for key, value in expected.items():
        assert torch.allclose(got[key], value, atol=1e-6, rtol=0), key


def test_updates_per_batch_splits_one_batch_into_disjoint_anchor_sets_and_resumes_mid_batch(tmp_path, monkeypatch):
    """K updates per batch: one target forward per batch, K micro-steps on disjoint anchors that together are
    the batch's `K * A` anchors; a run stopped between two micro-steps of a batch resumes to the same weights."""
    from hf_treespark.training import trainer as trainer_module

    calls = {"features": 0}
    real_features = trainer_module.Trainer._features

    def counting_features(self, batch):
        calls["features"] += 1
        return real_features(self, batch)

    monkeypatch.setattr(trainer_module.Trainer, "_features", counting_features)
    trainer = tiny_trainer(tmp_path / "probe", max_steps=8, updates_per_batch=2)
    assert trainer.steps_per_epoch == 8  # 8 references, batches of 2, 2 updates each
    steps = list(trainer._micro_steps(0, 0))
    assert len(steps) == 8 and calls["features"] == 4
    for first, second in zip(steps[::2], steps[1::2], strict=True):
        batch = first[0]
        assert second[0] is batch and second[1] is first[1]  # the same batch and target features
        whole, whole_valid = sample_anchors(batch["lengths"], batch["prompt_lens"], batch["indices"], 16, 0, 0)
        for row in range(len(batch["lengths"])):
            a = set(first[2][row][first[3][row]].tolist())
            b = set(second[2][row][second[3][row]].tolist())
            assert a and b and not a & b
            assert a | b == set(whole[row][whole_valid[row]].tolist())
    resumed_steps = list(trainer._micro_steps(0, 3))  # from the second micro-step of the second batch
    assert len(resumed_steps) == 5 and torch.equal(resumed_steps[0][2], steps[3][2])

    full = tiny_trainer(tmp_path / "full", max_steps=6, updates_per_batch=2)
    full.train(resume=False, progress=False)
    expected = _snapshot(full)
    first_run = tiny_trainer(tmp_path / "split", max_steps=6, updates_per_batch=2)
    first_run.train(resume=False, progress=False, stop_after=4)  # checkpoint at step 3: mid-batch
    resumed = tiny_trainer(tmp_path / "split", max_steps=6, updates_per_batch=2)
    assert resumed.resume() and resumed.step == 3
    resumed.train(resume=False, progress=False)
    got = _snapshot(resumed)
    for key, value in expected.items():
        assert torch.allclose(got[key], value, atol=1e-6, rtol=0), key
    assert resumed.anchors_seen == full.anchors_seen


def test_updates_per_batch_and_grad_accum_are_refused_together():
    with pytest.raises(ValueError, match="updates_per_batch .* and grad_accum .* set one of them to 1"):
        TrainConfig(updates_per_batch=2, grad_accum=2)
    with pytest.raises(ValueError, match="updates_per_batch must be at least 1"):
        TrainConfig(updates_per_batch=0)


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no `except Exception` catches it."""


def _crash_while_saving_step(trainer, step: int, where: str, monkeypatch) -> None:
    """Make `trainer.save_checkpoint` die at `where` when it writes the checkpoint of `step`."""
    real_save_state = trainer.accelerator.save_state

    def save_state(directory, *args, **kwargs):
        real_save_state(directory, *args, **kwargs)
        if trainer.step == step and where == "save_state":
            for f in Path(directory).glob("*.safetensors"):  # half-written weights
                f.write_bytes(f.read_bytes()[:100])
            raise _Killed

    real_rename, real_rmtree = Path.rename, shutil.rmtree

    def rename(self, target):
        if trainer.step == step and where == "publish":
            raise _Killed
        return real_rename(self, target)

    def rmtree(path, *args, **kwargs):
        if trainer.step == step and where == "prune" and Path(path).name.startswith("step-"):
            raise _Killed
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(trainer.accelerator, "save_state", save_state)
    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)  # the module checkpoints.py prunes with


@pytest.mark.parametrize("where, survivor", [("save_state", 3), ("publish", 3), ("prune", 6)])
def test_a_crash_during_a_checkpoint_write_loses_only_the_steps_since_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                          where, survivor):
    full = tiny_trainer(tmp_path / "full", max_steps=6, keep_checkpoints=1)
    full.train(resume=False, progress=False)
    expected = _snapshot(full)

    crashing = tiny_trainer(tmp_path / "run", max_steps=6, keep_checkpoints=1)  # checkpoints at steps 3 and 6
    with monkeypatch.context() as patch:
        _crash_while_saving_step(crashing, 6, where, patch)
        with pytest.raises(_Killed):
            crashing.train(resume=False, progress=False)
    resumed = tiny_trainer(tmp_path / "run", max_steps=6, keep_checkpoints=1)
    assert resumed.latest_checkpoint().name == f"step-{survivor:08d}"
    assert resumed.resume() and resumed.step == survivor
    resumed.train(resume=False, progress=False)
    assert resumed.step == 6 and resumed.latest_checkpoint().name == "step-00000006"
    got = _snapshot(resumed)
    for key, value in expected.items():
        assert torch.allclose(got[key], value, atol=1e-6, rtol=0), key


class _ThreadRank:
    """One rank of a fake 2-process accelerator (threads and a barrier); `delay` seconds before its `save_state`,
    which writes what accelerate's does on every rank: `random_states_<rank>.pkl`, creating the directory."""

    def __init__(self, rank: int, world: int, barrier, delay: float = 0.0):
        self.process_index, self.num_processes, self.barrier, self.delay = rank, world, barrier, delay
        self.is_main_process = rank == 0

    def wait_for_everyone(self) -> None:
        self.barrier.wait(timeout=30)

    def save_state(self, directory: str) -> None:
        import time

        time.sleep(self.delay)
        os.makedirs(directory, exist_ok=True)
        if self.is_main_process:
            (Path(directory) / "model.safetensors").write_bytes(b"weights")
        (Path(directory) / f"random_states_{self.process_index}.pkl").write_bytes(b"rng")


def test_a_checkpoint_is_published_only_when_every_rank_has_saved_its_state(tmp_path):
    """A slow rank 1 used to write its RNG state into a `.tmp-step-N` recreated after rank 0's rename: the published
    checkpoint lacked it and the temporary directory stayed behind."""
    import threading

    from hf_treespark.training.trainer import publish_state

    final = tmp_path / "checkpoints" / "step-00000003"
    final.parent.mkdir()
    barrier = threading.Barrier(2)
    ranks = [_ThreadRank(0, 2, barrier), _ThreadRank(1, 2, barrier, delay=0.5)]
    errors = []

    def run(rank):
        try:
            publish_state(rank, final, lambda tmp: (tmp / "trainer_state.json").write_text('{"step": 3}'))
        except BaseException as err:  # noqa: BLE001 - reported below, from the test's thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors", "random_states_0.pkl",
                                                       "random_states_1.pkl", "trainer_state.json"]
    assert [p.name for p in final.parent.iterdir()] == ["step-00000003"]  # no .tmp-step-00000003 left behind


def test_a_checkpoint_missing_a_ranks_state_is_not_published(tmp_path):
    from hf_treespark.training.trainer import publish_state

    class NoSharedDisk(_ThreadRank):  # rank 0 of 2 whose partner wrote elsewhere
        def wait_for_everyone(self):
            pass

    final = tmp_path / "step-00000001"
    with pytest.raises(RuntimeError, match=r"lacks random_states_1\.pkl .* filesystem that all processes share"):
        publish_state(NoSharedDisk(0, 2, None), final, lambda tmp: None)
    assert not final.exists()


def test_damaged_checkpoint_is_refused_with_its_path(tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=3)
    trainer.train(resume=False, progress=False)
    ckpt = trainer.latest_checkpoint()
    for f in ckpt.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    again = tiny_trainer(tmp_path, max_steps=3)
    with pytest.raises(RuntimeError, match=str(ckpt.name)):
        again.resume()


@pytest.mark.parametrize("content, message", [
    ("{", "Expecting property name"), ("[3]", "a JSON list, not an object"), ('{"anchors_seen": 5}', "no 'step'"),
    ('{"step": "3"}', "'step' is '3', not a count"), ('{"step": 3, "config": [1]}', "'config' is a JSON list"),
    (b"\xff{}", "can't decode byte 0xff"),
])
def test_a_damaged_trainer_state_is_refused_naming_the_file_before_loading(tmp_path, content, message):
    """A `trainer_state.json` that parses but is not an object used to end in an AttributeError traceback, one
    without a step number in a KeyError after the weights were loaded."""
    trainer = tiny_trainer(tmp_path, max_steps=1)
    checkpoint = trainer.checkpoint_dir / "step-00000001"
    checkpoint.mkdir(parents=True)
    state = checkpoint / "trainer_state.json"
    state.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RuntimeError, match=rf"checkpoint {checkpoint} cannot be read \(trainer_state\.json: .*"
                                           rf"{message}"):
        trainer.resume()
    assert trainer.step == 0


def test_two_processes_make_the_same_update_as_one(tmp_path):
    """2 CPU processes under accelerate (gloo, started by torchrun), batch 1 each == 1 process with batch 2."""
    worker = Path(__file__).parent / "ddp_worker.py"
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, str(worker), str(one), "2", "1"], check=True, env=env, timeout=600)
    subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", "29533", str(worker), str(two), "1", "2"],
                   check=True, env=env, timeout=600)
    a, b = torch.load(one / "params.pt"), torch.load(two / "params.pt")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-4), key
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_trainer_refuses_a_token_id_outside_the_target_vocabulary(tmp_path):
    from conftest import make_drafter, make_target

    from hf_treespark.training.data import ReferenceSequence
    from hf_treespark.training.trainer import Trainer

    target = make_target("llama")
    refs = [ReferenceSequence("fine", [1, 5, 6, 7], 1), ReferenceSequence("bad", [1, 5, 128, 7], 1)]
    with pytest.raises(ValueError, match=r"reference sequence 'bad' holds token id 128, outside the target's "
                                         r"vocabulary \(0\.\.127\)"):
        Trainer(TrainConfig(output_dir=str(tmp_path), max_steps=1), target, make_drafter(target), refs)


@pytest.mark.parametrize("steps", [0, -1])
def test_train_config_refuses_max_steps_below_one(steps):
    with pytest.raises(ValueError, match=rf"max_steps must be at least 1 \(got {steps}\)"):
        TrainConfig(max_steps=steps)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "16"])
def test_replay_anchors_must_be_a_positive_count(bad):
    with pytest.raises(ValueError, match="replay_anchors must be a positive number of anchors per sequence"):
        LossConfig(replay_anchors=bad)
    assert LossConfig(replay_anchors=16).replay_anchors == 16 and LossConfig().replay_anchors is None


def test_a_run_resumed_with_another_lr_follows_the_new_peak_on_the_same_schedule(tmp_path, capsys):
    first = tiny_trainer(tmp_path / "run", max_steps=6, lr=2e-3)
    first.train(resume=False, progress=False, stop_after=3)  # checkpoint at step 3
    kept = tiny_trainer(tmp_path / "run", max_steps=6, lr=2e-3)
    assert kept.resume()
    said = capsys.readouterr().out
    assert "resumed from" in said and "peak learning rate" not in said and "mixed precision" not in said
    changed = tiny_trainer(tmp_path / "run", max_steps=6, lr=5e-4)
    assert changed.resume() and changed.step == 3
    assert "peak learning rate 0.0005 from step 3 on (the checkpoint's run used 0.002)" in capsys.readouterr().out
    for old, new in zip(kept.optimizer.param_groups, changed.optimizer.param_groups, strict=True):
        assert new["lr"] == pytest.approx(old["lr"] / 4) and new["lr"] > 0
    changed.train(resume=False, progress=False, stop_after=1)
    kept.train(resume=False, progress=False, stop_after=1)
    assert changed.scheduler.get_last_lr()[0] == pytest.approx(kept.scheduler.get_last_lr()[0] / 4)


class _Planted:
    """A pickle that, when unpickled, creates the file `marker` (what an attacker's code would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin",
                                     "scheduler.bin"])
def test_a_resumed_run_never_executes_a_pickle_planted_in_its_checkpoint(tmp_path, planted):
    """A checkpoint file replaced by a pickle that runs code: resuming either never reads it or refuses it by
    name; the code never runs."""
    trainer = tiny_trainer(tmp_path / "run", max_steps=3)
    trainer.train(resume=False, progress=False)
    checkpoint = trainer.latest_checkpoint()
    marker = tmp_path / "executed"
    torch.save({"state": _Planted(marker)}, checkpoint / planted)
    again = tiny_trainer(tmp_path / "run", max_steps=4)
    try:
        resumed = again.resume()
    except RuntimeError as err:
        assert str(checkpoint / planted) in str(err) and "refused" in str(err)
    else:
        assert resumed and again.step == 3
    assert not marker.exists()


def test_a_checkpoint_holds_no_pickle_of_the_trainers_own_state(tmp_path):
    """The schedule's state is JSON in the checkpoint, not a pickle that resuming would have to trust."""
    trainer = tiny_trainer(tmp_path, max_steps=3)
    trainer.train(resume=False, progress=False)
    checkpoint = trainer.latest_checkpoint()
    assert not list(checkpoint.glob("custom_checkpoint_*"))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["scheduler"]["last_epoch"] == 3


@pytest.mark.parametrize("planted", [False, True])
def test_a_checkpoint_of_an_earlier_version_resumes_its_schedule_and_refuses_a_planted_one(tmp_path, planted):
    """Earlier versions kept the schedule in accelerate's `custom_checkpoint_0.pkl`: it is read as plain values
    (`weights_only`), and a pickle that would run code there is refused by name."""
    trainer = tiny_trainer(tmp_path / "run", max_steps=3)
    trainer.train(resume=False, progress=False)
    checkpoint = trainer.latest_checkpoint()
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    scheduler = state.pop("scheduler")
    state_file.write_text(json.dumps(state))
    marker = tmp_path / "executed"
    torch.save(_Planted(marker) if planted else scheduler, checkpoint / "custom_checkpoint_0.pkl")
    again = tiny_trainer(tmp_path / "run", max_steps=6)
    if planted:
        with pytest.raises(RuntimeError, match=rf"{checkpoint / 'custom_checkpoint_0.pkl'} was refused"):
            again.resume()
        assert not marker.exists()
    else:
        assert again.resume() and again.scheduler.last_epoch == 3
        assert again.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()
