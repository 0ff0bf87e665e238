"""The core exactness checks on the device `TREESPARK_TEST_DEVICE` names (default: cpu; `device_under_test` in
conftest.py): greedy TreeSpark output equals plain greedy `generate` strictly in float32, one row and a batch, and
differs only at a floating-point near-tie of the target's logits in bfloat16 and float16
(`hf_treespark.core.exactness`).

`scripts/device_check.sh` runs them on CUDA (`-k fp32`, then `-k "bf16 or fp16"`); the CPU suite runs them as any
other test. Tiny random models: a GPU kernel rounds differently from a CPU one, and what these tests pin down is that
the tree forward and the one-token forwards of plain decoding agree on the same device.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from test_batch import LENGTHS, batch_oracle, eos_forcing_target, padded_batch
from test_generation import make_oracle, prompt

from hf_treespark.core.exactness import check_greedy_equivalence
from hf_treespark.decoding import session as batch
from hf_treespark.precision import DTYPES

# the drafter's default tree, a chain, a wide tree, and "auto" (the budget this device's latency, or its default, picks)
SHAPES = [{}, {"tree_chain": True}, {"tree_topk": 2, "tree_frontier": 3, "tree_budget": 20}, {"tree_budget": "auto"}]


@pytest.mark.parametrize("arch, attn", [("llama", "sdpa"), ("qwen3", "sdpa"), ("mistral", "eager")])
def test_fp32_greedy_on_the_device_equals_plain_generate(device_under_test, arch, attn):
    target = make_target(arch, attn).to(device_under_test)
    drafter = make_drafter(target).to(device_under_test)
    for seed, (length, new) in enumerate([(17, 25)]):
        ids = prompt(seed, length).to(device_under_test)
        ref = target.generate(ids, do_sample=False, max_new_tokens=new)
        oracle = make_oracle(target, ref).to(device_under_test)
        for shape in SHAPES:
            for d in (drafter, oracle):
                out = target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=new, **shape)
                assert out.device == ref.device
                assert torch.equal(out, ref), (arch, attn, seed, shape, type(d).__name__)


def test_fp32_greedy_batches_on_the_device_equal_plain_batched_generate(device_under_test, monkeypatch):
    """Rows of different lengths that end in different rounds, the ragged cache compacted often."""
    monkeypatch.setattr(batch, "COMPACT_MIN", 8)
    target = eos_forcing_target("llama", "sdpa").to(device_under_test)
    for size in (2, 5):
        ids, mask = (t.to(device_under_test) for t in padded_batch(LENGTHS[size], seed=size, repeat_rows=(1, 3)))
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
        for drafter, knobs in ((make_drafter(target), {}), (batch_oracle(target, ref, mask), {"tree_budget": 6})):
            out = target.generate(ids, attention_mask=mask, assistant_model=drafter.to(device_under_test),
                                  do_sample=False, max_new_tokens=24, pad_token_id=0, **knobs)
            assert torch.equal(out, ref), (size, knobs, type(drafter).__name__)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_greedy_on_the_device_differs_only_at_near_ties(device_under_test, dtype):
    if dtype == "bf16" and device_under_test.type == "cuda" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    target = make_target("qwen3", "sdpa", dtype=DTYPES[dtype]).to(device_under_test)
    drafter = make_drafter(target).to(device_under_test)
    for seed in range(3):
        ids = prompt(20 + seed, 10).to(device_under_test)
        ref = target.generate(ids, do_sample=False, max_new_tokens=20)
        oracle = make_oracle(target, ref).to(device_under_test)
        for d in (drafter, oracle):
            out = target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=20)
            report = check_greedy_equivalence(target, ref, out)
            assert report.ok, f"{dtype}, prompt {seed}, {type(d).__name__}: {report}"
