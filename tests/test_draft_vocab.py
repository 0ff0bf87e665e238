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
from test_hub import REMOTE_CODE_SCRIPT, V, draft_outputs, tiny_drafter, tiny_target

from hf_treespark import TreeSparkDrafter
from hf_treespark.drafter.draft_vocab import count_token_ids, coverage, rank_token_ids
from hf_treespark.hub.sharing import save_drafter

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
            # every drafted token comes from the draft vocabulary (the guard's probes and the plain steps after a
            # hand-off draft nothing)
            drafted = [r for r in out.rounds if r.tree is not None and r.tree["candidates"] is not None]
            assert drafted
            for r in drafted:
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


@pytest.mark.parametrize("bad", ["abc", b"ab", 7, 3.5, [1.5, 2.5], [True, False], torch.tensor([1.0, 2.0]),
                                 {"a": 1}, [[1, 2], [3]]])
def test_restrict_refuses_what_is_not_a_list_of_integer_ids(bad):
    with pytest.raises(TypeError, match="restrict_vocabulary: token_ids must be"):
        make_drafter(make_target("llama")).restrict_vocabulary(bad)


@pytest.mark.parametrize("bad, message", [([], "no ids"), ([5, -1], "id -1 outside"),
                                          ([5, VOCAB], f"id {VOCAB} outside"), ([5, 6, 5], "id 5 appears 2 times")])
def test_restrict_refuses_ids_that_are_not_a_draft_vocabulary(bad, message):
    with pytest.raises(ValueError, match=f"restrict_vocabulary: .*{message}"):
        make_drafter(make_target("llama")).restrict_vocabulary(bad)


@pytest.mark.parametrize("position, value, message", [(0, 10**6, "id 1000000 outside the target's vocabulary"),
                                                      (3, -3, "id -3 outside"), (0, 59, "id 59 appears 2 times")])
def test_a_damaged_draft_vocab_ids_buffer_is_refused_at_load_naming_the_file(tmp_path, position, value, message):
    """An out-of-range id used to load and fail in generate() with IndexError; a negative or repeated one loaded
    silently (a repeated id wastes tree slots)."""
    from safetensors.torch import load_file, save_file

    target = tiny_target()
    drafter = tiny_drafter(target).restrict_vocabulary(list(range(60, 10, -1)))
    drafter.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["draft_vocab_ids"][position] = value
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match=f"{tmp_path / 'model.safetensors'}: its draft_vocab_ids buffer is damaged "
                                      f"\\({message}"):
        TreeSparkDrafter.from_pretrained(tmp_path)
    fresh = tiny_drafter(target).restrict_vocabulary(list(range(60, 10, -1)))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=f"draft_vocab_ids is damaged \\({message}.*nothing was loaded"):
        fresh.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # not half-loaded


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


