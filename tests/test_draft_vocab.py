"""A restricted (draft-vocabulary) drafter: lossless decoding, round trips, the ranking command (SPEC 2b)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_drafter, make_target
from test_generation import TREE_SHAPES, prompt
from test_hub import REMOTE_CODE_SCRIPT, draft_outputs, tiny_drafter, tiny_target

from hf_treespark import TreeSparkDrafter
from hf_treespark.draft_vocab import count_token_ids, coverage, rank_token_ids
from hf_treespark.hub import DSparkConversionError, export_dspark_checkpoint, save_drafter

DRAFT_IDS = list(range(70, 4, -1))[:48]  # 48 of the 128 ids, most useful first


def restricted(target, ids=DRAFT_IDS, **overrides) -> TreeSparkDrafter:
    return make_drafter(target, **overrides).restrict_vocabulary(ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_restricted_drafter_decodes_exactly_in_fp32(arch, attn):
    target = make_target(arch, attn)
    drafter = restricted(target)
    for seed, (length, new) in enumerate([(5, 24), (17, 16)]):
        ids = prompt(seed, length)
        ref = target.generate(ids, do_sample=False, max_new_tokens=new)
        for shape in TREE_SHAPES:
            out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=new,
                                  tree_record=True, return_dict_in_generate=True, **shape)
            assert torch.equal(out.sequences, ref), (arch, attn, seed, shape)
            for r in out.rounds:  # every drafted token comes from the draft vocabulary
                assert set(r.tree["candidates"]["tokens"]) <= set(DRAFT_IDS)


def test_restricting_keeps_the_full_drafters_distribution_on_the_kept_ids():
    target = make_target("llama")
    full = make_drafter(target)
    small = make_drafter(target).restrict_vocabulary(DRAFT_IDS)
    for d in (full, small):
        d.bind_target(target)
    hidden = torch.randn(2, 3, target.config.hidden_size)
    parents = torch.tensor([[5, 6, 7], [8, 9, 100]])
    full_z = full.depth_logits(hidden) + full.markov_bias(parents)
    small_z = small.depth_logits(hidden) + small.markov_bias(parents)
    assert small_z.shape[-1] == len(DRAFT_IDS)
    assert torch.allclose(small_z, full_z[..., DRAFT_IDS], atol=1e-5)
    assert small.config.draft_vocab_size == len(DRAFT_IDS) and small.draft_vocab_size == len(DRAFT_IDS)


def test_full_vocabulary_undoes_a_restriction_for_training():
    target = make_target("llama")
    full = make_drafter(target)
    again = make_drafter(target).restrict_vocabulary(DRAFT_IDS).full_vocabulary()
    assert again.draft_vocab_ids is None and again.config.draft_vocab_size is None
    parents = torch.tensor([[5, 6, 7]])
    kept = full.markov_bias(parents)[..., DRAFT_IDS]
    assert torch.equal(again.markov_bias(parents)[..., DRAFT_IDS], kept)
    others = [i for i in range(VOCAB) if i not in DRAFT_IDS]
    assert not again.markov_bias(parents)[..., others].any()  # no parent correction yet for the other ids


def test_restrict_refuses_ids_outside_the_current_vocabulary():
    target = make_target("llama")
    drafter = restricted(target)
    with pytest.raises(ValueError, match="current vocabulary"):
        drafter.restrict_vocabulary([1, 2, 3])  # not among the 48 kept ids
    with pytest.raises(ValueError, match="distinct"):
        make_drafter(target).restrict_vocabulary([5, 5])


def test_save_load_round_trip_keeps_the_ranking(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target).restrict_vocabulary(list(range(60, 10, -1)))
    want = draft_outputs(drafter, target, torch.randint(5, 64, (2, 12), generator=torch.Generator().manual_seed(2)))
    drafter.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 50
    again = TreeSparkDrafter.from_pretrained(tmp_path).eval()
    assert again.draft_vocab_ids.tolist() == list(range(60, 10, -1))
    # weights read from the file at odd offsets are copied to aligned storage, where kernels round as before
    assert all(t.data_ptr() % 64 == 0 for t in [*again.parameters(), *again.buffers()])
    got = draft_outputs(again, target, torch.randint(5, 64, (2, 12), generator=torch.Generator().manual_seed(2)))
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_remote_code_loads_a_restricted_drafter_without_the_package(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target).restrict_vocabulary(list(range(60, 10, -1)))
    input_ids = torch.randint(5, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    want = draft_outputs(drafter, target, input_ids)["depth_logits"]
    save_drafter(drafter, tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    torch.save(input_ids, tmp_path / "ids.pt")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", REMOTE_CODE_SCRIPT, str(tmp_path / "drafter"),
                           str(tmp_path / "target"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["depth_logits"].shape[-1] == 50 and torch.equal(got["depth_logits"], want)


def test_dspark_export_refuses_a_restricted_drafter(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target).restrict_vocabulary(list(range(60, 10, -1)))
    with pytest.raises(DSparkConversionError, match="draft vocabulary of 50 ids"):
        export_dspark_checkpoint(drafter, target, tmp_path)


def test_ranking_counts_ids_and_texts_and_names_bad_lines(tmp_path):
    data = tmp_path / "refs.jsonl"
    data.write_text(json.dumps({"response_ids": [5, 5, 5, 9, 9, 2]}) + "\n" + json.dumps({"response": "ab"}) + "\n")

    class CharTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) - 90 for c in text]}  # "a" -> 7, "b" -> 8

    counts = count_token_ids([data], CharTokenizer())
    assert counts == Counter({5: 3, 9: 2, 2: 1, 7: 1, 8: 1})
    ranked = rank_token_ids(counts, 4, VOCAB)
    assert ranked == [5, 9, 2, 7]
    assert rank_token_ids(counts, 7, VOCAB) == [5, 9, 2, 7, 8, 0, 1]  # padded with the smallest unseen ids
    assert coverage(counts, ranked) == pytest.approx(7 / 8)
    assert rank_token_ids(counts, 3, VOCAB, allowed=[9, 40, 7, 41]) == [9, 7, 40]  # a restricted drafter's ids
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        rank_token_ids(Counter({VOCAB + 3: 1}), 2, VOCAB)
    data.write_text('{"response_ids": [1, 2]}\n{not json}\n')
    with pytest.raises(ValueError, match=r"refs.jsonl:2: not a JSON line"):
        count_token_ids([data])


@pytest.mark.slow
def test_draft_vocab_command_restricts_the_shipped_drafter(tmp_path, capsys):
    from hf_treespark.cli import main

    data = tmp_path / "refs.jsonl"
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "sharegpt_smollm2_regen.jsonl"
    with open(shared) as src, open(data, "w") as out:
        for _, line in zip(range(200), src, strict=False):
            out.write(json.dumps({"response_ids": json.loads(line)["response_ids"]}) + "\n")
    assert main(["draft-vocab", "--data", str(data), "--size", "4096", "--output", str(tmp_path / "small")]) == 0
    assert "most frequent cover" in capsys.readouterr().out
    drafter = TreeSparkDrafter.from_pretrained(tmp_path / "small")
    assert drafter.config.draft_vocab_size == 4096 and drafter.markov_head.markov_w2.weight.shape[0] == 4096
    assert main(["draft-vocab", "--data", str(data), "--output", str(tmp_path / "small")]) == 2  # not empty
