"""Tiny random-weight targets and drafters: right for exactness tests, never for acceptance numbers."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import hf_treespark  # noqa: F401  (registers the drafter and the generate routing)
from hf_treespark import TreeSparkConfig, TreeSparkDrafter

VOCAB = 128
DEVICE_ENV = "TREESPARK_TEST_DEVICE"  # the device of tests/test_device_exactness.py (scripts/device_check.sh: cuda)


@pytest.fixture(autouse=True)
def _one_training_precision_per_test():
    """A training run fixes accelerate's process-wide mixed precision, as one `treespark train` process does;
    tests that train with different precisions in one pytest process each start from a clean state."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
}


def make_target(arch: str = "llama", attn: str = "sdpa", dtype=torch.float32, seed: int = 0, layers: int = 4):
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = config_cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, **extra,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config)
    # Sharper logits than the default init, so greedy continuations are not all near-ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype).eval()


def make_drafter(target, seed: int = 1, **overrides) -> TreeSparkDrafter:
    fields = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  intermediate_size=64, markov_rank=16, mask_token_id=3, tree_budget=12)
    fields.update(overrides)
    torch.manual_seed(seed)
    drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, **fields))
    with torch.no_grad():  # a non-zero Markov head, so parent tokens matter in tests
        drafter.markov_head.markov_w2.weight.normal_(0.0, 0.5)
    return drafter.to(target.dtype).eval()


def assert_round_trip_decodes_exactly(drafter, target, directory) -> TreeSparkDrafter:
    """`drafter` saved to `directory` loads back with every tensor equal, and greedy decoding with the loaded one, at
    batch 1 and in a ragged left-padded batch, is plain greedy decoding. Returns the loaded drafter."""
    drafter.save_pretrained(directory)
    loaded = TreeSparkDrafter.from_pretrained(directory).eval()
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    ids = torch.randint(4, 128, (1, 9))
    ref = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(target.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=24,
                                       pad_token_id=0), ref)
    batch = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, length in enumerate((9, 4, 1)):
        batch[row, 9 - length:], mask[row, 9 - length:] = torch.randint(4, 128, (length,)), 1
    ref = target.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    out = target.generate(batch, attention_mask=mask, assistant_model=loaded, do_sample=False, max_new_tokens=16,
                          pad_token_id=0)
    assert torch.equal(out, ref)
    return loaded


@pytest.fixture
def llama_pair():
    target = make_target("llama")
    return target, make_drafter(target)


@pytest.fixture(scope="session")
def device_under_test() -> torch.device:
    """The device the device exactness tests run on: `TREESPARK_TEST_DEVICE` (`cpu`, `cuda`, `cuda:1`, ...; default
    `cpu`). A device that is named but cannot hold a tensor fails those tests instead of skipping them, so that a
    device check cannot pass without running on its device."""
    name = os.environ.get(DEVICE_ENV, "").strip() or "cpu"
    try:
        device = torch.device(name)
        torch.zeros(1, device=device)
        problem = None
    except (RuntimeError, AssertionError) as err:  # an unknown name; a device this machine or torch build lacks
        problem = str(err).splitlines()[0] if str(err) else type(err).__name__
    if problem is not None:
        pytest.fail(f"{DEVICE_ENV}={name!r}: no such device here ({problem})", pytrace=False)
    return device
