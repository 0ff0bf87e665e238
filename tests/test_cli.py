"""The README's main job: `treespark generate` on the offline default target with the shipped drafter."""

from __future__ import annotations

import pytest
import torch

import hf_treespark
from hf_treespark import assets
from hf_treespark.cli import main


@pytest.mark.slow
def test_shipped_drafter_loads_binds_and_is_exact():
    target, tokenizer = hf_treespark.load_default_target(dtype=torch.float32)
    drafter = hf_treespark.load_default_drafter(dtype=torch.float32)
    assert drafter.dtype == target.dtype == torch.float32
    assert drafter.config.target_vocab_size == target.config.vocab_size
    inputs = assets.chat_inputs(tokenizer, "Name three primary colours.")
    ref = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=24,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.acceptance_length > 1.0  # a trained drafter gets some drafted tokens accepted


@pytest.mark.slow
def test_cli_generate_with_compare(capsys):
    assert main(["generate", "--prompt", "Say hello.", "--max-new-tokens", "12", "--compare", "--dtype", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "mean acceptance length" in printed and "identical to plain greedy" in printed and "(fp32)" in printed


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "   "])
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--max-new-tokens", "0"])
    assert main(["generate", "--prompt", "hi", "--drafter", "/no/such/drafter"]) == 2
    assert "no/such/drafter" in capsys.readouterr().err
