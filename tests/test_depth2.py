"""The depth-2 head (`config.depth2_head`, `modeling_heads.Depth2Head`): the tree scores depth 2 with it, per parent;
grown, it drafts as before; trained, it survives save/load and decoding with it stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_round_trip_decodes_exactly, make_drafter, make_target

from hf_treespark.core.tree import TreePolicy
from hf_treespark.decoding.engine import drafter_pass, expand_pool, target_features
from hf_treespark.training.depth1 import grow_head


def context(target, drafter, length: int = 10, seed: int = 0):
    ids = torch.randint(4, 128, (1, length), generator=torch.Generator().manual_seed(seed))
    feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    return ids, feats


def pool_of(drafter, ids, feats, policy):
    drafted = drafter_pass(drafter, policy, ids[:, -1], ids.shape[1] - 1, feats[:, :-1], drafter.new_context_cache())
    return drafted, expand_pool(drafter, drafted, ids[:, -1], policy)


def test_a_grown_head_drafts_exactly_as_before():
    target = make_target("llama")
    plain = make_drafter(target).bind_target(target)
    grown = grow_head(plain, "depth2_head", 24).bind_target(target).eval()
    assert grown.config.depth2_head == 24 and plain.config.depth2_head == 0
    ids, feats = context(target, plain)
    policy = TreePolicy(topk=3, frontier=3, budget=12, depth=4)
    with torch.no_grad():
        _, before = pool_of(plain, ids, feats, policy)
        drafted, after = pool_of(grown, ids, feats, policy)
    assert drafted.depth2_inputs is not None
    assert torch.equal(before.tokens, after.tokens) and torch.equal(before.parents, after.parents)
    assert torch.allclose(before.scores, after.scores, atol=1e-5)


def test_the_tree_scores_depth_two_with_the_head_given_each_parent():
    target = make_target("qwen3")
    drafter = grow_head(make_drafter(target), "depth2_head", 24).bind_target(target).eval()
    with torch.no_grad():
        drafter.depth2_head.out.weight.normal_(0.0, 0.5)
    ids, feats = context(target, drafter, seed=3)
    policy = TreePolicy(topk=3, frontier=2, budget=12, depth=3)
    with torch.no_grad():
        drafted, pool = pool_of(drafter, ids, feats, policy)
        depth1 = pool.depths[0] == 1
        second = (pool.depths[0] == 2).nonzero().flatten()
        assert len(second) == 2 * 3  # two parents kept on the frontier, three children each
        parents = pool.parents[0, second]
        rows = drafter.depth2_logits(drafted.depth2_inputs, pool.tokens[:, parents]).log_softmax(-1)[0]
        for row, child, parent in zip(rows, second.tolist(), parents.tolist(), strict=True):
            assert bool(depth1[parent])
            index = int((drafter.draft_vocab_ids == pool.tokens[0, child]).nonzero()) \
                if drafter.draft_vocab_ids is not None else int(pool.tokens[0, child])
            expected = pool.scores[0, parent] + row[index]
            assert torch.allclose(pool.scores[0, child], expected, atol=1e-4)
        # and the head changed what depth 2 proposes for at least one parent (it is not U_2 + Markov)
        u2 = drafted.depth_logits[:, 1, None, :] + drafter.markov_bias(pool.tokens[:, parents])
        assert not torch.allclose(u2.log_softmax(-1)[0], rows, atol=1e-3)


def test_with_a_shortlist_the_head_scores_the_shortlisted_entries_only():
    """`depth2_logits(..., rows)` equals the whole rows' logits at those entries, and a shortlisted tree takes its
    depth-2 children from them, scored `z - logaddexp(logsumexp(z), rest)` as every shortlisted depth is."""
    target = make_target("qwen3")
    drafter = grow_head(make_drafter(target), "depth2_head", 24).bind_target(target).eval()
    with torch.no_grad():
        drafter.depth2_head.out.weight.normal_(0.0, 0.5)
    ids, feats = context(target, drafter, seed=5)
    size = drafter.draft_vocab_size
    policy = TreePolicy(topk=3, frontier=2, budget=12, depth=3, shortlist=size // 2)
    with torch.no_grad():
        drafted, pool = pool_of(drafter, ids, feats, policy)
        parents = pool.tokens[:, (pool.depths[0] == 1).nonzero().flatten()[:2]]
        rows = drafted.depth_logits[:, 1].float().topk(policy.shortlist, dim=-1).indices  # U_2's shortlist
        whole = drafter.depth2_logits(drafted.depth2_inputs, parents)
        short = drafter.depth2_logits(drafted.depth2_inputs, parents, rows)
        assert short.shape == (1, 2, policy.shortlist)
        assert torch.allclose(short, whole.gather(2, rows[:, None, :].expand(-1, 2, -1)), atol=1e-4)
        second = (pool.depths[0] == 2).nonzero().flatten()
        chosen = set(drafter.to_target_ids(rows[0]).tolist())
        assert set(pool.tokens[0, second].tolist()) <= chosen


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_drafter_with_a_trained_depth2_head_round_trips_and_decodes_exactly(arch, tmp_path):
    """A head that matters survives save/load, and greedy decoding with it, batch 1 and a ragged batch, is plain
    greedy decoding."""
    target = make_target(arch)
    drafter = grow_head(grow_head(make_drafter(target), "depth1_head", 16), "depth2_head", 16)
    with torch.no_grad():
        drafter.depth1_head.out.weight.normal_(0.0, 0.5)
        drafter.depth2_head.out.weight.normal_(0.0, 0.5)
    loaded = assert_round_trip_decodes_exactly(drafter, target, tmp_path / "d")
    assert loaded.config.depth2_head == 16


def test_a_bad_depth2_width_is_refused_by_name():
    from hf_treespark import TreeSparkConfig

    with pytest.raises(ValueError, match="depth2_head"):
        TreeSparkConfig(depth2_head=-1)


def test_a_drafter_with_a_depth2_head_is_not_exported_as_dspark(tmp_path):
    from hf_treespark.hub.sharing import DSparkConversionError, export_dspark_checkpoint

    target = make_target("llama")
    drafter = grow_head(make_drafter(target), "depth2_head", 8)
    with pytest.raises(DSparkConversionError, match="depth-2 head"):
        export_dspark_checkpoint(drafter, target, tmp_path)
