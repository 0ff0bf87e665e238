"""The drafter's heads, its feature indexing and its binding to a target (SPEC section 1)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark import TreeSparkConfig, TreeSparkDrafter
from hf_treespark.decoding.engine import target_features
from hf_treespark.drafter.configuration import default_target_layer_ids


@pytest.fixture
def pair():
    target = make_target("qwen3")
    return target, make_drafter(target)


@pytest.fixture(params=["kv-only", "anchor-features", "depth1-head"])
def drafting_pair(request):
    """A drafter with the SPEC's KV-only conditioning, one that also feeds `ctx[a - 1]` into its block
    (`anchor_features`), and one with a depth-1 head (`depth1_head`); their zero-initialised projections made
    non-zero so that they matter."""
    target = make_target("qwen3")
    option = {"kv-only": {}, "anchor-features": {"anchor_features": True}, "depth1-head": {"depth1_head": 24}}
    drafter = make_drafter(target, **option[request.param])
    with torch.no_grad():
        if drafter.anchor_proj is not None:
            drafter.anchor_proj.weight.normal_(0.0, 0.5)
        if drafter.depth1_head is not None:
            drafter.depth1_head.out.weight.normal_(0.0, 0.5)
    return target, drafter


def test_anchor_features_start_at_zero_and_change_the_draft():
    target = make_target("qwen3")
    assert make_drafter(target).anchor_proj is None
    drafter = make_drafter(target, anchor_features=True).bind_target(target)
    assert torch.count_nonzero(drafter.anchor_proj.weight) == 0  # a fresh drafter drafts as the KV-only one
    ids = torch.randint(4, 100, (1, 9))
    feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    kwargs = dict(anchor_ids=ids[:, 8:9], anchor_positions=torch.tensor([[8]]), target_features=feats[:, :8],
                  context_positions=torch.arange(8)[None])
    with torch.no_grad():
        before = drafter(**kwargs).depth_logits
        drafter.anchor_proj.weight.normal_(0.0, 0.5)
        after = drafter(**kwargs).depth_logits
    assert not torch.allclose(before, after)


def test_a_depth1_head_starts_as_the_drafter_without_it_and_changes_only_the_first_depth():
    target = make_target("qwen3")
    plain = make_drafter(target).bind_target(target)
    grown = make_drafter(target, depth1_head=24)
    assert plain.depth1_head is None and torch.count_nonzero(grown.depth1_head.out.weight) == 0
    missing, _ = grown.load_state_dict(plain.state_dict(), strict=False)
    assert missing and all(name.startswith("depth1_head.") for name in missing)
    grown.bind_target(target)
    ids = torch.randint(4, 100, (1, 9))
    feats, _ = target_features(target, plain.config.target_layer_ids, ids, torch.ones_like(ids))
    kwargs = dict(anchor_ids=ids[:, 8:9], anchor_positions=torch.tensor([[8]]), target_features=feats[:, :8],
                  context_positions=torch.arange(8)[None])
    with torch.no_grad():
        assert torch.equal(plain(**kwargs).depth_logits, grown(**kwargs).depth_logits)
        grown.depth1_head.out.weight.normal_(0.0, 0.5)
        after = grown(**kwargs).depth_logits
    before = plain(**kwargs).depth_logits.detach()
    assert not torch.allclose(after[0, 0], before[0, 0])  # the anchor slot: depth 1
    assert torch.equal(after[0, 1:], before[0, 1:])  # the other depths are untouched


def test_a_ragged_batch_pass_drafts_each_row_as_it_alone_would(drafting_pair):
    """Rows with different context lengths, left-padded (`context_valid`), one of them with no new context in the
    second pass (the drafter keeps its newest features): each row's draft equals that row's own cached draft."""
    target, drafter = drafting_pair
    drafter.bind_target(target)
    ids = torch.randint(4, 100, (2, 12))
    feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    # (context positions of each pass, anchor position) per row: row 0 gets nothing new in pass 2
    passes = [([range(0, 7), range(0, 4)], [7, 4]), ([range(7, 7), range(4, 9)], [7, 9])]
    cache, alone = drafter.new_context_cache(), [drafter.new_context_cache(), drafter.new_context_cache()]
    with torch.no_grad():
        for spans, anchors in passes:
            width = max(len(span) for span in spans)
            new = feats.new_zeros(2, width, feats.shape[-1])
            valid = torch.zeros(2, width, dtype=torch.bool)
            positions = torch.zeros(2, width, dtype=torch.long)
            for row, span in enumerate(spans):
                if len(span):
                    new[row, width - len(span):] = feats[row, list(span)]
                    valid[row, width - len(span):] = True
                    positions[row, width - len(span):] = torch.tensor(list(span))
            anchor = torch.tensor(anchors)[:, None]
            together = drafter(anchor_ids=ids.gather(1, anchor), anchor_positions=anchor, target_features=new,
                               context_positions=positions, context_cache=cache, context_valid=valid).depth_logits
            for row, span in enumerate(spans):
                one = drafter(anchor_ids=ids[row:row + 1, anchors[row]:anchors[row] + 1],
                              anchor_positions=anchor[row:row + 1],
                              target_features=feats[row:row + 1, list(span)] if len(span) else None,
                              context_positions=torch.tensor([list(span)]) if len(span) else None,
                              context_cache=alone[row]).depth_logits
                assert torch.allclose(together[row], one[0], atol=1e-4), (anchors, row)


def test_markov_head_formula_and_shapes(pair):
    _, drafter = pair
    parents = torch.tensor([[3, 7], [1, 0]])
    bias = drafter.markov_bias(parents)
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    assert bias.shape == (2, 2, drafter.config.target_vocab_size)
    assert torch.allclose(bias[0, 1], w2 @ w1[7], atol=1e-5)
    assert w1.shape == (drafter.config.target_vocab_size, drafter.config.markov_rank)


def test_fresh_markov_head_starts_as_the_pure_parallel_drafter():
    target = make_target("llama")
    drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, num_hidden_layers=1, head_dim=32,
                                                          num_attention_heads=2, num_key_value_heads=1,
                                                          markov_rank=8, mask_token_id=3))
    assert torch.count_nonzero(drafter.markov_head.markov_w2.weight) == 0


def test_confidence_head_formula(pair):
    _, drafter = pair
    hidden = torch.randn(2, 5, drafter.config.hidden_size)
    parents = torch.randint(0, 100, (2, 5))
    conf = drafter.confidence(hidden, parents)
    proj = drafter.confidence_head.proj
    manual = torch.sigmoid(torch.cat([hidden, drafter.markov_head.markov_w1(parents)], -1) @ proj.weight[0]
                           + proj.bias[0])
    assert conf.shape == (2, 5) and torch.allclose(conf, manual, atol=1e-6)
    assert ((conf > 0) & (conf < 1)).all()


def test_depth_logits_use_the_targets_lm_head(pair):
    target, drafter = pair
    drafter.bind_target(target)
    hidden = torch.randn(3, drafter.config.hidden_size)
    assert torch.allclose(drafter.depth_logits(hidden), target.lm_head(hidden), atol=1e-6)


def test_target_features_are_hidden_states_at_layer_plus_one(pair):
    """Layer l's output is HF hidden_states[l + 1]; features concatenate them in target_layer_ids order."""
    target, drafter = pair
    ids = torch.randint(4, 100, (1, 9))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    from hf_treespark.training.trainer import target_features

    feats, final = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    d = target.config.hidden_size
    for slot, layer in enumerate(drafter.config.target_layer_ids):
        assert torch.equal(feats[..., slot * d:(slot + 1) * d], hs[layer + 1])
    assert torch.equal(final, hs[-1])
    # the hook that the decoding loop uses on the target forward: the same indices
    captured = {}

    def hook_for(layer):
        def hook(module, args, output):
            captured[layer] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [target.model.layers[i].register_forward_hook(hook_for(i)) for i in drafter.config.target_layer_ids]
    with torch.no_grad():
        target(ids)
    for h in handles:
        h.remove()
    for slot, layer in enumerate(drafter.config.target_layer_ids):
        assert torch.allclose(feats[..., slot * d:(slot + 1) * d], captured[layer], atol=1e-6)


