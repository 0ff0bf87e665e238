"""The learning curve's measure: teacher-forced acceptance equals what greedy decoding accepts."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark.core.tree import TreePolicy
from hf_treespark.training.data import ReferenceSequence
from hf_treespark.training.evaluate import accepted_depths, reference_acceptance
from hf_treespark.training.trainer import target_features


def test_per_anchor_acceptance_matches_the_rounds_of_greedy_decoding():
    target = make_target("llama")
    ids = torch.randint(4, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None)
    for drafter in (make_drafter(target, tree_budget=8), make_drafter(target, tree_budget=40, tree_topk=8)):
        policy = TreePolicy.from_config(drafter.config)
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=60, eos_token_id=None,
                              return_dict_in_generate=True, tree_guard=False)  # every round drafted
        assert torch.equal(out.sequences, ref)
        anchors, accepted, position = [], [], ids.shape[1]  # the first round's anchor: the prefill token
        for r in out.rounds:
            if position + policy.depth < ref.shape[1] and r.num_accepted + 1 == len(r.committed):
                anchors.append(position)
                accepted.append(r.num_accepted)
            position += len(r.committed)
        drafter.bind_target(target)
        features, _ = target_features(target, drafter.config.target_layer_ids, ref, torch.ones_like(ref))
        got = accepted_depths(drafter, ref[0], features, torch.tensor(anchors), policy)
        assert got.tolist() == accepted and sum(accepted) > 0


def test_reference_acceptance_summarises_every_anchor():
    target = make_target("llama")
    drafter = make_drafter(target).bind_target(target)
    refs = []
    for seed in range(3):
        prompt = torch.randint(4, 100, (1, 5), generator=torch.Generator().manual_seed(seed))
        full = target.generate(prompt, do_sample=False, max_new_tokens=30, eos_token_id=None)
        refs.append(ReferenceSequence(id=str(seed), input_ids=full[0].tolist(), prompt_len=5))
    policy = TreePolicy.from_config(drafter.config)
    result = reference_acceptance(target, drafter, refs, policy, anchors_per_sequence=100)
    assert result["anchors"] == 3 * (30 - policy.depth)  # every response position with D tokens after it
    rates = result["depth_rates"]
    assert len(rates) == policy.depth and all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert result["acceptance_length"] == pytest.approx(1 + sum(rates))


def test_training_with_eval_every_writes_and_plots_a_learning_curve(tmp_path):
    from training_setup import tiny_references, tiny_trainer

    from hf_treespark.training.evaluate import plot_learning_curve, read_curve

    trainer = tiny_trainer(tmp_path, max_steps=4, eval_every=2, eval_budget=4)
    trainer.set_dev_set(tiny_references(trainer.target, count=2))
    trainer.train(progress=False)
    curve = read_curve(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in curve] == [0, 2, 4]
    assert [row["anchors_seen"] for row in curve][0] == 0
    assert curve[1]["anchors_seen"] == 2 * 2 * 8 and curve[2]["anchors_seen"] == 4 * 2 * 8  # steps x batch x anchors
    assert all(row["dev_budget"] == 4 and row["dev_acceptance_length"] >= 1 for row in curve)
    png = plot_learning_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    resumed = tiny_trainer(tmp_path, max_steps=4, eval_every=2, eval_budget=4)
    assert resumed.resume() and resumed.anchors_seen == curve[2]["anchors_seen"]


def test_plot_runs_draws_several_learning_curves_and_refuses_a_run_without_one(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "plot_runs.py"
    runs = []
    for name, lengths in (("a", [1.0, 1.1]), ("b", [1.0, 1.2, 1.3])):
        path = tmp_path / f"{name}.jsonl"
        lines = [{"step": 10 * i, "anchors_seen": 100 * i, "dev_acceptance_length": value,
                  "dev_depth_rates": [value - 1.0]} for i, value in enumerate(lengths)]
        lines.insert(1, {"step": 5, "loss": 3.0})  # training-loss lines are skipped
        path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
        runs.append(f"run {name}={path}")
    out = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, str(script), str(out), *runs], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"step": 1, "loss": 2.0}\n')
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "x.png"), f"none={empty}"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "has no development-set evaluation" in done.stderr
