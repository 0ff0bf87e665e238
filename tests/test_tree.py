"""Properties of the deployed tree policy (SPEC section 2)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_treespark.core.tree import TreePolicy, ancestor_matrix, build_tree, expand_tree

V = 50


def random_inputs(seed: int, batch: int, depth: int, rank: int = 4):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, depth, V, generator=gen) * 3
    w1 = torch.randn(V, rank, generator=gen)
    w2 = torch.randn(V, rank, generator=gen)
    markov = lambda tokens: w1[tokens] @ w2.T  # noqa: E731
    roots = torch.randint(0, V, (batch,), generator=gen)
    return logits, markov, roots


def paths(tree, b):
    """Token path from the root to each node of batch row b."""
    parents, tokens = tree.parents[b].tolist(), tree.tokens[b].tolist()
    result = []
    for i in range(len(tokens)):
        path, node = [], i
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        result.append(tuple(reversed(path)))
    return result


policies = st.builds(
    TreePolicy,
    topk=st.integers(1, 5),
    frontier=st.integers(1, 5),
    budget=st.integers(1, 40),
    depth=st.integers(1, 6),
)


@settings(max_examples=60, deadline=None)
@given(policy=policies, seed=st.integers(0, 10_000), batch=st.integers(1, 3))
def test_tree_is_prefix_closed_ordered_and_within_budget(policy, seed, batch):
    logits, markov, roots = random_inputs(seed, batch, policy.depth)
    tree = build_tree(logits, markov, roots, policy)
    n = tree.num_nodes
    assert n == min(policy.budget, policy.num_candidates)
    assert tree.candidates.tokens.shape[1] == policy.num_candidates
    for b in range(batch):
        parents = tree.parents[b]
        assert parents[0] == -1 and tree.depths[b, 0] == 0 and tree.tokens[b, 0] == roots[b]
        for i in range(1, n + 1):
            p = int(parents[i])
            assert 0 <= p < i, "parents precede children"
            assert tree.depths[b, i] == tree.depths[b, p] + 1
            assert tree.scores[b, i] <= tree.scores[b, p], "scores never increase along a path"
        # siblings carry distinct tokens, so each path is unique
        assert len(set(paths(tree, b))) == n + 1


@settings(max_examples=60, deadline=None)
@given(policy=policies, seed=st.integers(0, 10_000))
def test_packed_set_is_brute_force_top_n_of_candidates(policy, seed):
    logits, markov, roots = random_inputs(seed, 1, policy.depth)
    tree = build_tree(logits, markov, roots, policy)
    cand = tree.candidates
    scores = cand.scores[0].tolist()
    depths = cand.depths[0].tolist()
    # brute force: sort by (score desc, depth asc, index asc)
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))
    expected = set(ranked[: tree.num_nodes])
    assert set(cand.packed[0].nonzero().flatten().tolist()) == expected
    # the packed tree's nodes are exactly those candidates, with matching tokens and scores
    for c in expected:
        node = int(cand.node_index[0, c])
        assert tree.tokens[0, node] == cand.tokens[0, c]
        assert tree.scores[0, node] == cand.scores[0, c]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), depth=st.integers(1, 7))
def test_chain_mode_equals_sequential_top1_drafting(seed, depth):
    logits, markov, roots = random_inputs(seed, 2, depth)
    tree = build_tree(logits, markov, roots, TreePolicy.chain(depth))
    for b in range(2):
        parent, expected = roots[b], []
        for d in range(depth):
            parent = torch.log_softmax(logits[b, d] + markov(parent[None])[0], -1).argmax()
            expected.append(int(parent))
        assert tree.tokens[b, 1:].tolist() == expected
        assert tree.parents[b].tolist() == [-1] + list(range(depth))


def test_scores_are_sums_of_markov_conditioned_log_probs():
    logits, markov, roots = random_inputs(3, 1, 4)
    tree = build_tree(logits, markov, roots, TreePolicy(topk=3, frontier=2, budget=10, depth=4))
    for i in range(1, tree.num_nodes + 1):
        p = int(tree.parents[0, i])
        d = int(tree.depths[0, i])
        logp = torch.log_softmax(logits[0, d - 1] + markov(tree.tokens[0, p][None])[0], -1)
        expected = tree.scores[0, p] + logp[tree.tokens[0, i]]
        assert torch.allclose(tree.scores[0, i], expected, atol=1e-5)


def test_default_policy_has_100_candidates_and_33_positions():
    policy = TreePolicy()
    assert policy.num_candidates == 4 + 6 * 16
    logits, markov, roots = random_inputs(0, 1, 7)
    tree = build_tree(logits, markov, roots, policy)
    assert tree.tokens.shape == (1, 33)


def test_ancestor_matrix_marks_each_path():
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    anc = ancestor_matrix(parents, 4)[0]
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}}
    for row, members in expected.items():
        assert set(anc[row].nonzero().flatten().tolist()) == members


@pytest.mark.parametrize("field,value", [("topk", 0), ("budget", -1), ("depth", 9), ("frontier", 1.5)])
def test_invalid_policy_is_refused_with_the_field_named(field, value):
    policy = TreePolicy()
    setattr(policy, field, value)
    with pytest.raises(ValueError, match=field):
        policy.validate(block_size=7)


def test_every_candidate_parent_was_an_expanded_frontier_node():
    logits, markov, roots = random_inputs(5, 1, 5)
    policy = TreePolicy(topk=3, frontier=2, budget=20, depth=5)
    tree = build_tree(logits, markov, roots, policy)
    cand = tree.candidates
    expanded = set(itertools.chain.from_iterable(e[0][0].tolist() for e in cand.expansions))
    assert set(cand.parents[0].tolist()) <= expanded
    assert len(cand.expansions) == 5


@settings(max_examples=40, deadline=None)
@given(policy=policies, seed=st.integers(0, 10_000))
def test_a_small_budget_drafts_fewer_depths_and_packs_the_same_tree(policy, seed):
    """Budget N < depth expands only N depths; the packed tree equals the top N of the full-depth pool."""
    logits, markov, roots = random_inputs(seed, 1, policy.depth)
    small = build_tree(logits, markov, roots, policy)
    full = build_tree(logits, markov, roots, TreePolicy(policy.topk, policy.frontier, 10_000, policy.depth))
    assert int(small.candidates.depths.max()) == policy.expanded_depth
    cand = full.candidates
    scores, depths = cand.scores[0].tolist(), cand.depths[0].tolist()
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[: small.num_nodes]
    expected = set()
    for c in ranked:
        path, node = [], c
        while node >= 0:
            path.append(int(cand.tokens[0, node]))
            node = int(cand.parents[0, node])
        expected.add(tuple(reversed(path)))
    assert set(paths(small, 0)[1:]) == expected


@settings(max_examples=80, deadline=None)
@given(policy=policies, seed=st.integers(0, 10_000), batch=st.integers(1, 3), slack=st.integers(0, 6),
       coarse=st.booleans())
def test_early_stop_packs_the_same_tree_as_the_full_pool(policy, seed, batch, slack, coarse):
    from hf_treespark.core.tree import expand_tree, pack_tree

    logits, markov, roots = random_inputs(seed, batch, policy.depth)
    if coarse:  # integer logits and a zero Markov head: many tied scores, settled by depth then order
        logits, markov = logits.round(), (lambda tokens: torch.zeros(*tokens.shape, V))
    full = expand_tree(logits, markov, roots, policy)
    stop = policy.budget + slack
    early = expand_tree(logits, markov, roots, policy, stop_budget=stop)
    assert early.tokens.shape[1] <= full.tokens.shape[1]
    count = early.tokens.shape[1]  # the early pool is a prefix of the full one (depth-major order)
    assert torch.equal(early.tokens, full.tokens[:, :count]) and torch.equal(early.scores, full.scores[:, :count])
    for budget in {policy.budget, stop}:
        want, got = pack_tree(full, roots, budget, policy.depth), pack_tree(early, roots, budget, policy.depth)
        for name in ("tokens", "parents", "depths", "scores", "ancestors"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_early_stop_skips_depths_that_could_not_be_packed():
    from hf_treespark.core.tree import expand_tree, pack_tree

    policy = TreePolicy(topk=4, frontier=4, budget=4, depth=6)
    logits = torch.full((1, 6, V), -20.0)
    logits[0, 0, 7] = 0.0  # depth 1: four plausible tokens ...
    logits[0, 0, 8:11] = -0.5
    logits[0, 1:, :] = 0.0  # ... and flat distributions below: every depth-2 node scores below all of depth 1
    roots = torch.tensor([3])
    zero = lambda tokens: torch.zeros(*tokens.shape, V)  # noqa: E731
    full = expand_tree(logits, zero, roots, policy)
    early = expand_tree(logits, zero, roots, policy, stop_budget=4)
    # depth 1 fills the budget but its best node could still have a child above the 4th: depth 2 is expanded;
    # after it no frontier node beats the 4th best candidate, so depths 3 and 4 are skipped
    assert len(full.expansions) == 4 and len(early.expansions) == 2
    assert torch.equal(pack_tree(early, roots, 4, 6).tokens, pack_tree(full, roots, 4, 6).tokens)


def _markov_rows(rank_inputs):
    """`markov_rows` for `random_inputs`' Markov head: the correction on some rows only."""
    w1, w2 = rank_inputs
    return lambda tokens, rows: torch.matmul(w1[tokens], w2[rows].transpose(1, 2))


