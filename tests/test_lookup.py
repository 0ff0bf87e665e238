"""Lookup branches (`lookup.py`, SPEC 2c): matching, grafting, packing, and lossless decoding with them."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_drafter, make_target
from test_generation import chi_square_ok, make_oracle, prompt
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from hf_treespark.core.tree import TreePolicy, expand_tree, pack_tree
from hf_treespark.core.verify import processed_accept
from hf_treespark.sources.lookup import (
    DRAFTER_GATE_ROUNDS,
    DRAFTER_GATE_SMOOTHING,
    LOOKUP_ROUND_NGRAM,
    LOOKUP_TOKEN_PROB,
    LOOKUP_WEAK_TOKENS,
    DrafterGate,
    gated_branch_length,
    graft_lookup,
    is_lookup_round,
    lookup_continuations,
    lookup_pool,
)


def test_longest_and_most_recent_matches_come_first_and_branches_differ():
    history = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6, 7])
    assert lookup_continuations(history, 3) == [([10, 11, 5], 3), ([8, 9, 5], 3)]
    # one branch per distinct continuation: the older "5 6 7 -> 10" repeats the first start
    history = torch.tensor([5, 6, 7, 10, 1, 5, 6, 7, 10, 2, 5, 6, 7])
    assert lookup_continuations(history, 2) == [([10, 2], 3)]


def test_a_match_running_into_the_end_continues_as_a_repeat_and_no_match_gives_none():
    # "3 4" recurs two tokens back: the text repeats with period 2 past its end
    assert lookup_continuations(torch.tensor([3, 4, 3, 4]), 5) == [([3, 4, 3, 4, 3], 2)]
    assert lookup_continuations(torch.tensor([1, 2, 3, 9, 1, 2, 3]), 6) == [([9, 1, 2, 3, 9, 1], 3)]
    assert lookup_continuations(torch.tensor([1, 2, 3, 4]), 5) == []
    assert lookup_continuations(torch.tensor([7]), 5) == []


def test_only_a_long_match_makes_a_lookup_only_round_of_its_own_branches():
    assert LOOKUP_ROUND_NGRAM == 3
    strong = lookup_continuations(torch.tensor([5, 6, 7, 8, 9, 3, 6, 7, 2, 6, 1, 5, 6, 7]), 4)
    assert strong == [([8, 9, 3, 6], 3), ([2, 6, 1, 5], 2)] and is_lookup_round(strong)
    pool = lookup_pool(torch.tensor([7]), strong)
    # only the 3-token match's branch, a chain from the root, every node a lookup node
    assert pool.tokens.tolist() == [[8, 9, 3, 6]] and pool.parents.tolist() == [[-1, 0, 1, 2]]
    assert pool.depths.tolist() == [[1, 2, 3, 4]] and pool.lookup.all()
    expected = [k * math.log(LOOKUP_TOKEN_PROB[3]) for k in range(1, 5)]
    assert torch.allclose(pool.scores[0], torch.tensor(expected))
    tree = pack_tree(pool, torch.tensor([7]), pool.tokens.shape[1], 7)
    assert tree.tokens.tolist() == [[7, 8, 9, 3, 6]] and tree.lookup[0, 1:].all()
    weak = lookup_continuations(torch.tensor([5, 6, 7, 8, 5, 6]), 4)  # "5 6" recurs: a 2-token match
    assert weak == [([7, 8, 5, 6], 2)] and not is_lookup_round(weak)
    assert not is_lookup_round([])


def test_a_gated_round_verifies_the_best_matchs_branch_cut_by_its_match_length_or_the_root_alone():
    branches = lookup_continuations(torch.tensor([5, 6, 7, 8, 9, 3, 6, 7, 2, 6, 1, 5, 6]), 6)
    assert branches[0] == ([7, 8, 9, 3, 6, 7], 2)
    pool = lookup_pool(torch.tensor([6]), branches, 5)  # a 2-token match: the whole L = 5 tokens
    assert pool.tokens.tolist() == [[7, 8, 9, 3, 6]] and pool.parents.tolist() == [[-1, 0, 1, 2, 3]]
    assert pool.lookup.all()
    assert torch.allclose(pool.scores[0], torch.tensor([k * math.log(LOOKUP_TOKEN_PROB[2]) for k in range(1, 6)]))
    single = lookup_continuations(torch.tensor([4, 8, 1, 2, 3, 4, 5, 6, 9, 8]), 7)
    assert single[0] == ([1, 2, 3, 4, 5, 6, 9], 1)
    pool = lookup_pool(torch.tensor([8]), single, 7)  # a 1-token match: LOOKUP_WEAK_TOKENS tokens
    assert pool.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 9][:LOOKUP_WEAK_TOKENS]]
    assert gated_branch_length(1, 2) == min(LOOKUP_WEAK_TOKENS, 2) and gated_branch_length(3, 7) == 7
    empty = lookup_pool(torch.tensor([6]), [], 3)
    tree = pack_tree(empty, torch.tensor([6]), empty.tokens.shape[1], 7)
    assert tree.tokens.tolist() == [[6]] and tree.num_nodes == 0  # a plain step


def test_the_drafter_gate_closes_on_a_drafter_that_does_not_pay_and_retries_it():
    gate = DrafterGate(0.5)
    assert gate.is_open  # the first round always drafts
    gate.drafted(0)
    assert not gate.is_open
    for _ in range(DRAFTER_GATE_ROUNDS - 1):
        gate.skipped()
        assert not gate.is_open
    gate.skipped()
    assert gate.is_open  # after DRAFTER_GATE_ROUNDS rounds without it the drafter drafts again
    gate.drafted(3)  # a running mean: 0.3 * 3 = 0.9 >= 0.5
    assert math.isclose(gate.gain, DRAFTER_GATE_SMOOTHING * 3) and gate.is_open and gate.idle == 0
    gate.drafted(0)
    gate.drafted(0)  # 0.9 * 0.7 * 0.7 = 0.44
    assert not gate.is_open
    never = DrafterGate(0.0)
    never.drafted(0)
    assert never.is_open


def small_pool(vocab: int = 12, policy: TreePolicy | None = None):
    policy = policy or TreePolicy(topk=2, frontier=2, budget=10, depth=3)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, policy.depth, vocab, generator=gen) * 2
    return expand_tree(logits, lambda t: torch.zeros(*t.shape, vocab), torch.tensor([0]), policy), policy


def test_grafting_merges_duplicates_adds_new_nodes_and_keeps_paths_unique():
    pool, policy = small_pool()
    first_child = int(pool.tokens[0, 0])  # a depth-1 drafter candidate
    fresh = next(t for t in range(12) if t not in pool.tokens[0, : policy.topk].tolist())
    grafted = graft_lookup(pool, [([first_child, 11, 11], 3), ([fresh, 4], 1)])
    num_new = grafted.tokens.shape[1] - pool.tokens.shape[1]
    assert grafted.lookup[0].sum() == num_new and not grafted.lookup[0, : pool.tokens.shape[1]].any()
    # the duplicate is the same node, with the larger of its two scores
    assert grafted.scores[0, 0] == max(float(pool.scores[0, 0]), math.log(LOOKUP_TOKEN_PROB[3]))
    pairs = list(zip(grafted.parents[0].tolist(), grafted.tokens[0].tolist(), strict=True))
    assert len(pairs) == len(set(pairs)), "no duplicate siblings"
    for i, (parent, _) in enumerate(pairs):  # scores never increase along a path
        if parent >= 0:
            assert grafted.scores[0, i] <= grafted.scores[0, parent]
            assert grafted.depths[0, i] == grafted.depths[0, parent] + 1
    for budget in range(1, grafted.tokens.shape[1] + 1):  # every budget packs a prefix-closed, ordered tree
        tree = pack_tree(grafted, torch.tensor([0]), budget, policy.depth)
        for i in range(1, tree.num_nodes + 1):
            assert 0 <= tree.parents[0, i] < i
            assert tree.depths[0, i] >= tree.depths[0, i - 1]
        assert tree.lookup.shape == tree.tokens.shape


def test_lookup_widens_the_budget_by_its_new_nodes_up_to_the_branch_length():
    from hf_treespark.sources.lookup import add_lookup_branches, find_lookup_branches, max_extra_budget

    pool, policy = small_pool(vocab=40)
    no_match = find_lookup_branches(torch.tensor([1, 2, 3, 4]), 3)
    assert no_match == [] and add_lookup_branches(pool, no_match, 3) == (pool, 0)  # no match: no extra node
    assert find_lookup_branches(torch.tensor([5, 6, 5]), 0) == []  # length 0: lookup off
    # "5 6 7" recurs twice with different continuations: two branches of up to 3 tokens, ids 30+ are new
    history = torch.tensor([5, 6, 7, 30, 31, 32, 5, 6, 7, 33, 34, 35, 5, 6, 7])
    branches = find_lookup_branches(history, 3)
    grafted, extra = add_lookup_branches(pool, branches, 3)
    assert int(grafted.lookup[0].sum()) == 6 and extra == 3 == max_extra_budget(branches, 3)
    tree = pack_tree(grafted, torch.tensor([0]), policy.budget + extra, policy.depth)
    assert tree.num_nodes == policy.budget + 3 and bool(tree.lookup.any())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_with_lookup_branches_equals_plain_generate(arch, attn):
    target = make_target(arch, attn)
    drafter = make_drafter(target)
    repeating = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9]])
    for ids, new in ((repeating, 30), (prompt(1, 17), 25), (prompt(2, 5), 20)):
        ref = target.generate(ids, do_sample=False, max_new_tokens=new)
        oracle = make_oracle(target, ref)  # drafter candidates that duplicate lookup branches
        for knobs in ({"tree_lookup": 4}, {"tree_lookup": 4, "tree_gate": 0}, {"tree_lookup": 7, "tree_budget": 3},
                      {"tree_lookup": 2, "tree_chain": True}):
            for d in (drafter, oracle):
                out = target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=new,
                                      return_dict_in_generate=True, **knobs)
                assert torch.equal(out.sequences, ref), (arch, attn, knobs, type(d).__name__)
    out = target.generate(repeating, assistant_model=drafter, do_sample=False, max_new_tokens=30, tree_lookup=5,
                          return_dict_in_generate=True, tree_record=True)
    assert sum(r.lookup_accepted for r in out.rounds) > 0, "the repeating prompt should commit lookup tokens"
    assert any(any(r.tree["lookup"]) for r in out.rounds)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampling_walk_over_a_grafted_tree_follows_the_target(temperature):
    vocab = 6
    pool, policy = small_pool(vocab, TreePolicy(topk=2, frontier=1, budget=8, depth=3))
    grafted = graft_lookup(pool, [([5, 4, 3], 3), ([int(pool.tokens[0, 0]), 2], 2)])
    tree = pack_tree(grafted, torch.tensor([0]), 8, policy.depth)
    assert tree.lookup.any()
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, tree.num_nodes + 1, vocab, generator=gen) * 1.5
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    children = {int(tree.tokens[0, i]): i for i in range(1, tree.num_nodes + 1) if tree.parents[0, i] == 0}
    torch.manual_seed(0)
    first, pairs = torch.zeros(vocab), torch.zeros(vocab, vocab)
    for _ in range(20_000):
        acc = processed_accept(tree, logits, torch.tensor([[0]]), processors, do_sample=True)
        t1 = int(acc.tokens[0, 0])
        first[t1] += 1
        if t1 in children:
            pairs[t1, int(acc.tokens[0, 1])] += 1
    assert chi_square_ok(first, torch.softmax(logits[0, 0] / temperature, -1))[0]
    tested = 0
    for token, node in children.items():
        if pairs[token].sum() >= 500:
            assert chi_square_ok(pairs[token], torch.softmax(logits[0, node] / temperature, -1))[0]
            tested += 1
    assert tested >= 2  # a drafted child and a lookup child


@torch.no_grad()
def second_token_marginal(target, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The target's distribution `[V]` of the second token sampled after `ids` (`[1, T]`), the first summed out."""
    vocab = target.config.vocab_size
    p1 = torch.softmax(target(ids).logits[0, -1] / temperature, -1)
    seq2 = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
    return (p1[:, None] * torch.softmax(target(seq2).logits[:, -1] / temperature, -1)).sum(0)


