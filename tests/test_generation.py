"""TreeSpark decoding inside `target.generate(assistant_model=drafter)`: lossless, one forward per round."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, make_drafter, make_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper
from transformers.generation.streamers import BaseStreamer

import hf_treespark
from hf_treespark import TreeSparkDrafter
from hf_treespark.core.exactness import check_greedy_equivalence
from hf_treespark.core.tree import DraftTree, TreePolicy, build_tree
from hf_treespark.core.verify import (
    commit_cache,
    greedy_accept,
    processed_accept,
    tree_attention_mask,
    tree_position_ids,
)
from hf_treespark.decoding.controller import resolve_gate
from hf_treespark.decoding.generation import TreeSparkCandidateGenerator


class OracleDrafter(TreeSparkDrafter):
    """The real drafter, with its depth logits nudged toward a known greedy continuation.

    The reference token is made the drafter's first choice at some depths and its second choice
    at others, so accepted paths run deep and often through non-first siblings, i.e. entries that
    are not contiguous in the verified chunk. The target and the verifier are untouched.
    """

    reference: list[int] = []

    def forward(self, anchor_ids, anchor_positions, **kwargs):
        out = super().forward(anchor_ids, anchor_positions, **kwargs)
        if kwargs.get("context_cache") is None:
            return out
        logits = out.depth_logits.clone()
        start = int(anchor_positions[0, 0])
        for k in range(logits.shape[1]):
            t = start + k + 1
            if t >= len(self.reference):
                break
            row = logits[0, k]
            top2 = row.topk(2).values
            rank = (start * 7 + k * 3) % 4  # deterministic mix of first / second / absent
            if rank in (0, 1):
                row[self.reference[t]] = top2[0] + 30.0
            elif rank == 2:
                row[self.reference[t]] = top2[0] - 1e-3  # second choice
        out.depth_logits = logits
        return out


def make_oracle(target, reference: torch.Tensor, **overrides) -> OracleDrafter:
    base = make_drafter(target, **overrides)
    oracle = OracleDrafter(base.config)
    oracle.load_state_dict(base.state_dict())
    with torch.no_grad():
        oracle.markov_head.markov_w2.weight.zero_()
    oracle.reference = reference[0].tolist()
    return oracle.to(target.dtype).eval()


def prompt(seed: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (1, length), generator=gen)


TREE_SHAPES = [
    {},
    {"tree_chain": True},
    {"tree_budget": 1},
    {"tree_topk": 2, "tree_frontier": 3, "tree_budget": 20},
    {"tree_depth": 3, "tree_budget": 6},
    {"tree_budget": "auto"},
]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_fp32_equals_plain_generate(arch, attn):
    target = make_target(arch, attn)
    drafter = make_drafter(target)
    for seed, (length, new) in enumerate([(5, 30), (17, 25), (40, 12)]):
        ids = prompt(seed, length)
        ref = target.generate(ids, do_sample=False, max_new_tokens=new)
        oracle = make_oracle(target, ref)
        for shape in TREE_SHAPES:
            for d in (drafter, oracle):
                out = target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=new, **shape)
                assert torch.equal(out, ref), (arch, attn, seed, shape, type(d).__name__)


def test_oracle_trees_accept_deep_and_non_contiguous_paths(llama_pair):
    target, _ = llama_pair
    ids = prompt(3, 9)
    ref = target.generate(ids, do_sample=False, max_new_tokens=40)
    oracle = make_oracle(target, ref, tree_budget=16)
    out = target.generate(ids, assistant_model=oracle, do_sample=False, max_new_tokens=40,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.acceptance_length > 2.0
    assert all(len(r.accepted_path) == r.num_accepted and min(r.accepted_path, default=1) >= 1 for r in out.rounds)
    non_contiguous = [r for r in out.rounds if r.accepted_path != list(range(1, len(r.accepted_path) + 1))]
    assert non_contiguous, "no round accepted a path through non-adjacent chunk entries"


@pytest.mark.parametrize("new_tokens", range(1, 13))
def test_max_new_tokens_mid_round(llama_pair, new_tokens):
    target, _ = llama_pair
    ids = prompt(4, 6)
    ref_long = target.generate(ids, do_sample=False, max_new_tokens=20)
    oracle = make_oracle(target, ref_long)
    ref = target.generate(ids, do_sample=False, max_new_tokens=new_tokens)
    out = target.generate(ids, assistant_model=oracle, do_sample=False, max_new_tokens=new_tokens)
    assert torch.equal(out, ref)
    out = target.generate(ids, assistant_model=oracle, do_sample=False, max_length=ids.shape[1] + new_tokens)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("eos_offset", [3, 7, 11])
def test_eos_mid_round_stops_where_plain_decoding_stops(llama_pair, eos_offset):
    target, _ = llama_pair
    ids = prompt(5, 8)
    free = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + eos_offset])
    oracle = make_oracle(target, free)
    for eos_ids in (eos, [VOCAB - 1, eos]):
        ref = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=eos_ids)
        out = target.generate(ids, assistant_model=oracle, do_sample=False, max_new_tokens=24, eos_token_id=eos_ids)
        assert torch.equal(out, ref)
        assert int(out[0, -1]) == eos


def test_stopping_criteria_and_attention_mask(llama_pair):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfterToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    target, _ = llama_pair
    ids = prompt(6, 7)
    free = target.generate(ids, do_sample=False, max_new_tokens=20)
    oracle = make_oracle(target, free)
    stop = StoppingCriteriaList([StopAfterToken(int(free[0, ids.shape[1] + 5]))])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                          stopping_criteria=stop)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=oracle, do_sample=False,
                          max_new_tokens=20, stopping_criteria=stop)
    assert torch.equal(out, ref)
    assert out.shape[1] < free.shape[1]


def test_left_padded_prompt(llama_pair):
    target, drafter = llama_pair
    ids = prompt(7, 6)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    ref = target.generate(ids, do_sample=False, max_new_tokens=10)
    out = target.generate(padded, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=10)
    assert torch.equal(out[:, 3:], ref) and torch.equal(out[:, :3], padded[:, :3])


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts, self.shapes, self.ended = [], [], False

    def put(self, value):
        self.puts.append(value.flatten().tolist())
        self.shapes.append(tuple(value.shape))

    def end(self):
        self.ended = True


def test_streamer_sees_one_put_per_round_and_return_dict_has_rounds(llama_pair):
    target, _ = llama_pair
    ids = prompt(8, 5)
    ref = target.generate(ids, do_sample=False, max_new_tokens=30)
    oracle = make_oracle(target, ref)
    streamer = RecordingStreamer()
    out = target.generate(ids, assistant_model=oracle, do_sample=False, max_new_tokens=30, streamer=streamer,
                          return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert torch.equal(out.sequences, ref)
    assert streamer.ended
    assert streamer.puts[0] == ids[0].tolist()  # the prompt first, as plain generate does
    assert len(streamer.puts) == 2 + len(out.rounds)  # prompt, prefill token, one put per round
    assert streamer.puts[2:] == [r.committed for r in out.rounds]
    assert all(len(shape) == 2 and shape[0] == 1 for shape in streamer.shapes)  # [1, n], as transformers sends
    assert sum(len(p) for p in streamer.puts[1:]) == ref.shape[1] - ids.shape[1]
    assert out.acceptance_length == pytest.approx(sum(len(r.committed) for r in out.rounds) / len(out.rounds))
    assert len(out.scores) == len(out.logits) == ref.shape[1] - ids.shape[1]
    plain = target.generate(ids, do_sample=False, max_new_tokens=30, return_dict_in_generate=True,
                            output_scores=True)
    for ours, theirs in zip(out.scores, plain.scores, strict=True):
        assert ours.argmax() == theirs.argmax()
    assert all(r.tree_size == oracle.config.tree_budget for r in out.rounds)
    assert out.acceptance_by_depth[0] >= out.acceptance_by_depth[-1]


def test_one_target_forward_per_round(llama_pair):
    target, _ = llama_pair
    ids = prompt(9, 6)
    ref = target.generate(ids, do_sample=False, max_new_tokens=25)
    oracle = make_oracle(target, ref)
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        out = target.generate(ids, assistant_model=oracle, do_sample=False, max_new_tokens=25,
                              return_dict_in_generate=True)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, ref)
    assert len(calls) == 1 + len(out.rounds)  # the prefill, then exactly one verify forward per round
    assert len(out.rounds) < 24


def test_plain_function_and_other_assistants_are_unaffected(llama_pair):
    target, drafter = llama_pair
    ids = prompt(10, 6)
    ref = target.generate(ids, do_sample=False, max_new_tokens=12)
    assert torch.equal(hf_treespark.generate(target, drafter, ids, do_sample=False, max_new_tokens=12), ref)
    assistant = make_target("llama", seed=5, layers=1)
    assisted = target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=12)
    assert torch.equal(assisted, ref)
    lookup = target.generate(ids, prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=12)
    assert torch.equal(lookup, ref)
    with pytest.raises(ValueError, match="TreeSpark assistant_model"):
        target.generate(ids, max_new_tokens=3, tree_budget=4)


def test_repetition_penalty_is_applied_per_path_prefix(llama_pair):
    target, drafter = llama_pair
    ids = prompt(11, 8)
    kwargs = dict(do_sample=False, max_new_tokens=25, repetition_penalty=1.8, no_repeat_ngram_size=3)
    ref = target.generate(ids, **kwargs)
    oracle = make_oracle(target, ref)
    for d in (drafter, oracle):
        assert torch.equal(target.generate(ids, assistant_model=d, **kwargs), ref)


def test_sampling_with_top_k_1_is_greedy(llama_pair):
    target, drafter = llama_pair
    ids = prompt(12, 5)
    ref = target.generate(ids, do_sample=False, max_new_tokens=15)
    out = target.generate(ids, assistant_model=drafter, do_sample=True, top_k=1, max_new_tokens=15)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampling_walk_matches_token_by_token_target_distribution(temperature):
    """Fixed tree, fixed target distributions: the first two committed tokens follow the target exactly."""
    vocab = 6
    gen = torch.Generator().manual_seed(1)
    depth_logits = torch.randn(1, 3, vocab, generator=gen)
    tree = build_tree(depth_logits, lambda t: torch.zeros(*t.shape, vocab), torch.tensor([0]),
                      TreePolicy(topk=3, frontier=2, budget=8, depth=3))
    logits = torch.randn(1, tree.num_nodes + 1, vocab, generator=gen) * 1.5
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    # exact law of (t1, t2): t1 from the root's row; t2 from t1's node row when the tree holds t1
    p_root = torch.softmax(logits[0, 0] / temperature, -1)
    children = {int(tree.tokens[0, i]): i for i in range(1, tree.num_nodes + 1) if tree.parents[0, i] == 0}
    torch.manual_seed(0)
    draws = 20_000
    first, pairs = torch.zeros(vocab), torch.zeros(vocab, vocab)
    for _ in range(draws):
        acc = processed_accept(tree, logits, torch.tensor([[0]]), processors, do_sample=True)
        t1 = int(acc.tokens[0, 0])
        first[t1] += 1
        assert (t1 in children) == (int(acc.num_accepted[0]) >= 1)
        if t1 in children:
            pairs[t1, int(acc.tokens[0, 1])] += 1
    assert chi_square_ok(first, p_root)[0]
    tested = 0
    for token, node in children.items():
        if pairs[token].sum() >= 500:
            assert chi_square_ok(pairs[token], torch.softmax(logits[0, node] / temperature, -1))[0]
            tested += 1
    assert tested >= 1


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[bool, float]:
    """Pearson chi-square of `counts` against `probs` (rare outcomes pooled).

    Passes when the Wilson-Hilferty normal approximation of the statistic is below z = 4 (p ~ 3e-5).
    """
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    df = max(len(obs) - 1, 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / (2 / (9 * df)) ** 0.5
    return z < 4.0, stat


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_end_to_end_sampling_matches_the_target_distribution(temperature):
    """2nd and 3rd sampled tokens through generate(assistant_model=...) follow the exact target law."""
    target = make_target("llama", seed=3)
    ids = prompt(13, 4)
    vocab = target.config.vocab_size
    with torch.no_grad():  # exact p(t1, t2, t3) by enumeration
        p1 = torch.softmax(target(ids).logits[0, -1] / temperature, -1)
        seq2 = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2 = torch.softmax(target(seq2).logits[:, -1] / temperature, -1)  # [t1, t2]
        joint12 = p1[:, None] * p2
        seq3 = torch.cat([seq2.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], 1)
        p3 = torch.softmax(target(seq3).logits[:, -1] / temperature, -1).view(vocab, vocab, vocab)
        marg2 = joint12.sum(0)
        marg3 = (joint12[:, :, None] * p3).sum((0, 1))
    # every token is a child of the root: the second token is always drawn inside the tree
    drafter = make_drafter(target, tree_topk=vocab, tree_frontier=1, tree_budget=2 * vocab)
    torch.manual_seed(0)
    counts = torch.zeros(2, vocab)
    deep_rounds = 0
    draws = 600
    for _ in range(draws):
        out = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=temperature, top_k=0,
                              max_new_tokens=3, eos_token_id=None, return_dict_in_generate=True, tree_depth=2)
        counts[0, out.sequences[0, -2]] += 1
        counts[1, out.sequences[0, -1]] += 1
        deep_rounds += out.rounds[0].num_accepted >= 1
    assert deep_rounds == draws
    for row, probs in ((counts[0], marg2), (counts[1], marg3)):
        ok, stat = chi_square_ok(row, probs)
        assert ok, stat
    # and the test has power: the drafter's own proposal law is rejected
    biased = torch.zeros(vocab)
    biased[marg3.argmax()] = draws
    assert not chi_square_ok(biased, marg3)[0]


def test_bf16_divergences_only_at_near_ties():
    target = make_target("qwen3", "sdpa", dtype=torch.bfloat16)
    drafter = make_drafter(target)
    for seed in range(3):
        ids = prompt(20 + seed, 10)
        ref = target.generate(ids, do_sample=False, max_new_tokens=20)
        oracle = make_oracle(target, ref)
        for d in (drafter, oracle):
            out = target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=20)
            report = check_greedy_equivalence(target, ref, out)
            assert report.ok, str(report)


def test_equivalence_check_flags_a_real_divergence(llama_pair):
    target, _ = llama_pair
    ids = prompt(21, 6)
    ref = target.generate(ids, do_sample=False, max_new_tokens=8)
    logits = target(ref[:, :-4]).logits[0, -1]
    wrong = ref.clone()
    wrong[0, -4] = int(logits.argmin())
    report = check_greedy_equivalence(target, ref, wrong)
    assert not report.ok and report.position == ref.shape[1] - 4
    assert check_greedy_equivalence(target, ref, ref).ok


def test_candidate_generator_in_a_hand_written_loop(llama_pair):
    """TreeSparkCandidateGenerator + the verify functions reproduce plain greedy in a custom loop."""
    from transformers import DynamicCache

    target, drafter = llama_pair
    ids = prompt(14, 6)
    ref = target.generate(ids, do_sample=False, max_new_tokens=15)
    gen = TreeSparkCandidateGenerator(drafter, target)
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    cache = DynamicCache(config=target.config)
    out = target(ids, cache=cache, output_hidden_states=True)
    gen.add_context(torch.cat([out.hidden_states[i] for i in layers], -1))
    seq = torch.cat([ids, out.logits[:, -1:].argmax(-1)], 1)
    while seq.shape[1] < ref.shape[1]:
        past = seq.shape[1] - 1
        candidates, _ = gen.get_candidates(seq)
        tree = gen.tree
        assert torch.equal(candidates[:, seq.shape[1]:], tree.tokens[:, 1:])
        out = target(tree.tokens, position_ids=tree_position_ids(tree.depths, past),
                     attention_mask=tree_attention_mask(tree.ancestors, past, target.dtype), cache=cache,
                     output_hidden_states=True)
        acc = greedy_accept(tree, out.logits)
        keep = acc.path[:, : int(acc.num_accepted[0]) + 1]
        commit_cache(cache, past, keep)
        feats = torch.cat([out.hidden_states[i] for i in layers], -1)
        gen.add_context(feats[:, keep[0]])
        seq = torch.cat([seq, acc.tokens[:, : keep.shape[1]]], 1)
    assert torch.equal(seq[:, : ref.shape[1]], ref)


def test_refusals_are_clear(llama_pair):
    target, drafter = llama_pair
    ids = prompt(15, 5)
    with pytest.raises(ValueError, match="streaming needs batch size 1"):
        target.generate(ids.repeat(2, 1), assistant_model=drafter, max_new_tokens=3, streamer=RecordingStreamer())
    with pytest.raises(ValueError, match="beam search"):
        target.generate(ids, assistant_model=drafter, num_beams=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(ids, assistant_model=drafter, do_sample=True, num_return_sequences=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="depth"):
        target.generate(ids, assistant_model=drafter, tree_depth=99, max_new_tokens=3)
    for bad in (-1, "often", True, float("nan")):
        with pytest.raises(ValueError, match="tree_gate"):
            target.generate(ids, assistant_model=drafter, tree_lookup=3, tree_gate=bad, max_new_tokens=3)
    other = make_target("llama", layers=3)
    with pytest.raises(ValueError, match="layers"):
        target_other = other
        target_other.generate(ids, assistant_model=drafter, max_new_tokens=3)
    flash = make_target("llama")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="4D tree attention mask"):
        hf_treespark.decoding.generation_checks.check_supported(flash, drafter, ids, flash.generation_config)


def test_unsupported_outputs_and_inputs_embeds_are_refused_by_name(llama_pair):
    target, drafter = llama_pair
    ids = prompt(16, 5)
    for flag, what in [("output_attentions", "attentions"), ("output_hidden_states", "hidden states")]:
        with pytest.raises(ValueError, match=f"does not return {what} \\({flag}=True\\)"):
            target.generate(ids, assistant_model=drafter, max_new_tokens=3, return_dict_in_generate=True,
                            **{flag: True})
    embeds = target.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match="does not take inputs_embeds: .* Pass input_ids"):
        target.generate(inputs_embeds=embeds, assistant_model=drafter, max_new_tokens=3)
    with pytest.raises(ValueError, match="does not take inputs_embeds"):  # not silently read from input_ids
        target.generate(ids, inputs_embeds=embeds, assistant_model=drafter, max_new_tokens=3)


@pytest.mark.parametrize("max_new_tokens", [1, 7, 12])
def test_the_output_carries_the_targets_cache_of_the_committed_text(llama_pair, max_new_tokens):
    """As plain decoding: `out.cache` (`past_key_values`) holds every token but the last, so generation can go on
    from it; a round cut short by the length limit leaves no extra entries."""
    target, _ = llama_pair
    ids = prompt(17, 6)
    oracle = make_oracle(target, target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None))
    out = target.generate(ids, assistant_model=oracle, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=None, return_dict_in_generate=True)
    assert max_new_tokens == 1 or max(r.num_accepted for r in out.rounds) > 1  # deep rounds, the last one cut
    plain = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                            return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.cache.get_seq_length() == plain.cache.get_seq_length() == out.sequences.shape[1] - 1
    for ours, theirs in zip(out.cache.layers, plain.cache.layers, strict=True):
        assert torch.allclose(ours.keys, theirs.keys, atol=1e-5)
        assert torch.allclose(ours.values, theirs.values, atol=1e-5)
    more = target.generate(out.sequences, cache=out.cache, do_sample=False, max_new_tokens=4,
                           eos_token_id=None)
    assert torch.equal(more, target.generate(out.sequences, do_sample=False, max_new_tokens=4, eos_token_id=None))


def test_binding_a_fresh_drafter_draws_no_random_numbers():
    """The first generate() with a drafter binds it to the target (building its draft-vocabulary LM head): a seeded
    sampled call must give what it gives with an already-bound drafter, and greedy decoding draws nothing."""
    target = make_target("llama")
    ids = prompt(18, 5)

    def sampled(drafter):
        torch.manual_seed(7)
        return target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=16, eos_token_id=None)

    bound = make_drafter(target).restrict_vocabulary(list(range(4, VOCAB)))
    reference = sampled(bound)
    assert torch.equal(sampled(bound), reference)
    fresh = make_drafter(target).restrict_vocabulary(list(range(4, VOCAB)))
    assert not fresh.is_bound
    assert torch.equal(sampled(fresh), reference)
    another = make_drafter(target).restrict_vocabulary(list(range(4, VOCAB)))
    state = torch.random.get_rng_state()
    target.generate(ids, assistant_model=another, do_sample=False, max_new_tokens=8)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("gate", [0.5, 1, np.float32(0.5), np.float64(0.5), np.int64(2), torch.tensor(0.5),
                                  torch.tensor(2), torch.tensor(0.5, dtype=torch.bfloat16)])
def test_tree_gate_takes_python_numpy_and_0d_torch_numbers(gate):
    """The gate's threshold takes the number types the other knobs take (np.float32 and 0-d tensors were refused)."""
    assert resolve_gate(None, None, TreePolicy(), gate) == pytest.approx(float(gate))