@settings(max_examples=40, deadline=None)
@given(policy=policies, seed=st.integers(0, 10_000), batch=st.integers(1, 3), shortlist=st.integers(5, 49))
def test_a_shortlist_chooses_children_among_the_depths_best_entries_normalised_over_every_entry(policy, seed, batch,
                                                                                           shortlist):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, policy.depth, V, generator=gen) * 3
    w1, w2 = torch.randn(V, 4, generator=gen), torch.randn(V, 4, generator=gen) * 0.3
    markov = lambda tokens: w1[tokens] @ w2.T  # noqa: E731
    roots = torch.randint(0, V, (batch,), generator=gen)
    policy = replace(policy, shortlist=max(shortlist, policy.topk))
    pool = expand_tree(logits, markov, roots, policy, markov_rows=_markov_rows((w1, w2)))
    best = logits.topk(policy.shortlist, dim=-1).indices
    for b in range(batch):
        for token, depth, parent, score in zip(pool.tokens[b].tolist(), pool.depths[b].tolist(),
                                               pool.parents[b].tolist(), pool.scores[b].tolist(), strict=True):
            assert token in best[b, depth - 1].tolist()  # a child comes from its depth's shortlist
            parent_token = int(roots[b]) if parent < 0 else int(pool.tokens[b, parent])
            parent_score = 0.0 if parent < 0 else float(pool.scores[b, parent])
            u = logits[b, depth - 1]
            z = u + markov(torch.tensor([parent_token]))[0]
            listed = torch.zeros(V, dtype=torch.bool)
            listed[best[b, depth - 1]] = True
            # normalised over all of V: the shortlist with the parent's correction, the rest at U_d alone
            norm = torch.logaddexp(z[listed].logsumexp(0), u[~listed].logsumexp(0))
            assert score == pytest.approx(parent_score + float(z[token] - norm), abs=1e-4)


