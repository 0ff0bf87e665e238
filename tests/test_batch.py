"""Batched TreeSpark decoding (`decoding/session.py`): `generate` on a left-padded batch equals plain `generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_drafter, make_target
from test_generation import chi_square_ok
from transformers.generation.streamers import BaseStreamer

from hf_treespark import TreeSparkDrafter
from hf_treespark.calibration import measure as measuring
from hf_treespark.decoding import budget
from hf_treespark.decoding import session as batch
from hf_treespark.decoding.session import right_aligned

EOS = 2


class BatchOracle(TreeSparkDrafter):
    """The real drafter nudged toward known greedy continuations, one per row (`references`, unpadded), so accepted
    paths run deep, through first and second siblings, and rows accept different numbers of tokens per round. A row
    is recognised by its anchor token at its position."""

    references: list[list[int]] = []

    def forward(self, anchor_ids, anchor_positions, **kwargs):
        out = super().forward(anchor_ids, anchor_positions, **kwargs)
        if kwargs.get("context_cache") is None:
            return out
        logits = out.depth_logits.clone()
        for b in range(logits.shape[0]):
            start, anchor = int(anchor_positions[b, 0]), int(anchor_ids[b, 0])
            reference = next((r for r in self.references if len(r) > start and r[start] == anchor), None)
            if reference is None:
                continue
            for k in range(logits.shape[1]):
                t = start + k + 1
                if t >= len(reference):
                    break
                row = logits[b, k]
                top = row.max()
                rank = (start * 7 + k * 3 + b) % 4
                if rank in (0, 1):
                    row[reference[t]] = top + 30.0
                elif rank == 2:
                    row[reference[t]] = top - 1e-3  # second choice
        out.depth_logits = logits
        return out


def batch_oracle(target, reference: torch.Tensor, mask: torch.Tensor, **overrides) -> BatchOracle:
    base = make_drafter(target, **overrides)
    oracle = BatchOracle(base.config)
    oracle.load_state_dict(base.state_dict())
    with torch.no_grad():
        oracle.markov_head.markov_w2.weight.zero_()
    pads = (mask == 0).sum(dim=1).tolist()
    oracle.references = [row[pad:].tolist() for row, pad in zip(reference, pads, strict=True)]
    return oracle.to(target.dtype).eval()


def padded_batch(lengths: list[int], seed: int = 0, repeat_rows: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """Left-padded random prompts of the given lengths (pad id 0); `repeat_rows` repeat a short motif, so their
    lookup branches match strongly (lookup-only rounds) while the other rows' do not."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        row = torch.randint(4, VOCAB, (length,), generator=gen)
        if i in repeat_rows:
            row = torch.randint(4, VOCAB, (5,), generator=gen).repeat(length // 5 + 1)[:length]
        ids[i, width - length:], mask[i, width - length:] = row, 1
    return ids, mask


def eos_forcing_target(arch: str, attn: str, seed: int = 0):
    """A tiny target whose greedy text meets EOS now and then, so rows end in different rounds."""
    target = make_target(arch, attn, seed=seed)
    with torch.no_grad():
        weight = target.get_output_embeddings().weight
        weight[EOS] = weight[77] * 1.1  # EOS wins wherever token 77 would (found by trying: 77 is frequent)
    return target


LENGTHS = {1: [7], 2: [5, 12], 3: [1, 9, 4], 5: [3, 14, 1, 8, 6], 8: [2, 11, 5, 1, 16, 7, 9, 3]}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_batches_equal_plain_batched_generate(arch, attn, monkeypatch):
    """B = 1..8, prompts of different lengths (one of a single token), rows that meet EOS in different rounds,
    lookup-only rounds in some rows and not others, compaction of the ragged cache: all exact in float32."""
    monkeypatch.setattr(batch, "COMPACT_MIN", 8)  # compact often
    target = eos_forcing_target(arch, attn)
    for size, lengths in LENGTHS.items():
        ids, mask = padded_batch(lengths, seed=size, repeat_rows=(1, 3))
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
        for drafter, knobs in ((make_drafter(target), {}), (batch_oracle(target, ref, mask), {"tree_budget": 6}),
                               (make_drafter(target), {"tree_budget": 3, "tree_lookup": 0})):
            out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                                  max_new_tokens=24, pad_token_id=0, **knobs)
            assert torch.equal(out, ref), (arch, attn, size, knobs, type(drafter).__name__)


