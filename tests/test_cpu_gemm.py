"""Prepacked oneDNN linear layers (`hf_treespark.core.cpu_gemm`): same outputs, same gradients, exact decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target

import hf_treespark
from hf_treespark.core.cpu_gemm import is_packed, model_is_packed, pack_linear_layers, packing_available, should_pack

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (9, 48), (2, 5, 48), (3, 1, 4, 48)])
def test_a_packed_linear_computes_what_the_ordinary_one_does(bias, shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40, bias=bias)
    x = torch.randn(shape)
    expected = lin(x)
    assert pack_linear_layers(lin) == 1 and is_packed(lin)
    with torch.no_grad():
        got = lin(x)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert pack_linear_layers(lin) == 0  # idempotent


def test_training_through_a_packed_linear_gives_the_ordinary_gradients():
    torch.manual_seed(0)
    plain, packed = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    packed.load_state_dict(plain.state_dict())
    pack_linear_layers(packed)
    x = torch.randn(5, 16)
    plain(x).square().sum().backward()
    packed(x).square().sum().backward()
    assert torch.allclose(plain.weight.grad, packed.weight.grad) and torch.allclose(plain.bias.grad, packed.bias.grad)


def test_the_packed_copy_follows_weight_changes_and_dtype_moves():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    pack_linear_layers(lin)
    x = torch.randn(3, 16)
    with torch.no_grad():
        first = lin(x)
        lin.weight.mul_(2.0)  # an optimizer step changes weights in place
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)
        assert not torch.allclose(lin(x), first)
        lin.double()  # oneDNN has no float64 kernel: the ordinary path
        assert torch.allclose(lin(x.double()), torch.nn.functional.linear(x.double(), lin.weight, lin.bias))


def test_unpacking_restores_the_ordinary_forward():
    lin = torch.nn.Linear(4, 4)
    pack_linear_layers(lin)
    assert hf_treespark.unpack_linear_layers(lin) == 1 and not is_packed(lin)
    assert type(lin).forward is torch.nn.Linear.forward and "forward" not in lin.__dict__


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("draft_vocab", [None, list(range(127, 30, -1))])
def test_tree_decoding_on_packed_models_equals_plain_greedy_on_them(arch, draft_vocab):
    target = make_target(arch)
    drafter = make_drafter(target)
    if draft_vocab is not None:
        drafter.restrict_vocabulary(draft_vocab)
    pack_linear_layers(target)
    pack_linear_layers(drafter)
    prompt = torch.tensor([[1, 17, 42, 9, 88, 5]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24, eos_token_id=None)
    out = hf_treespark.generate(target, drafter, prompt, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out, plain)
    assert is_packed(drafter._target()[2])  # the draft head is packed with the target's LM head


def test_rebinding_keeps_the_draft_head_until_the_target_head_changes():
    target = make_target("llama")
    drafter = make_drafter(target).restrict_vocabulary(list(range(64)))
    pack_linear_layers(target)
    head = drafter.bind_target(target)._target()[2]
    assert drafter.bind_target(target)._target()[2] is head  # generate() binds on every call
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.5)
    fresh = drafter.bind_target(target)._target()[2]
    assert fresh is not head
    assert torch.equal(fresh.weight, target.get_output_embeddings().weight[:64])


def test_loaders_pack_on_a_cpu_unless_told_not_to():
    target, _ = hf_treespark.load_default_target(dtype=torch.float32)
    assert model_is_packed(target)
    plain, _ = hf_treespark.load_default_target(dtype=torch.float32, cpu_pack=False)
    assert not model_is_packed(plain)
    assert should_pack("auto", "cpu") and not should_pack("auto", "cuda") and should_pack(True, "cpu")
    with pytest.raises(ValueError, match="cpu_pack='yes' is invalid"):
        should_pack("yes", "cpu")


def test_packed_models_deep_copy_and_save_after_a_forward(tmp_path):
    """The packed weight is an opaque tensor without storage: copies and pickles carry an empty cache instead."""
    import copy

    target = make_target("llama")
    drafter = make_drafter(target).restrict_vocabulary(list(range(100)))  # a packed draft head of its own
    pack_linear_layers(target)
    pack_linear_layers(drafter)
    prompt = torch.tensor([[1, 17, 42, 9, 88, 5]])
    with torch.no_grad():
        logits = target(prompt).logits  # every layer of the target has packed its weight now
    # (after a forward with output_hidden_states, which tree decoding runs, transformers' own output-capturing
    # hooks make `torch.save(target)` fail whether or not the model is packed: save the state_dict there)
    torch.save(target, tmp_path / "target.pt")
    expected = hf_treespark.generate(target, drafter, prompt, max_new_tokens=12, eos_token_id=None)

    target_copy, drafter_copy = copy.deepcopy(target), copy.deepcopy(drafter)
    torch.save(drafter, tmp_path / "drafter.pt")
    torch.save(target.state_dict(), tmp_path / "target_state.pt")
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    loaded_target = torch.load(tmp_path / "target.pt", weights_only=False)
    loaded_drafter = torch.load(tmp_path / "drafter.pt", weights_only=False)
    assert not drafter_copy.is_bound and not loaded_drafter.is_bound  # the target's LM head is not copied along

    for t, d in [(target_copy, drafter_copy), (loaded_target, loaded_drafter)]:
        assert model_is_packed(t) and model_is_packed(d)
        layer = t.model.layers[0].mlp.down_proj
        assert layer.forward.module is layer  # the copy's layers compute with their own weights
        with torch.no_grad():
            assert torch.equal(t(prompt).logits, logits)
        assert torch.equal(hf_treespark.generate(t, d, prompt, max_new_tokens=12, eos_token_id=None), expected)
    with torch.no_grad():  # the copy follows its own weights, not the original's
        target_copy.lm_head.weight.mul_(0.5)
        assert torch.equal(target(prompt).logits, logits)
        assert not torch.equal(target_copy(prompt).logits, logits)
