"""`OUTPUT_DIR/best/` (`training/best_checkpoint.py`): the drafter of the run's highest development score, written
atomically, loadable as `final/` is, named with its step and score, and kept across a resume."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_drafter, make_target
from test_train_cli import tiny_files, train  # noqa: F401  (the module's fixture and its runner)
from training_setup import tiny_references, tiny_trainer
from transformers import AutoModel, AutoModelForCausalLM

from hf_treespark.training import best_checkpoint
from hf_treespark.training.best_checkpoint import BEST_SCORE, publish_best, read_best
from hf_treespark.training.data import load_references
from hf_treespark.training.evaluate import read_curve, reference_acceptance
from hf_treespark.training.trainer import replay_policy


def test_best_holds_the_highest_scoring_evaluation_and_loads_as_a_drafter(tiny_files, tmp_path, capsys):  # noqa: F811
    target_dir, refs = tiny_files
    out = tmp_path / "run"
    assert train(tiny_files, out, "--max-steps", "4", "--batch-size", "4", "--eval-every", "1", "--eval-budget", "4",
                 "--dev-data", str(refs)) == 0
    curve = read_curve(out / "metrics.jsonl")
    assert [r["step"] for r in curve] == [0, 1, 2, 3, 4]
    best = read_best(out)
    top = max(r[BEST_SCORE] for r in curve)
    first_top = next(r for r in curve if r[BEST_SCORE] == top)  # a tie keeps the earlier drafter
    assert (best["step"], best["score"], best["score_name"]) == (first_top["step"], top, BEST_SCORE)
    assert best["evaluation"] == first_top
    loaded = AutoModel.from_pretrained(out / "best")  # the save_pretrained layout of final/
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    loaded.bind_target(target)
    measured = reference_acceptance(target, loaded, load_references(refs), replay_policy(loaded.config).with_budget(4))
    assert measured["acceptance_length"] == pytest.approx(top, rel=1e-6)  # it is the drafter that scored it
    said = capsys.readouterr().out
    assert f"[best] {out / 'final'} (step 4) scores {BEST_SCORE} {curve[-1][BEST_SCORE]:.4f}; {out / 'best'} " \
           f"(step {first_top['step']}) scores {top:.4f}" in said
    assert not (out / ".tmp-best").exists() and not (out / ".old-best").exists()


def test_the_best_score_so_far_survives_a_resume(tmp_path):
    refs = tiny_references(make_target("llama"))
    first = tiny_trainer(tmp_path, max_steps=4, eval_every=1, save_every=1, eval_budget=4)
    first.set_dev_set(refs)
    first.train(stop_after=2, progress=False)
    saved = json.loads((tmp_path / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())["best"]
    assert saved == first.best and saved == {k: read_best(tmp_path)[k] for k in ("step", "score")}
    resumed = tiny_trainer(tmp_path, max_steps=4, eval_every=1, save_every=1, eval_budget=4)
    resumed.set_dev_set(refs)
    assert resumed.resume() and resumed.best == saved
    resumed.train(resume=False, progress=False)
    curve = read_curve(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in curve] == [0, 1, 2, 3, 4]
    assert read_best(tmp_path)["score"] == resumed.best["score"] == max(r[BEST_SCORE] for r in curve)


def test_a_damaged_best_in_a_checkpoint_is_refused_by_name(tmp_path):
    tiny_trainer(tmp_path, max_steps=1, save_every=1).train(progress=False)
    state_path = tmp_path / "checkpoints" / "step-00000001" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    assert state["best"] is None  # no evaluation, no best
    again = tiny_trainer(tmp_path, max_steps=1)
    for best, message in (([3, 1.5], "not an object"), ({"step": -1, "score": 1.5}, "not a count"),
                          ({"step": 2, "score": "high"}, "not a number")):
        state_path.write_text(json.dumps({**state, "best": best}))
        with pytest.raises(RuntimeError, match=f"trainer_state.json: 'best' .*{message}"):
            again.resume()


def test_best_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    drafter = make_drafter(make_target("llama")).float()
    publish_best(drafter, tmp_path, {"step": 2, BEST_SCORE: 1.25})
    assert read_best(tmp_path)["step"] == 2

    def fail(*args, **kwargs):
        raise OSError("disk full")

    from hf_treespark.hub import sharing

    monkeypatch.setattr(sharing, "save_drafter", fail)
    with pytest.raises(OSError, match="disk full"):
        publish_best(drafter, tmp_path, {"step": 5, BEST_SCORE: 1.5})
    assert read_best(tmp_path)["step"] == 2  # the failed write left the previous best in place
    monkeypatch.undo()
    (tmp_path / "best").rename(tmp_path / ".old-best")  # a crash between the two renames
    assert read_best(tmp_path) is None
    publish_best(drafter, tmp_path, {"step": 7, BEST_SCORE: 1.75})
    assert read_best(tmp_path)["step"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    loaded = AutoModel.from_pretrained(tmp_path / "best")
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name


def test_only_a_strictly_higher_finite_score_improves():
    assert best_checkpoint.improves({BEST_SCORE: 1.2}, None)
    assert not best_checkpoint.improves({BEST_SCORE: 1.2}, {"step": 1, "score": 1.2})
    assert best_checkpoint.improves({BEST_SCORE: 1.3}, {"step": 1, "score": 1.2})
    assert not best_checkpoint.improves({BEST_SCORE: float("nan")}, None)
    assert not best_checkpoint.improves({}, None)