def test_ranking_reads_what_train_reads_gzip_included_and_names_the_file_of_bad_data(tmp_path):
    """`.jsonl.gz` (the repository's own training_data/ too) used to fail with a bare UTF-8 error, an empty file
    to rank nothing (and save a drafter at 0% coverage), and true/false to count as ids 1 and 0."""
    import gzip

    repository_data = sorted((Path(__file__).resolve().parents[1] / "training_data").glob("*.jsonl.gz"))
    assert repository_data and sum(count_token_ids(repository_data[:1]).values()) > 100_000
    plain = tmp_path / "refs.jsonl"
    plain.write_text(json.dumps({"response_ids": [5, 5, 9]}) + "\n\n" + json.dumps({"output_ids": [9, 2]}) + "\n")
    packed = tmp_path / "refs.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert count_token_ids([packed]) == count_token_ids([plain]) == Counter({5: 2, 9: 2, 2: 1})
    for name, content, message in [
        ("empty.jsonl", "", "empty.jsonl: no token ids in it"),
        ("blank.jsonl", "\n  \n", "blank.jsonl: no token ids in it"),
        ("hollow.jsonl", '{"response_ids": []}\n', "hollow.jsonl: no token ids in it"),
        ("bools.jsonl", '{"response_ids": [3]}\n{"response_ids": [true, false]}\n',
         "bools.jsonl:2: 'response_ids': token ids must be a list of integers >= 0"),
        ("negative.jsonl", '{"ids": [3, -1]}\n', "negative.jsonl:1: 'ids': token ids must be a list of integers"),
        ("floats.jsonl", '{"ids": [3, 4.0]}\n', "floats.jsonl:1: 'ids': token ids must be a list of integers"),
        ("scalar.jsonl", '{"ids": 7}\n', "scalar.jsonl:1: 'ids': token ids must be a list of integers"),
        ("large.jsonl", '{"ids": [3]}\n{"ids": [3, 128]}\n', "large.jsonl:2: 'ids' holds token id 128, outside the "
                                                             r"target's vocabulary \[0, 128\)"),
    ]:
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match=message):
            count_token_ids([plain, tmp_path / name], vocab_size=128)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"ids": [3]}\n{"response": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 text"):
        count_token_ids([tmp_path / "latin1.jsonl"])


def test_draft_vocab_command_refuses_an_empty_file_and_a_bad_size_before_writing(tmp_path, capsys):
    import gzip

    from hf_treespark.cli.commands import main

    target = tiny_target()
    tiny_drafter(target).save_pretrained(tmp_path / "drafter")
    data = tmp_path / "refs.jsonl.gz"
    data.write_bytes(gzip.compress(b"".join(json.dumps({"response_ids": [i % 40 + 5] * 3}).encode() + b"\n"
                                            for i in range(60))))
    (tmp_path / "empty.jsonl").write_text("")
    common = ["draft-vocab", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "a")]
    assert main([*common, "--data", str(tmp_path / "empty.jsonl"), "--size", "32"]) == 2
    assert "empty.jsonl: no token ids in it" in capsys.readouterr().err
    assert main([*common, "--data", str(data), "--size", str(V + 1)]) == 2
    assert f"--size {V + 1} must lie in [1, {V}]" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()  # nothing saved
    assert main([*common, "--data", str(data), "--size", "32"]) == 0
    assert "the 32 most frequent cover 86.7%" in capsys.readouterr().out
    assert TreeSparkDrafter.from_pretrained(tmp_path / "a").draft_vocab_ids.tolist()[:3] == [5, 6, 7]


@pytest.mark.slow
def test_draft_vocab_command_restricts_the_shipped_drafter(tmp_path, capsys):
    import gzip

    from hf_treespark.cli.commands import main

    data = tmp_path / "refs.jsonl"  # the target's own answers, as the repository keeps them (training_data/)
    kept = Path(__file__).resolve().parents[1] / "training_data" / "sharegpt_turns_smollm2_regen.jsonl.gz"
    with gzip.open(kept, "rt", encoding="utf-8") as src, open(data, "w") as out:
        for _, line in zip(range(200), src, strict=False):
            out.write(json.dumps({"response_ids": json.loads(line)["response_ids"]}) + "\n")
    assert main(["draft-vocab", "--data", str(data), "--size", "4096", "--output", str(tmp_path / "small")]) == 0
    assert "most frequent cover" in capsys.readouterr().out
    drafter = TreeSparkDrafter.from_pretrained(tmp_path / "small")
    assert drafter.config.draft_vocab_size == 4096 and drafter.markov_head.markov_w2.weight.shape[0] == 4096
    assert main(["draft-vocab", "--data", str(data), "--output", str(tmp_path / "small")]) == 2  # not empty


def test_ranking_reads_its_records_without_the_training_package():
    """`draft_vocab` sits below `training/` (tests/test_structure.py's layers): the JSONL reader both use lives in
    `records.py`, and `training.data.json_records` is that same function."""
    import ast

    import hf_treespark.drafter.draft_vocab as draft_vocab
    from hf_treespark import records
    from hf_treespark.training import data

    tree = ast.parse(Path(draft_vocab.__file__).read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not [name for name in imported if "training" in name.split(".")], imported
    assert data.json_records is records.json_records
