"""The round controller (`decoding/controller.py`): what each round of a call runs, decided in one place, and the
pricer that decides what a row's round carries (the best lookup branch alone, or the drafter's tree)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_drafter, make_target

from hf_treespark.core.tree import TreePolicy
from hf_treespark.decoding import controller as ctl
from hf_treespark.decoding.engine import RowPlanner
from hf_treespark.decoding.generation_checks import resolve_policy


def pricer(drafted=1.0, tree_cost=1.3):
    return ctl.RoundPricer(drafted, tree_cost, lambda k: 1.0 + 0.03 * k)


def test_before_any_round_the_priors_choose_a_chain_after_a_long_match_and_the_tree_without_one():
    p = pricer()
    assert p.wants_chain(3, 7, 7)  # a 3-token match's branch gets 4.6 tokens accepted: no drafter pass
    assert not p.wants_chain(0, 0, 0)  # nothing to copy: the drafter's tree beats a plain step
    assert not p.wants_chain(1, 4, 4)


def test_a_branch_that_stops_agreeing_gives_way_to_the_tree_and_a_drafter_that_misses_to_the_chain():
    p = pricer()
    for _ in range(12):  # 3-token matches whose branches the target never takes
        p.observe("chain", 3, [5, 6, 7], [9], 0, None, 1.2)
    assert p.chain[3] < 0.5 and not p.wants_chain(3, 7, 7)
    q = pricer()
    for _ in range(12):  # tree rounds that accept nothing, where a 2-token match's branch keeps being right
        q.observe("tree", 2, [5, 6, 7, 8], [5, 6, 7, 8, 9], 0, None, 1.5)
    assert q.chain[2] > 3.5 and q.tree[2] < 0.2 and q.wants_chain(2, 7, 7)
    r = pricer()
    for _ in range(12):  # no match, and the drafter's trees accept nothing: the root alone (a plain step) is cheaper
        r.observe("tree", 0, [], [4], 0, None, 1.3)
    assert r.wants_chain(0, 0, 0)


def test_a_branch_that_agrees_with_all_a_tree_round_committed_is_followed_into_the_next_rounds():
    p = pricer()
    before = p.chain[2]
    p.observe("tree", 2, [5, 6, 7, 8], [5, 6], 1, None, 1.5)  # the tree stopped after 2 tokens the branch had too
    assert p.chain[2] == before and len(p.open) == 1  # how far the branch would have gone is not known yet
    p.observe("tree", 0, [], [7, 9], 1, None, 1.5)  # the next round: the branch's third token, then another
    assert p.chain[2] == pytest.approx((1 - ctl.PRICE_SMOOTHING) * before + ctl.PRICE_SMOOTHING * 3)
    assert not p.open
    q = pricer()
    q.observe("tree", 2, [5, 6, 7, 8], [5, 9], 1, None, 1.5)  # disagrees inside the round: counted at once
    assert q.chain[2] == pytest.approx((1 - ctl.PRICE_SMOOTHING) * ctl.CHAIN_PRIOR[2] + ctl.PRICE_SMOOTHING * 1)


def test_a_row_without_a_tree_for_a_while_drafts_one_so_its_estimate_follows_the_text():
    p = pricer()
    for _ in range(ctl.PRICE_EXPLORE):
        assert p.wants_chain(3, 7, 7)
        p.observe("chain", 3, [5, 6, 7], [5, 6, 7, 1], 3, None, 1.2)
    assert not p.wants_chain(3, 7, 7)
    p.observe("tree", 3, [5, 6, 7], [5, 6, 7, 1], 3, None, 1.5)
    assert p.wants_chain(3, 7, 7)


def test_measured_round_times_reprice_the_kinds():
    p = pricer()
    assert p.wants_chain(2, 7, 7)  # by the priors a 2-token match's chain pays
    for _ in range(20):  # but here chains take three times a tree round's seconds per prior plain step
        p.observe("chain", 2, [5], [5, 6], 1, 0.36, 1.2)
        p.observe("tree", 2, [5], [5, 6], 1, 0.15, 1.5)
    assert not p.wants_chain(2, 7, 7)


def test_a_source_whose_nodes_are_never_accepted_steps_aside_for_a_stretch_then_is_tried_again():
    p = pricer()
    assert p.source_open("retrieved")
    rounds = 0
    while p.source_open("retrieved"):
        p.observe_source("retrieved", 12, 0)
        rounds += 1
    assert 1 < rounds < 20  # a few rounds of evidence, not one
    closed = 1 + sum(not p.source_open("retrieved") for _ in range(ctl.SOURCE_REST))
    assert closed == ctl.SOURCE_REST and p.source_open("retrieved")
    paying = pricer()
    for _ in range(50):
        paying.observe_source("retrieved", 12, 2)
        assert paying.source_open("retrieved")


def test_a_chain_round_verifies_the_best_branch_alone_without_the_drafter():
    planner = RowPlanner(TreePolicy(topk=2, frontier=2, budget=4, depth=3, lookup=4))
    planner.pricer = pricer()
    strong = torch.tensor([5, 6, 7, 8, 9, 3, 6, 7, 2, 6, 1, 5, 6, 7])  # "5 6 7" matched: 8 9 3 6 ... follows
    plan = planner.plan(strong)
    assert plan.tree is not None and not planner.ran_drafter and planner.round_kind() == "lookup"
    assert plan.tree.tokens[0, 1:].tolist() == [8, 9, 3, 6, 7, 2, 6, 1, 5, 6, 7, 8, 9, 3, 6, 7][:plan.tree.num_nodes]
    assert plan.tree.depths[0, 1:].tolist() == list(range(1, plan.tree.num_nodes + 1))  # a chain
    planner.pricer.idle = ctl.PRICE_EXPLORE  # time to draft: the tree, with the branches beside the drafter's pool
    plan = planner.plan(strong)
    assert plan.tree is None and planner.ran_drafter and planner.round_kind() == "drafter"


def test_the_controller_prices_rounds_for_one_row_with_lookup_when_asked():
    target = make_target()
    drafter = make_drafter(target, tree_lookup=4)
    policy = resolve_policy(drafter)
    assert ctl.RoundController(target, drafter, policy, 1, tree_gate="price").pricer is not None
    assert ctl.RoundController(target, drafter, policy, 1).pricer is None  # "auto": the drafter gate
    assert ctl.RoundController(target, drafter, policy, 1, tree_gate=0).pricer is None  # a number: the drafter gate
    assert ctl.RoundController(target, drafter, policy, 2, tree_gate="price").pricer is None  # a batch shares its pass
    no_lookup = resolve_policy(drafter, tree_lookup=0)
    assert ctl.RoundController(target, drafter, no_lookup, 1, tree_gate="price").pricer is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_priced_rounds_decode_exactly(arch):
    target = make_target(arch)
    drafter = make_drafter(target, tree_lookup=4)
    torch.manual_seed(3)
    base = torch.randint(4, VOCAB, (1, 12))
    ids = torch.cat([base, base, base[:, :6]], dim=1)  # a prompt that repeats: lookup matches from the start
    plain = target.generate(ids, do_sample=False, max_new_tokens=40)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, tree_gate="price",
                          return_dict_in_generate=True, tree_guard=False)
    assert torch.equal(out.sequences, plain)
    kinds = {r.kind for r in out.rounds}
    assert "lookup" in kinds or "gated" in kinds, kinds  # the pricer ran chains, not only trees