def test_default_layer_ids_are_spread_and_skip_the_last_layer():
    assert default_target_layer_ids(36) == [1, 9, 18, 26, 34]
    assert default_target_layer_ids(30)[-1] <= 28
    with pytest.raises(ValueError, match="target_layer_ids"):
        TreeSparkConfig(target_num_hidden_layers=4, target_layer_ids=[1, 3])


def test_binding_refuses_a_target_that_does_not_fit(pair):
    target, drafter = pair
    other_vocab = make_target("qwen3")
    other_vocab.resize_token_embeddings(96)
    with pytest.raises(ValueError, match="vocabulary size"):
        drafter.bind_target(other_vocab)
    deeper = make_target("qwen3", layers=6)
    with pytest.raises(ValueError, match="layers"):
        drafter.bind_target(deeper)
    with pytest.raises(RuntimeError, match="bind_target"):
        make_drafter(target).depth_logits(torch.zeros(1, drafter.config.hidden_size))


def test_block_layout_anchor_then_mask_slots(pair):
    target, drafter = pair
    drafter.bind_target(target)
    emb = drafter.block_embeddings(torch.tensor([[5, 9]]))
    b = drafter.config.block_size
    embed = target.get_input_embeddings()
    assert emb.shape == (1, 2 * b, drafter.config.hidden_size)
    assert torch.equal(emb[0, 0], embed.weight[5]) and torch.equal(emb[0, b], embed.weight[9])
    assert torch.equal(emb[0, 1], embed.weight[drafter.config.mask_token_id])


