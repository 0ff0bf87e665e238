"""Datastore branches (`datastore.py`, SPEC 2d): the index, the retrieved trie, storage, and lossless decoding."""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import VOCAB, make_drafter, make_target
from test_generation import chi_square_ok, make_oracle, prompt
from test_lookup import second_token_marginal

from hf_treespark import TreeSparkConfig, TreeSparkDrafter
from hf_treespark.decoding.generation_checks import resolve_datastore
from hf_treespark.sources import datastore
from hf_treespark.sources.datastore import DATASTORE_FILE, MAX_MATCH, Datastore, DatastoreError


def random_sequences(seed: int, count: int = 30, length: int = 60, vocab: int = 12) -> list[list[int]]:
    """Many repeats in a small vocabulary: suffixes recur with several continuations."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def brute_force(sequences, history) -> tuple[int, Counter]:
    """The longest suffix of `history` (up to MAX_MATCH) occurring in `sequences`, and what followed it."""
    for n in range(min(MAX_MATCH, len(history)), 0, -1):
        suffix = history[-n:]
        follow = Counter()
        for seq in sequences:
            for e in range(n - 1, len(seq)):
                if seq[e - n + 1: e + 1] == suffix:
                    follow[seq[e + 1] if e + 1 < len(seq) else None] += 1
        if follow:
            return n, follow
    return 0, Counter()


def test_the_index_finds_the_longest_suffix_and_what_followed_it():
    sequences = random_sequences(0)
    store = Datastore.build(sequences, 12)
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for _ in range(200):
        history = torch.randint(0, 12, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        n, follow = brute_force(sequences, history)
        found, lo, hi = store.index.match(history)
        assert found == n and hi - lo == sum(follow.values())
        if n >= datastore.MIN_MATCH and hi - lo <= datastore.SAMPLE:
            rows = store.lookup(history)[1]
            got = Counter(int(r[0]) if r[0] != datastore.SEPARATOR else None for r in rows)
            assert got == follow
            checked += 1
    assert checked > 20


def test_branches_are_the_most_probable_paths_parents_first():
    sequences = random_sequences(2, count=60, vocab=8)
    store = Datastore.build(sequences, 8)
    for history in ([1, 2, 3], [5, 5], [0, 7, 1, 2]):
        nodes = store.branches(history, max_nodes=6, min_path_prob=0.02)
        assert len(nodes) <= 6
        path = []
        for i, (parent, token, step) in enumerate(nodes):
            assert -1 <= parent < i and 0 <= token < 8 and step < 0
            path.append(step + (path[parent] if parent >= 0 else 0.0))
            assert path[i] >= math.log(0.02) - 1e-9
        siblings = [(parent, token) for parent, token, _ in nodes]
        assert len(set(siblings)) == len(siblings)  # no duplicate children


def test_the_step_probability_grows_with_the_share_the_context_and_the_evidence():
    p = lambda count, parent, context: math.exp(datastore.step_log_prob(count, parent, context))  # noqa: E731
    assert 0 < p(1, 10, 2) < p(5, 10, 2) < p(10, 10, 2) < 1
    assert p(5, 10, 2) < p(5, 10, 6)
    assert p(4, 4, 3) < p(40, 40, 3)


def test_a_datastore_round_trips_through_its_file_and_is_small(tmp_path):
    store = Datastore.build(random_sequences(3), 12)
    path = store.save(tmp_path)
    assert path == tmp_path / DATASTORE_FILE and path.stat().st_size < 12 * 30 * 60
    again = Datastore.load(tmp_path, vocab_size=12)
    for history in ([1, 2], [3, 4, 5], [11, 0, 0, 1]):
        assert again.branches(history) == store.branches(history)
    big = Datastore.build([[70_000, 1, 2, 70_000, 1, 3]], 100_000)  # beyond uint16: stored as int32
    big.save(tmp_path / "big")
    assert Datastore.load(tmp_path / "big", 100_000).lookup([70_000, 1])[0] == 2


def test_a_damaged_or_foreign_datastore_is_refused_naming_the_file(tmp_path):
    path = Datastore.build(random_sequences(4), 12).save(tmp_path)
    with pytest.raises(DatastoreError, match=r"vocabulary of 12 ids, not this target's 128"):
        Datastore.load(path, vocab_size=128)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatastoreError, match=f"{path}.*damaged"):
        Datastore.load(path, vocab_size=12)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(DatastoreError, match=f"{path}.*damaged"):
        Datastore.load(path)
    from safetensors.numpy import save_file

    save_file({"weights": np.zeros(3, np.float32)}, str(path))
    with pytest.raises(DatastoreError, match="not an hf_treespark datastore"):
        Datastore.load(path)
    store = Datastore.build(random_sequences(4), 12)
    store.index.positions = store.index.positions[::-1].copy()  # edited: no longer sorted
    store.save(tmp_path)
    with pytest.raises(DatastoreError, match="not sorted"):
        Datastore.load(tmp_path, 12)
    with pytest.raises(DatastoreError, match="no datastore at"):
        Datastore.load(tmp_path / "nowhere")


def test_building_refuses_ids_outside_the_vocabulary_and_empty_data():
    with pytest.raises(DatastoreError, match="token id 12"):
        Datastore.build([[1, 2, 12]], 12)
    with pytest.raises(DatastoreError, match="no tokens"):
        Datastore.build([[], []], 12)


def own_store(target, ids: torch.Tensor, new: int, noise_seed: int = 5) -> Datastore:
    """A store holding the target's own greedy continuation of `ids` among noise: retrieved branches that are right,
    wrong, and that duplicate what the drafter or lookup proposes."""
    ref = target.generate(ids, do_sample=False, max_new_tokens=new + 8, eos_token_id=None)
    sequences = random_sequences(noise_seed, count=20, length=40, vocab=VOCAB)
    return Datastore.build([*sequences, ref[0].tolist()], VOCAB)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_with_datastore_branches_equals_plain_generate(arch, attn):
    target = make_target(arch, attn)
    drafter = make_drafter(target)
    retrieved = 0
    for ids, new in ((prompt(1, 9), 25), (prompt(2, 5), 7), (torch.tensor([[5, 6, 7, 5, 6]]), 20)):
        ref = target.generate(ids, do_sample=False, max_new_tokens=new)
        drafter.datastore = own_store(target, ids, new)
        oracle = make_oracle(target, ref)  # drafted candidates that duplicate retrieved ones
        oracle.datastore = drafter.datastore
        for knobs in ({}, {"tree_lookup": 4}, {"tree_lookup": 4, "tree_gate": 0}, {"tree_budget": 2},
                      {"tree_chain": True}):
            for d in (drafter, oracle):
                out = target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=new,
                                      return_dict_in_generate=True, **knobs)
                assert torch.equal(out.sequences, ref), (arch, attn, knobs, type(d).__name__)
                retrieved += sum(r.datastore_accepted for r in out.rounds)
    assert retrieved > 0, "the store holds the continuation: some accepted tokens came from it alone"


@pytest.mark.parametrize("eos_offset", [2, 5])
def test_retrieved_branches_past_an_eos_or_the_length_limit_stop_where_plain_decoding_stops(eos_offset):
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(3, 8)
    free = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None)
    drafter.datastore = Datastore.build([free[0].tolist()] * 3, VOCAB)  # branches run on past the stop
    eos = int(free[0, ids.shape[1] + eos_offset])
    ref = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=eos)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(out, ref)
    for new in (1, 3, 6):
        ref = target.generate(ids, do_sample=False, max_new_tokens=new, eos_token_id=None)
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=new, eos_token_id=None,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)


def test_rounds_record_the_retrieved_nodes_and_what_only_they_got_accepted():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(4, 9)
    drafter.datastore = own_store(target, ids, 24)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, tree_record=True,
                          return_dict_in_generate=True, tree_lookup=3)
    assert any(any(r.tree["retrieved"]) for r in out.rounds)
    assert sum(r.datastore_accepted for r in out.rounds) > 0
    for r in out.rounds:
        assert r.datastore_accepted + r.lookup_accepted <= r.num_accepted
        assert r.datastore_accepted == sum(r.tree["retrieved"][i] for i in r.accepted_path)
    off = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, tree_datastore=False,
                          return_dict_in_generate=True, tree_lookup=3)
    assert torch.equal(off.sequences, out.sequences) and all(r.datastore_accepted == 0 for r in off.rounds)
    assert out.acceptance_length > off.acceptance_length


def test_end_to_end_sampling_with_datastore_branches_matches_the_target_distribution():
    target = make_target("llama", seed=3)
    ids = torch.tensor([[9, 4, 7]])
    vocab, temperature = target.config.vocab_size, 1.0
    marg2 = second_token_marginal(target, ids, temperature)
    p1 = torch.softmax(target(ids).logits[0, -1] / temperature, -1)
    likely = p1.topk(3).indices.tolist()  # retrieved branches through the likely first tokens
    drafter = make_drafter(target, tree_topk=2, tree_frontier=1, tree_budget=4)
    drafter.datastore = Datastore.build([[4, 7, t, u] for t in likely for u in range(4, 8)] * 3, vocab)
    assert drafter.datastore.branches([9, 4, 7])
    torch.manual_seed(0)
    counts = torch.zeros(vocab)
    for _ in range(600):
        out = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=temperature, top_k=0,
                              max_new_tokens=2, eos_token_id=None, return_dict_in_generate=True)
        counts[out.sequences[0, -1]] += 1
    ok, stat = chi_square_ok(counts, marg2)
    assert ok, stat


def test_the_datastore_travels_with_save_and_load_and_a_damaged_one_is_refused(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(6, 9)
    drafter.datastore = own_store(target, ids, 16)
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / DATASTORE_FILE).is_file()
    loaded = TreeSparkDrafter.from_pretrained(tmp_path)
    history = ids[0].tolist()
    assert loaded.datastore.branches(history) == drafter.datastore.branches(history)
    ref = target.generate(ids, do_sample=False, max_new_tokens=16)
    out = target.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=16,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and sum(r.datastore_accepted for r in out.rounds) > 0
    # (remote code, without the package: test_hub.test_remote_code_without_the_package_...)
    (tmp_path / DATASTORE_FILE).write_bytes(b"cut")
    with pytest.raises(DatastoreError, match=str(tmp_path / DATASTORE_FILE)):
        TreeSparkDrafter.from_pretrained(tmp_path)


def test_the_tree_datastore_knob(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target)
    assert resolve_datastore(drafter, None) is None
    with pytest.raises(ValueError, match="carries no datastore"):
        resolve_datastore(drafter, True)
    store = Datastore.build(random_sequences(7, vocab=VOCAB), VOCAB)
    assert resolve_datastore(drafter, store) is store
    store.save(tmp_path)
    assert isinstance(resolve_datastore(drafter, str(tmp_path)), Datastore)
    drafter.datastore = store
    assert resolve_datastore(drafter, None) is store and resolve_datastore(drafter, False) is None
    drafter.config.tree_datastore = False
    assert resolve_datastore(drafter, None) is None and resolve_datastore(drafter, True) is store
    with pytest.raises(ValueError, match="built for a vocabulary of 12"):
        resolve_datastore(drafter, Datastore.build(random_sequences(7), 12))
    for bad in ("yes", 3, [1]):
        with pytest.raises(ValueError, match="tree_datastore"):
            target.generate(prompt(1, 5), assistant_model=drafter, max_new_tokens=2, tree_datastore=bad)
    with pytest.raises(ValueError, match="tree_datastore"):
        TreeSparkConfig(tree_datastore="on")
    with pytest.raises(ValueError, match="datastore_grow_tokens"):
        TreeSparkConfig(datastore_grow_tokens=-1)


def test_a_growing_datastore_learns_this_processs_outputs_within_its_bound():
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.datastore = Datastore.build(random_sequences(8, vocab=VOCAB), VOCAB)
    drafter.datastore.grow_tokens = 60
    ids = prompt(9, 9)
    first = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24,
                            return_dict_in_generate=True)
    assert [len(g) for g in drafter.datastore.grown] == [datastore.HEADER_TOKENS + 24]  # header and answer
    again = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24,
                            return_dict_in_generate=True)
    assert torch.equal(again.sequences, first.sequences)
    assert again.acceptance_length > first.acceptance_length  # the second time it knows the answer
    for seed in range(10):
        target.generate(prompt(20 + seed, 6), assistant_model=drafter, do_sample=False, max_new_tokens=16)
    assert sum(len(g) for g in drafter.datastore.grown) <= 60


def test_treespark_datastore_builds_from_reference_files(tmp_path, capsys):
    from hf_treespark.cli import commands as cli

    data = tmp_path / "refs.jsonl.gz"
    with gzip.open(data, "wt") as f:
        for seq in random_sequences(10, vocab=VOCAB):
            f.write(json.dumps({"prompt_ids": [1, 2, 3, 4, 5], "response_ids": seq}) + "\n")
    target = make_target("llama")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    assert cli.main(["datastore", "--data", str(data), "--output", str(tmp_path / "drafter")]) == 0
    assert "30 responses" in capsys.readouterr().out
    assert TreeSparkDrafter.from_pretrained(tmp_path / "drafter").datastore.num_tokens == 30 * (60 + 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1], "response_ids": [1, 2, 999]}) + "\n")
    assert cli.main(["datastore", "--data", str(bad), "--output", str(tmp_path / "drafter"), "--force"]) == 2
    assert "999" in capsys.readouterr().err
    assert Datastore.load(tmp_path / "drafter").num_tokens == 30 * (60 + 4)  # the data is read before writing


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_drafter_carrying_a_datastore_can_be_copied_and_the_copy_drafts_the_same(how, tmp_path):
    import copy
    import pickle

    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(6, 9)
    drafter.datastore = own_store(target, ids, 16)
    drafter.datastore.grow_tokens = 40
    drafter.datastore.add(prompt(7, 12)[0].tolist())  # the grown index travels too
    if how == "deepcopy":
        twin = copy.deepcopy(drafter)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(drafter))
    else:
        torch.save(drafter, tmp_path / "drafter.pt")
        twin = torch.load(tmp_path / "drafter.pt", weights_only=False)
    assert twin.datastore is not drafter.datastore and twin.datastore.num_tokens == drafter.datastore.num_tokens
    assert twin.datastore.grown_index is not None
    history = ids[0].tolist()
    assert twin.datastore.branches(history) == drafter.datastore.branches(history)
    runs = [target.generate(ids, assistant_model=d, do_sample=False, max_new_tokens=16, return_dict_in_generate=True)
            for d in (drafter, twin)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    accepted = [[r.datastore_accepted for r in run.rounds] for run in runs]
    assert accepted[0] == accepted[1] and sum(accepted[0]) > 0


@pytest.mark.parametrize(("field", "value"), [("vocab_size", "lots"), ("max_match", "8.5"), ("vocab_size", "")])
def test_datastore_metadata_that_is_not_a_whole_number_is_refused_naming_the_file_and_field(field, value, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    path = Datastore.build(random_sequences(4), 12).save(tmp_path)
    with safe_open(str(path), framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        meta = dict(f.metadata())
    meta[field] = value
    save_file(tensors, str(path), metadata=meta)
    message = (f"the datastore file {path} is damaged (its metadata field {field!r} is {value!r}, not a whole "
               "number): rebuild it with `treespark datastore`")
    with pytest.raises(DatastoreError) as refused:
        Datastore.load(path, vocab_size=12)
    assert str(refused.value) == message


@pytest.mark.parametrize(("sequences", "message"), [
    ([[1, 2], [3, 4.7, 5]], "sequence 1, position 1: 4.7 is a float, not a token id"),
    ([[1, 2.0]], "sequence 0, position 1: 2.0 is a float, not a token id"),
    (np.array([[1.0, 2.0]]), "sequence 0, position 0: 1.0 is a float, not a token id"),
    ([torch.tensor([1.5, 2.0])], "sequence 0, position 0: 1.5 is a float, not a token id"),
    ([[1, "7"]], "sequence 0, position 1: '7' is a string, not a token id"),
    ([[1, True]], "sequence 0, position 1: True is a bool, not a token id"),
    (["hello"], "sequence 0 is a string ('hello'), not a list of token ids"),
    ([[[1, 2]]], "sequence 0 has shape (1, 2): each sequence is a flat list of token ids"),
])
def test_building_refuses_ids_that_are_not_integers_naming_the_sequence_and_position(sequences, message):
    with pytest.raises(DatastoreError) as refused:
        Datastore.build(sequences, 12)
    assert str(refused.value).startswith(message), str(refused.value)


def test_building_takes_integer_ids_of_any_kind():
    store = Datastore.build([[1, 2, 3], np.array([1, 2, 4], np.int16), torch.tensor([1, 2, 5]), (np.int64(1), 2, 3)],
                            12)
    assert store.num_tokens == 12 and store.lookup([1, 2])[0] == 2


@pytest.mark.parametrize(("where", "directory"), [
    ("missing_drafter", "missing_drafter"),  # a directory that does not exist yet: build into it
    ("empty", "empty"),  # an existing directory without the file
    ("somewhere/store.safetensors", "somewhere"),
])
def test_a_missing_datastore_names_the_directory_to_build_it_in(where, directory, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatastoreError) as refused:
        Datastore.load(tmp_path / where)
    assert f"--output {tmp_path / directory}`" in str(refused.value)


def test_the_tokenizer_and_sources_a_store_was_built_from_travel_with_it_and_another_tokenizer_is_refused(tmp_path):
    made_with = {"name_or_path": "org/target", "size": 12, "fingerprint": "0123456789abcdef"}
    store = Datastore.build(random_sequences(6), 12, tokenizer=made_with, sources=["aa", "bb"])
    path = store.save(tmp_path)
    again = Datastore.load(path, 12, tokenizer=dict(made_with))
    assert again.tokenizer == made_with and again.sources == ["aa", "bb"]
    assert store.frozen_copy().tokenizer == made_with
    other = {"name_or_path": "org/other", "size": 12, "fingerprint": "fedcba9876543210"}
    with pytest.raises(DatastoreError, match=rf"{path} was built with the tokenizer of org/target .*not the "
                                             r"tokenizer of org/other"):
        Datastore.load(path, 12, tokenizer=other)
    plain = Datastore.build(random_sequences(6), 12).save(tmp_path / "plain")  # built from token ids alone
    assert Datastore.load(plain, 12, tokenizer=other).tokenizer is None
    assert Datastore.load(plain).sources == []