@pytest.mark.parametrize("gate", [True, np.bool_(True), torch.tensor(True), -1, np.float32(-0.5), float("nan"),
                                  np.float32("nan"), torch.tensor(float("nan")), "often", "0.5", None, 1 + 0j,
                                  torch.tensor([0.5]), torch.tensor([0.5, 1.0]), np.array([0.5])])
def test_tree_gate_refuses_what_is_not_one_number_at_least_zero(gate):
    with pytest.raises(ValueError, match=r"tree_gate=.* is invalid"):
        resolve_gate(None, None, TreePolicy(), gate)


@pytest.mark.slow
def test_offline_default_target_with_untrained_drafter():
    from hf_treespark import TreeSparkConfig
    from hf_treespark.hub import assets

    target, tokenizer = assets.load_default_target(dtype=torch.float32)
    torch.manual_seed(0)
    drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, mask_token_id=16, num_hidden_layers=1)).eval()
    for question in assets.mtbench_prompts()[:2]:
        inputs = assets.chat_inputs(tokenizer, question)
        ref = target.generate(**inputs, do_sample=False, max_new_tokens=16)
        out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=16)
        assert torch.equal(out, ref)


def test_greedy_walk_breaks_ties_at_the_first_maximum_as_plain_decoding():
    """The walk's choice after each node is the first maximum of its float32 logits, as plain greedy's argmax:
    in bfloat16, logits tie often, and a walk that broke ties otherwise would commit other tokens."""
    torch.manual_seed(0)
    n, vocab = 4, 5000
    chain = torch.arange(n + 1)[None]
    logits = torch.randn(1, n + 1, vocab).bfloat16()
    top = logits.float().max(dim=-1).values
    for i, tied in enumerate([(7, 3000), (4999, 2), (10, 11), (0, 4999), (123, 456)]):
        for token in tied:  # a tie at the maximum, the later index first in the list
            logits[0, i, token] = top[0, i]
    expected = logits.float().argmax(dim=-1)
    assert expected[0].tolist() == [7, 2, 10, 0, 123]
    tokens = torch.cat([torch.tensor([[5]]), expected[:, :-1]], dim=1)  # each node is its parent's choice
    tree = DraftTree(tokens=tokens, parents=chain - 1, depths=chain, scores=torch.zeros(1, n + 1),
                     ancestors=torch.ones(n + 1, n + 1, dtype=torch.bool).tril()[None], candidates=None)
    acceptance = greedy_accept(tree, logits)
    assert int(acceptance.num_accepted[0]) == n
    assert acceptance.tokens[0, : n + 1].tolist() == expected[0].tolist()  # the accepted chain, then the bonus