def test_learned_mask_embedding_when_no_spare_id():
    target = make_target("llama")
    drafter = make_drafter(target, mask_token_id=None).bind_target(target)
    assert drafter.mask_embedding is not None
    emb = drafter.block_embeddings(torch.tensor([[5]]))
    assert torch.equal(emb[0, 1], drafter.mask_embedding)


def test_cached_drafting_equals_uncached_block_attention(drafting_pair):
    """Inference (context cache, appended in two pieces) and training (mask) paths draft the same block."""
    target, drafter = drafting_pair
    drafter.bind_target(target)
    ids = torch.randint(4, 100, (1, 12))
    feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    anchor = 10
    cache = drafter.new_context_cache()
    with torch.no_grad():
        drafter(anchor_ids=ids[:, 6:7], anchor_positions=torch.tensor([[6]]), target_features=feats[:, :6],
                context_cache=cache)
        cached = drafter(anchor_ids=ids[:, anchor:anchor + 1], anchor_positions=torch.tensor([[anchor]]),
                         target_features=feats[:, 6:anchor], context_cache=cache)
        full = drafter(anchor_ids=ids[:, anchor:anchor + 1], anchor_positions=torch.tensor([[anchor]]),
                       target_features=feats, context_positions=torch.arange(12)[None])
    assert cache.get_seq_length() == anchor
    assert torch.allclose(cached.depth_logits, full.depth_logits, atol=1e-4)


def test_a_context_cache_that_grows_past_its_buffer_drafts_as_the_uncached_drafter(drafting_pair):
    """Many passes, each bringing a few new context positions or none (then the cache's newest entries are the ones
    the previous pass's block wrote over): every cached draft equals the uncached one of its anchor, also after the
    cache's buffers had to grow (they start with room for 64 entries) and after a crop."""
    target, drafter = drafting_pair
    drafter.bind_target(target)
    ids = torch.randint(4, 100, (1, 96))
    feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    cache, seen = drafter.new_context_cache(), 0
    with torch.no_grad():
        for anchor in [5, 5, 8, 9, 9, 30, 31, 33, 62, 63, 63, 70, 90, 91]:
            if anchor == 62:  # keep the first 25 positions only, as a crop would
                cache.crop(25)
                seen = 25
            new = feats[:, seen:anchor] if anchor > seen else None
            cached = drafter(anchor_ids=ids[:, anchor:anchor + 1], anchor_positions=torch.tensor([[anchor]]),
                             target_features=new, context_cache=cache)
            seen = max(seen, anchor)
            full = drafter(anchor_ids=ids[:, anchor:anchor + 1], anchor_positions=torch.tensor([[anchor]]),
                           target_features=feats[:, :anchor], context_positions=torch.arange(anchor)[None])
            assert cache.get_seq_length() == anchor
            assert torch.allclose(cached.depth_logits, full.depth_logits, atol=1e-4), anchor


def test_training_blocks_each_equal_a_cached_draft_of_their_anchor(drafting_pair):
    """Many anchors per sequence (training's block attention, which never scores a block against another
    block's keys) give each block what one cached inference draft of that anchor gives."""
    target, drafter = drafting_pair
    drafter.bind_target(target)
    ids = torch.randint(4, 100, (2, 16))
    feats, _ = target_features(target, drafter.config.target_layer_ids, ids, torch.ones_like(ids))
    with torch.no_grad():
        anchors = torch.tensor([[1, 7, 12], [5, 9, 15]])
        out = drafter(anchor_ids=ids.gather(1, anchors), anchor_positions=anchors, target_features=feats,
                      context_positions=torch.arange(16).expand(2, -1))
        bsz = drafter.config.block_size
        blocks = out.depth_logits.view(2, anchors.shape[1], bsz, -1)
        for b in range(2):
            for a, anchor in enumerate(anchors[b].tolist()):
                one = drafter(anchor_ids=ids[b:b + 1, anchor:anchor + 1], anchor_positions=torch.tensor([[anchor]]),
                              target_features=feats[b:b + 1, :anchor], context_cache=drafter.new_context_cache())
                assert torch.allclose(blocks[b, a], one.depth_logits[0], atol=1e-4), (b, anchor)