def test_a_shortlist_of_the_whole_vocabulary_or_without_markov_rows_is_the_full_expansion():
    logits, markov, roots = random_inputs(7, 2, 5)
    policy = TreePolicy(topk=3, frontier=3, budget=20, depth=5)
    w1 = torch.randn(V, 4)
    full = expand_tree(logits, markov, roots, policy)
    for short in (replace(policy, shortlist=V), replace(policy, shortlist=10)):
        rows = _markov_rows((w1, w1)) if short.shortlist == V else None  # M = V, or no markov_rows: no shortlist
        same = expand_tree(logits, markov, roots, short, markov_rows=rows)
        assert torch.equal(same.tokens, full.tokens) and torch.equal(same.scores, full.scores)
    # with no Markov correction, the depth's top entries are the shortlist's: the same pool
    flat = lambda tokens: torch.zeros(*tokens.shape, V)  # noqa: E731
    flat_rows = lambda tokens, rows: torch.zeros(*tokens.shape, rows.shape[-1])  # noqa: E731
    a = expand_tree(logits, flat, roots, policy)
    b = expand_tree(logits, flat, roots, replace(policy, shortlist=8), markov_rows=flat_rows)
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.scores, b.scores, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoding_with_a_shortlist_is_exact_in_fp32(arch):
    from conftest import make_drafter, make_target

    target = make_target(arch)
    drafter = make_drafter(target, tree_shortlist=8)
    for seed in range(2):
        ids = torch.randint(4, 100, (1, 7), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(ids, do_sample=False, max_new_tokens=24)
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, tree_guard=False,
                              tree_record=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert all(r.tree_size > 0 for r in out.rounds)


def test_tree_shortlist_must_be_a_non_negative_integer():
    from hf_treespark.drafter.configuration import TreeSparkConfig

    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="tree_shortlist"):
            TreeSparkConfig(target_hidden_size=64, target_vocab_size=128, target_num_hidden_layers=4,
                            tree_shortlist=bad).validate_fields()
