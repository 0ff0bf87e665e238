"""A tiny, deterministic training setup shared by the training tests and their multi-process worker."""

from __future__ import annotations

import torch
from conftest import make_drafter, make_target

from hf_treespark.training.data import ReferenceSequence
from hf_treespark.training.trainer import TrainConfig, Trainer


def tiny_references(target, count: int = 8, prompt_len: int = 5, new_tokens: int = 24) -> list[ReferenceSequence]:
    gen = torch.Generator().manual_seed(0)
    refs = []
    for i in range(count):
        prompt = torch.randint(4, target.config.vocab_size, (1, prompt_len), generator=gen)
        full = target.generate(prompt, do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)
        refs.append(ReferenceSequence(id=f"seq{i}", input_ids=full[0].tolist(), prompt_len=prompt_len))
    return refs


def tiny_trainer(output_dir, preset: str = "treespark", batch_size: int = 2, max_steps: int = 6,
                 draft_vocab: list[int] | None = None, **overrides):
    """A Trainer on a tiny random Llama; `draft_vocab` restricts the drafter to those target ids first."""
    target = make_target("llama")
    refs = tiny_references(target)
    drafter = make_drafter(target, tree_budget=10).float()
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()
    if draft_vocab is not None:
        drafter.restrict_vocabulary(draft_vocab)
    fields = dict(anchors_per_sequence=8, lr=2e-3, save_every=3, log_every=1,
                  mixed_precision="no")  # float32 steps: compared update for update on any CPU
    fields.update(overrides)
    config = TrainConfig(output_dir=str(output_dir), preset=preset, max_steps=max_steps, batch_size=batch_size,
                         **fields)
    return Trainer(config, target, drafter, refs)
