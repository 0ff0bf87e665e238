"""`treespark train --train-only` (`training/freeze.py`): the named parts cover the drafter, frozen parts stay byte
for byte what they were and hold no optimizer state, and a run resumes only with the parts it started with."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from test_train_cli import tiny_files, train  # noqa: F401  (the module's fixture and its runner)
from training_setup import tiny_trainer

from hf_treespark.training.freeze import all_parts, freeze_all_but, parameter_parts, part_names, resolve_parts


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in trainer.unwrapped_drafter().named_parameters()}


def test_every_parameter_of_a_drafter_with_every_option_belongs_to_one_named_part():
    drafter = make_drafter(make_target("llama"), num_hidden_layers=2, anchor_features=True, mask_token_id=None,
                           depth1_head=16, depth2_head=16)
    owners = parameter_parts(drafter)
    assert set(owners) == {name for name, _ in drafter.named_parameters()}
    assert set(owners.values()) == set(all_parts(drafter.config))  # the config names exactly the parts it has
    assert owners["mask_embedding"] == "mask_embedding" and owners["layers.1.mlp.down_proj.weight"] == "layers.1"
    names = part_names(drafter.config)
    assert names["block"] == ("context", "layers.0", "layers.1", "norm", "anchor_proj", "mask_embedding")
    assert names["depth_heads"] == ("depth1_head", "depth2_head")
    assert resolve_parts("block", drafter.config) == resolve_parts(
        "context,layers,norm,anchor_proj,mask_embedding", drafter.config)


def test_a_part_the_drafter_lacks_is_refused_naming_the_parts_it_has():
    config = make_drafter(make_target("llama")).config  # one layer, a mask token id, no depth heads
    with pytest.raises(ValueError, match=r"'depth1_head', 'mlp' is not a part of this drafter; its parts are "
                                         r"block, context, layers, layers\.0, norm, markov, confidence$"):
        resolve_parts("markov, depth1_head,mlp", config)
    with pytest.raises(ValueError, match="--train-only is empty"):
        resolve_parts(" , ", config)
    assert resolve_parts(None, config) is None


def test_frozen_parts_stay_byte_identical_and_hold_no_optimizer_state(tmp_path):
    trainer = tiny_trainer(tmp_path / "markov", max_steps=3, train_only="markov")
    before = _weights(trainer)
    trainer.train(progress=False)
    after = _weights(trainer)
    owners = parameter_parts(trainer.unwrapped_drafter())
    for name, value in before.items():
        if owners[name] == "markov":
            assert not torch.equal(after[name], value), name  # trained
        else:
            assert after[name].numpy().tobytes() == value.numpy().tobytes(), name  # untouched, bit for bit
    state = trainer.optimizer.optimizer.state_dict()
    markov = [p for name, p in trainer.unwrapped_drafter().named_parameters() if owners[name] == "markov"]
    assert len(state["state"]) == len(markov) == 2  # W1 and W2 only: AdamW keeps no moments for frozen tensors
    assert not any(p.requires_grad for name, p in trainer.unwrapped_drafter().named_parameters()
                   if owners[name] != "markov")


def test_naming_every_part_trains_exactly_as_the_default(tmp_path):
    default = tiny_trainer(tmp_path / "default", max_steps=2)
    default.train(progress=False)
    named = tiny_trainer(tmp_path / "named", max_steps=2, train_only="block,markov,confidence")
    assert named.trained_parts == all_parts(named.unwrapped_drafter().config)
    named.train(progress=False)
    for name, value in _weights(default).items():
        assert torch.equal(value, _weights(named)[name]), name


def test_freezing_a_part_with_no_parameters_is_refused():
    drafter = make_drafter(make_target("llama"))
    with pytest.raises(ValueError, match="the drafter has no depth1_head"):
        freeze_all_but(drafter, ("depth1_head", "markov"))


def test_a_resume_with_other_trained_parts_is_refused_naming_both(tmp_path):
    tiny_trainer(tmp_path, max_steps=3, train_only="markov").train(progress=False)
    with pytest.raises(ValueError, match="--train-only markov there, the whole drafter here"):
        tiny_trainer(tmp_path, max_steps=6).resume()
    with pytest.raises(ValueError, match="--train-only markov there, context, layers.0 here"):
        tiny_trainer(tmp_path, max_steps=6, train_only="context,layers").resume()
    resumed = tiny_trainer(tmp_path, max_steps=6, train_only=" markov ")
    assert resumed.resume() and resumed.step == 3


def test_the_train_command_refuses_an_unknown_part_before_loading_anything(tiny_files, tmp_path, capsys):  # noqa: F811
    assert train(tiny_files, tmp_path / "run", "--train-only", "markov,heads", "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert "--train-only: 'heads' is not a part of this drafter; its parts are block, context, layers, layers.0, " \
           "norm, markov, confidence" in err
    assert not (tmp_path / "run").exists()


def test_the_train_command_trains_the_named_part_only(tiny_files, tmp_path, capsys):  # noqa: F811
    from hf_treespark import TreeSparkDrafter

    assert train(tiny_files, tmp_path / "a", "--max-steps", "2", "--train-only", "layers") == 0
    assert train(tiny_files, tmp_path / "b", "--max-steps", "2", "--train-only", "markov") == 0
    a = TreeSparkDrafter.from_pretrained(tmp_path / "a" / "final").state_dict()
    b = TreeSparkDrafter.from_pretrained(tmp_path / "b" / "final").state_dict()
    # the same seed builds the same fresh drafter: each run moved its own part and left the other's as built
    assert not torch.equal(a["markov_head.markov_w1.weight"], b["markov_head.markov_w1.weight"])
    assert torch.equal(a["fc.weight"], b["fc.weight"])
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"], b["layers.0.mlp.up_proj.weight"])