def test_end_to_end_sampling_with_lookup_matches_the_target_distribution():
    target = make_target("llama", seed=3)
    ids = torch.tensor([[9, 4, 7, 9, 4]])  # the suffix "9 4" occurred before: a lookup branch "7 9 4"
    vocab, temperature = target.config.vocab_size, 1.0
    marg2 = second_token_marginal(target, ids, temperature)
    drafter = make_drafter(target, tree_topk=2, tree_frontier=1, tree_budget=6)
    torch.manual_seed(0)
    counts = torch.zeros(vocab)
    for _ in range(600):
        out = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=temperature, top_k=0,
                              max_new_tokens=2, eos_token_id=None, tree_lookup=3, return_dict_in_generate=True)
        counts[out.sequences[0, -1]] += 1
    ok, stat = chi_square_ok(counts, marg2)
    assert ok, stat


def prompt_with_a_likely_repeat(target, temperature: float) -> tuple[torch.Tensor, int]:
    """A prompt `[x, y, c, z, x, y]` whose likeliest next token is `c` (p > 0.5): after it the text ends in
    "x y c", which occurred before, so the first round is lookup-only with high probability."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    for _ in range(50):
        x, y, z = torch.randint(4, vocab, (3,), generator=gen).tolist()
        c = torch.arange(vocab)
        batch = torch.stack([torch.full_like(c, x), torch.full_like(c, y), c, torch.full_like(c, z),
                             torch.full_like(c, x), torch.full_like(c, y)], dim=1)
        with torch.no_grad():
            p1 = torch.softmax(target(batch).logits[:, -1] / temperature, -1)
        good = (p1.argmax(-1) == c) & (p1[c, c] > 0.5)
        if good.any():
            best = int(good.nonzero()[0])
            return batch[best: best + 1], best
    raise AssertionError("no prompt with a likely repeat in 50 tries")


def test_sampling_through_lookup_only_rounds_matches_the_target_distribution():
    """A lookup-only round (no drafter pass) in the middle of sampling: the second token keeps the target's
    distribution, and the drafter catches up on the skipped round's features in the next round."""
    target = make_target("llama", seed=3)
    temperature = 0.4  # sharp enough that some prompt repeats itself with probability > 0.5
    ids, repeat = prompt_with_a_likely_repeat(target, temperature)
    assert int(ids[0, 2]) == repeat
    vocab = target.config.vocab_size
    marg2 = second_token_marginal(target, ids, temperature)
    drafter = make_drafter(target, tree_topk=2, tree_frontier=1, tree_budget=6)
    torch.manual_seed(0)
    counts, lookup_rounds = torch.zeros(vocab), 0
    for _ in range(600):
        out = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=temperature, top_k=0,
                              max_new_tokens=4, eos_token_id=None, tree_lookup=3, return_dict_in_generate=True,
                              tree_record=True)
        counts[out.sequences[0, ids.shape[1] + 1]] += 1
        first = out.rounds[0].tree
        lookup_rounds += int(all(first["lookup"][1:]) and first["tokens"][1] == ids[0, 3])
    assert lookup_rounds > 250, lookup_rounds  # p(repeat) > 0.5: most first rounds verified the branch "z x y"
    ok, stat = chi_square_ok(counts, marg2)
    assert ok, stat


def test_each_planned_round_names_its_kind():
    from hf_treespark.decoding.engine import ROUND_KINDS, RowPlanner

    planner = RowPlanner(TreePolicy(topk=2, frontier=2, budget=4, depth=3, lookup=4), gate=0.5)
    strong = torch.tensor([5, 6, 7, 8, 9, 3, 6, 7, 2, 6, 1, 5, 6, 7])  # a 3-token match: lookup-only
    plan = planner.plan(strong)
    assert plan.tree is not None and planner.round_kind() == "lookup"
    plain_text = torch.tensor([5, 6, 7, 8, 9, 10, 11])  # no match: the drafter drafts
    assert planner.plan(plain_text).tree is None and planner.round_kind() == "drafter"
    planner.gate.drafted(0)  # a drafter that did not pay closes the gate
    assert planner.plan(plain_text).tree is not None and planner.round_kind() == "gated"
    assert planner.plan(strong, probe=True).tree.num_nodes == 0 and planner.round_kind(probe=True) == "probe"
    assert set(ROUND_KINDS) == {"drafter", "lookup", "gated", "probe", "plain"}
