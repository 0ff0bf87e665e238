"""Branch sources behind one seam (`sources/base.py`): a new source is one file (`toy_source.py`) and one
registration line; its nodes join the budgeted tree, and decoding stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from toy_source import EchoSource

from hf_treespark.core.tree import TreePolicy
from hf_treespark.decoding.session import DecodingSession
from hf_treespark.sources.base import SOURCES, build_sources, register_source


@pytest.fixture
def echo_registered():
    register_source("echo", lambda drafter, source: source)  # the one registration line
    yield
    SOURCES.pop("echo", None)


def repeating_prompt(rows: int = 1) -> torch.Tensor:
    pattern = [5, 6, 7, 8, 9, 10, 11, 12]
    return torch.tensor([pattern * 3 + pattern[:3]] * rows)


def test_a_registered_source_is_asked_each_round_and_decoding_stays_exact(echo_registered):
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = repeating_prompt()
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    source = EchoSource()
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, tree_lookup=0,
                          tree_guard=False, tree_sources={"echo": source}, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert source.asked == len(out.rounds) > 0  # every round (no lookup-only rounds with lookup off)


def test_a_sources_nodes_join_the_tree_flagged_and_raise_the_budget(echo_registered):
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = repeating_prompt()
    ref = target.generate(ids, do_sample=False, max_new_tokens=16)
    policy = TreePolicy.from_config(drafter.config, lookup=0)
    sources = build_sources(drafter, {"echo": EchoSource()})
    session = DecodingSession(target, drafter, policy, sources=sources)
    seq = torch.cat([ids, session.prefill(ids).argmax(-1, keepdim=True)], dim=1)
    grafted = 0
    while seq.shape[1] < ref.shape[1]:
        rnd = session.step([seq[0]], [seq])[0]
        echo = rnd.tree.flags.get("echo")
        if echo is not None and bool(echo.any()):
            grafted += 1
            # the echo node is a child of the root, carrying the token that followed the root's last occurrence
            (node,) = echo[0].nonzero()[:, 0].tolist()
            assert rnd.tree.parents[0, node] == 0
            assert rnd.tree.num_nodes == policy.budget + 1  # its node came on top of the drafter's budget
        seq = torch.cat([seq, rnd.tokens], dim=1)
    assert torch.equal(seq[:, :ref.shape[1]], ref)
    assert grafted > 0, "the source's node never reached a tree"


def test_a_batch_asks_the_source_for_every_row_and_equals_plain_batched_generate(echo_registered):
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = repeating_prompt(2)
    ids[1, :3] = 0  # the second row left-padded
    mask = (ids != 0).long()
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    source = EchoSource()
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                          tree_lookup=0, tree_sources={"echo": source})
    assert torch.equal(out, plain)
    assert source.asked >= 2


def test_an_unknown_source_or_the_datastore_by_this_route_is_refused_by_name(echo_registered):
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = repeating_prompt()
    with pytest.raises(ValueError, match="'nope', which is not a registered branch source; registered: .*echo"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, tree_sources={"nope": True})
    with pytest.raises(ValueError, match="tree_datastore"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, tree_sources={"datastore": True})
    with pytest.raises(ValueError, match="tree_sources=.* is invalid"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, tree_sources=["echo"])