def test_a_batch_records_rounds_per_row_and_pads_finished_rows_as_plain_generate():
    target = eos_forcing_target("llama", "sdpa")
    for seed in range(20):  # a batch in which some rows end early and others do not
        ids, mask = padded_batch([6, 3, 10, 1], seed=seed, repeat_rows=(2,))
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=0)
        ends = [bool((row[ids.shape[1]:] == EOS).any()) for row in ref]
        if any(ends) and not all(ends):
            break
    else:
        pytest.fail("no batch with rows that end early and rows that do not")
    oracle = batch_oracle(target, ref, mask)
    out = target.generate(ids, attention_mask=mask, assistant_model=oracle, do_sample=False, max_new_tokens=40,
                          pad_token_id=0, return_dict_in_generate=True, tree_budget=6)
    assert torch.equal(out.sequences, ref)
    assert len(out.rounds) == 4 and len(out.acceptance_length) == 4
    for i, rounds in enumerate(out.rounds):
        committed = [t for r in rounds for t in r.committed]
        new = ref[i, ids.shape[1]:].tolist()
        end = new.index(EOS) + 1 if EOS in new else len(new)
        assert committed == new[1:end]  # the first token comes from the prefill
        assert out.acceptance_length[i] == pytest.approx(len(committed) / len(rounds))
    assert max(max(r.num_accepted for r in rounds) for rounds in out.rounds) >= 3  # deep paths were accepted
    assert out.tree_budget == 6


def test_one_target_forward_per_round_for_the_whole_batch():
    target = make_target("llama", "sdpa")
    ids, mask = padded_batch([4, 9, 2], seed=3, repeat_rows=(0,))
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                              with_kwargs=True)
    out = target.generate(ids, attention_mask=mask, assistant_model=make_drafter(target), do_sample=False,
                          max_new_tokens=20, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    handle.remove()
    assert calls[0] == (3, 9)  # the prefill
    rounds = max(len(r) for r in out.rounds)
    assert len(calls) == 1 + rounds  # one forward per round, every unfinished row in it, finished rows not
    assert [shape[0] for shape in calls[1:]] == [sum(len(r) > k for r in out.rounds) for k in range(rounds)]
    assert calls[-1][0] < 3  # rows advance at their own pace: some reached max_new_tokens first


def test_sampling_a_batch_keeps_each_rows_target_distribution():
    """The 3rd sampled token of each row of a batch (one row left-padded) follows the target's exact law."""
    temperature = 1.0
    target = make_target("llama", seed=3)
    ids, mask = padded_batch([3, 5], seed=13)
    vocab = target.config.vocab_size
    marginals = []
    with torch.no_grad():
        for row in range(2):
            prefix = ids[row:row + 1, (mask[row] == 0).sum():]
            p1 = torch.softmax(target(prefix).logits[0, -1] / temperature, -1)
            seq2 = torch.cat([prefix.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
            p2 = torch.softmax(target(seq2).logits[:, -1] / temperature, -1)
            seq3 = torch.cat([seq2.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], 1)
            p3 = torch.softmax(target(seq3).logits[:, -1] / temperature, -1).view(vocab, vocab, vocab)
            marginals.append(((p1[:, None] * p2)[:, :, None] * p3).sum((0, 1)))
    drafter = make_drafter(target, tree_topk=vocab, tree_frontier=1, tree_budget=2 * vocab, tree_lookup=0)
    torch.manual_seed(0)
    draws = 400
    counts = torch.zeros(2, vocab)
    for _ in range(draws):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True,
                              temperature=temperature, top_k=0, max_new_tokens=3, eos_token_id=None, pad_token_id=0,
                              tree_depth=2)
        for row in range(2):
            counts[row, out[row, -1]] += 1
    for row in range(2):
        ok, stat = chi_square_ok(counts[row], marginals[row])
        assert ok, (row, stat)
    assert not chi_square_ok(torch.eye(vocab)[marginals[0].argmax()] * draws, marginals[0])[0]  # the test has power


class _Streamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize("bad, message", [
    (lambda ids, mask: {"attention_mask": torch.cat([mask[:, 1:], mask[:, :1]], 1)}, "right-padded"),
    (lambda ids, mask: {"attention_mask": mask[:, 1:]}, "shape"),
    (lambda ids, mask: {"attention_mask": mask * 2}, "other than 0 and 1"),
    (lambda ids, mask: {"attention_mask": torch.cat([torch.zeros_like(mask[:1]), mask[1:]])}, "all padding"),
    (lambda ids, mask: {"streamer": _Streamer()}, "streamer"),
    (lambda ids, mask: {"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
])
def test_bad_batches_are_refused_with_a_message(bad, message):
    target = make_target("llama", "sdpa")
    ids, mask = padded_batch([4, 6], seed=1)
    kwargs = {"attention_mask": mask, **bad(ids, mask)}
    with pytest.raises(ValueError, match=message):
        target.generate(ids, assistant_model=make_drafter(target), max_new_tokens=4, pad_token_id=0, **kwargs)


def test_float_token_ids_are_refused_by_name():
    target = make_target("llama", "sdpa")
    ids, mask = padded_batch([4, 6], seed=1)
    from hf_treespark.decoding.generation_checks import check_supported

    with pytest.raises(ValueError, match="dtype"):
        check_supported(target, make_drafter(target), ids.float(), target.generation_config)


def test_right_aligned_moves_each_rows_valid_entries_to_the_right_in_order():
    valid = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    index, kept = right_aligned(valid)
    assert kept.tolist() == [[False, False, True, True, True], [False] * 4 + [True], [True] * 5]
    assert index[0, 2:].tolist() == [0, 2, 3] and index[1, 4:].tolist() == [3] and index[2].tolist() == [0, 1, 2, 3, 4]


def test_the_auto_budget_shrinks_with_the_batch_and_falls_back_to_plain_steps(monkeypatch):
    target = make_target("llama", "sdpa")
    drafter = make_drafter(target, tree_budget="auto")
    drafter.config.acceptance_profile = {"2": 1.5, "4": 1.7, "8": 1.8}
    monkeypatch.setattr(budget, "measured_latency", lambda *a, **k: None)  # no measurement: the defaults
    def costs(total: dict[int, float], draft: float) -> dict:
        return {"verify": {n: c - draft for n, c in total.items()}, "draft": {n: draft for n in total}}

    monkeypatch.setattr(budget, "DEFAULT_CPU_BATCH_ROUND_COST", {"float32": {
        1: costs({2: 1.2, 4: 1.3, 8: 1.7}, 0.2), 2: costs({2: 1.2, 4: 1.4, 8: 2.0}, 0.25),
        4: costs({2: 1.3, 4: 1.9, 8: 2.8}, 0.3), 8: costs({2: 1.9, 4: 2.6, 8: 4.0}, 0.4),
        16: costs({2: 2.5, 4: 3.5, 8: 5.0}, 0.5)}})
    policy = budget.TreePolicy.from_config(drafter.config)
    chooser = budget.BatchBudget(target, drafter, policy)
    chosen = {b: chooser(b) for b in (1, 2, 3, 4, 8, 16)}
    assert chosen == {1: 4, 2: 2, 3: 2, 4: 2, 8: 0, 16: 0}  # 4 rows: 1.15x predicted; 8: 0.79x
    monkeypatch.setattr(budget, "BATCH_TREE_MARGIN", 1.2)
    assert budget.BatchBudget(target, drafter, policy)(4) == 0  # a tree must beat plain steps by the margin
    # the batch's drafter gate: the pass in plain steps of the batch, at the nearest budget
    assert chooser.gate_threshold(4, 2) == pytest.approx(0.3) and chooser.gate_threshold(16, 3) == pytest.approx(0.5)
    # and decoding with it stays exact; a batch where no tree pays is decoded by transformers' own loop
    ids, mask = padded_batch([3, 8, 5, 2, 6, 1, 4, 7, 9], seed=5)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=12,
                          pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.tree_budget == 0 and out.rounds == [[]] * 9 and out.acceptance_length == [1.0] * 9


def test_the_auto_budget_learns_from_what_the_rows_accept(monkeypatch):
    target = make_target("llama", "sdpa")
    drafter = make_drafter(target, tree_budget="auto")
    drafter.config.batch_acceptance_profile = {"2": 1.95, "4": 2.2, "8": 2.4}
    monkeypatch.setattr(budget, "measured_latency", lambda *a, **k: None)  # no measurement: the defaults
    monkeypatch.setattr(budget, "DEFAULT_CPU_BATCH_ROUND_COST", {"float32": {
        b: {"verify": {2: 1.4, 4: 1.55, 8: 2.5}, "draft": {2: 0.3, 4: 0.4, 8: 0.6}} for b in (1, 2, 4, 8, 16)}})
    policy = budget.TreePolicy.from_config(drafter.config)
    chooser = budget.BatchBudget(target, drafter, policy)
    assert chooser(8) == 2 and chooser.scale == 1.0  # the profile's 1.95 tokens at 1.7 steps: 1.15x predicted
    chooser.observe(2, [2, 2, 1, 2])  # rows accepting 1.75 tokens: not yet enough evidence against the profile
    assert chooser(8) == 2 and chooser.scale == pytest.approx((3 + 16 * 0.95) / (3.8 + 16 * 0.95))
    for _ in range(4):
        chooser.observe(2, [1, 2, 1, 1])  # 1.25 tokens per row and round: the tree costs more than it gives
    assert chooser(8) == 0 and chooser.scale < 0.7
    chooser.observe(0, [1, 1, 1, 1])  # plain steps tell nothing
    assert chooser.row_rounds == 20
    rich = budget.BatchBudget(target, drafter, policy)
    for _ in range(8):
        rich.observe(2, [3, 3, 3, 3])  # rows accepting more than the profile: a deeper tree pays
    assert rich(8) == 4 and rich.scale > 1.5
    fixed = budget.BatchBudget(target, drafter, budget.TreePolicy.from_config(drafter.config).with_budget(2))
    fixed.observe(2, [1, 1])
    assert fixed.row_rounds == 0 and fixed(8) == 2  # a fixed budget stays as given
    # decoding: a random drafter's rows accept about one token a round, so the batch turns to plain steps within a
    # few rounds of the profile's tree, and stays exact
    ids, mask = padded_batch([3, 8, 5, 2, 6, 1, 4, 7], seed=6)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=24,
                          pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.tree_budget == 2
    sizes = [r.tree_size for r in out.rounds[0]]
    assert sizes[0] > 0 and sizes[-1] == 0  # trees first, then plain steps (transformers' loop, from this cache)
    assert [sum(len(r.committed) for r in rounds) for rounds in out.rounds] == [23] * 8  # after the prefill's
    for eos in {int(ref[0, 20]), int(ref[5, 14]), int(ref[2, 26])}:  # rows ending at different steps, after it
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0,
                              eos_token_id=eos)
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=24,
                              pad_token_id=0, eos_token_id=eos)
        assert torch.equal(out, ref), eos


def test_calibrating_batched_acceptance_counts_tokens_per_row_and_round():
    target = make_target("llama", "sdpa")
    ref_ids, ref_mask = padded_batch([5, 9, 3], seed=11, repeat_rows=(1,))
    prompts = [{"input_ids": row[mask.bool()][None]} for row, mask in zip(ref_ids, ref_mask, strict=True)]
    reference = target.generate(ref_ids, attention_mask=ref_mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    oracle = batch_oracle(target, reference, ref_mask)
    profile = measuring.calibrate_batch_acceptance(target, oracle, prompts, budgets=(2, 4), batch=2, max_new_tokens=16,
                                                progress=False)
    assert set(profile) == {"2", "4"}
    assert all(1.0 <= tau <= 5.0 for tau in profile.values())  # at most N accepted nodes and the bonus per round
    assert profile["4"] > 1.5  # the oracle's deep paths are accepted up to the budget


def test_batch_size_options_are_checked():
    from hf_treespark.arg_types import batch_sizes_option

    assert batch_sizes_option("1, 2,16") == [1, 2, 16]
    for bad in ("", "0", "2,x", "-4"):
        with pytest.raises(ValueError, match="--batch-size"):
            batch_sizes_option(bad)


@pytest.mark.parametrize("sizes", [[5, 12], [1, 9, 4]])
@pytest.mark.parametrize("ending", ["max_new_tokens=1", "first token an EOS"])
def test_a_batch_whose_rows_all_end_at_their_first_token_returns_what_plain_generate_returns(sizes, ending):
    target = make_target("llama", "sdpa")
    ids, mask = padded_batch(sizes, seed=7)
    if ending == "max_new_tokens=1":
        knobs = {"max_new_tokens": 1}
    else:  # every row's greedy first token is an end-of-sequence token
        first = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=1, pad_token_id=0)
        knobs = {"max_new_tokens": 8, "eos_token_id": sorted(set(first[:, -1].tolist()))}
    ref = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **knobs)
    assert ref.shape[1] == ids.shape[1] + 1
    out = target.generate(ids, attention_mask=mask, assistant_model=make_drafter(target), do_sample=False,
                          pad_token_id=0, return_dict_in_generate=True, **knobs)
    assert torch.equal(out.sequences, ref)
    assert out.rounds == [[]] * len(sizes) and out.acceptance_length == [0.0] * len(sizes)
    depth = budget.TreePolicy.from_config(make_drafter(target).config).depth
    assert out.acceptance_by_depth == [[0.0] * depth] * len(sizes)
    assert out.tree_budget == 12
    plain = target.generate(ids, attention_mask=mask, assistant_model=make_drafter(target), do_sample=False,
                            pad_token_id=0, **knobs)
    assert torch.equal(plain, ref)
