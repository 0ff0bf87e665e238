"""DSpark checkpoints for the serving engines (`treespark export --format dspark`, `export_dspark_checkpoint`): every
tensor and config field sized as vLLM's and SGLang's DSpark models size theirs (docs/serving.md), draft vocabularies
as `d2t`, a learned mask embedding in its `embed_tokens` row, and each export reloaded tensor for tensor. No engine
runs here (they need a GPU): what they read is checked against what their sources read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_hub import V, assert_same_outputs, draft_outputs, dspark_keys, tiny_drafter, tiny_target

from hf_treespark.cli import commands as cli
from hf_treespark.hub.sharing import DSparkConversionError, export_dspark_checkpoint, load_dspark_checkpoint
from hf_treespark.training.export import serving_commands, sglang_problem

DRAFT_IDS = [200, 7, 91, 30, 5, 255, 64, 12, 150, 99, 3, 77]  # most useful first: deliberately not sorted
SERVING_DOC = Path(__file__).parents[1] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def engine_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a DSpark checkpoint holds and its shape, computed from its `config.json` alone as vLLM's
    `Qwen3DSparkForCausalLM` and SGLang's `DSparkDraftModel` size their modules (docs/serving.md)."""
    hidden, heads, kv, head_dim = (config["hidden_size"], config["num_attention_heads"],
                                   config["num_key_value_heads"], config["head_dim"])
    vocab, rank, width = config["vocab_size"], config["markov_rank"], config["intermediate_size"]
    proposals = config.get("draft_vocab_size") or vocab
    shapes = {"embed_tokens.weight": (vocab, hidden), "lm_head.weight": (proposals, hidden),
              "fc.weight": (hidden, len(config["target_layer_ids"]) * hidden), "hidden_norm.weight": (hidden,),
              "norm.weight": (hidden,), "markov_head.markov_w1.weight": (vocab, rank),
              "markov_head.markov_w2.weight": (proposals, rank)}
    if config["enable_confidence_head"]:
        extra = rank if config.get("confidence_head_with_markov") else 0
        shapes |= {"confidence_head.proj.weight": (1, hidden + extra), "confidence_head.proj.bias": (1,)}
    if proposals < vocab:
        shapes["d2t"] = (proposals,)
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}."
        shapes |= {layer + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                   layer + "self_attn.k_proj.weight": (kv * head_dim, hidden),
                   layer + "self_attn.v_proj.weight": (kv * head_dim, hidden),
                   layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                   layer + "self_attn.q_norm.weight": (head_dim,), layer + "self_attn.k_norm.weight": (head_dim,),
                   layer + "mlp.gate_proj.weight": (width, hidden), layer + "mlp.up_proj.weight": (width, hidden),
                   layer + "mlp.down_proj.weight": (hidden, width), layer + "input_layernorm.weight": (hidden,),
                   layer + "post_attention_layernorm.weight": (hidden,)}
    return shapes


def exported(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((directory / "config.json").read_text()), load_file(directory / "model.safetensors")


def assert_the_engines_can_size_it(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["markov_head_type"] == "vanilla" and config["hidden_act"] == "silu"
    assert config["layer_types"] == ["full_attention"] * config["num_hidden_layers"]
    assert 0 <= config["mask_token_id"] < config["vocab_size"]
    assert {k: tuple(t.shape) for k, t in tensors.items()} == engine_shapes(config)


def assert_reloads_tensor_for_tensor(directory: Path, drafter, target, input_ids, skip=()) -> None:
    """`directory` loads back (`load_dspark_checkpoint`) into every tensor of `drafter` but `skip`, and drafts the
    same."""
    loaded = load_dspark_checkpoint(directory)
    want = {k: v for k, v in drafter.state_dict().items() if not k.startswith(skip)}
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    if not skip:
        assert_same_outputs(draft_outputs(loaded, target, input_ids), draft_outputs(drafter, target, input_ids))


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(2))


def test_a_draft_vocabulary_travels_as_d2t_with_its_lm_head_rows_and_reloads(tmp_path, target, input_ids):
    drafter = tiny_drafter(target).restrict_vocabulary(DRAFT_IDS)
    export_dspark_checkpoint(drafter, target, tmp_path)
    config, tensors = exported(tmp_path)

    assert_the_engines_can_size_it(config, tensors)
    assert config["draft_vocab_size"] == len(DRAFT_IDS) and config["vocab_size"] == V
    assert set(tensors) == dspark_keys(drafter.config.num_hidden_layers) | {"d2t"}
    d2t = tensors["d2t"]
    assert d2t.dtype == torch.int64
    draft_ids = torch.arange(len(DRAFT_IDS))
    assert (draft_ids + d2t[draft_ids]).tolist() == DRAFT_IDS  # vLLM's map_draft_to_target: id + d2t[id]
    assert torch.equal(tensors["lm_head.weight"], target.get_output_embeddings().weight[DRAFT_IDS])
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(tensors["markov_head.markov_w2.weight"], drafter.markov_head.markov_w2.weight)
    assert_reloads_tensor_for_tensor(tmp_path, drafter, target, input_ids)
    assert sglang_problem(config) is not None and "vLLM" in sglang_problem(config)


def test_a_full_vocabulary_drafter_is_served_by_both_engines(tmp_path, target, input_ids):
    drafter = tiny_drafter(target)
    export_dspark_checkpoint(drafter, target, tmp_path)
    config, tensors = exported(tmp_path)
    assert_the_engines_can_size_it(config, tensors)
    assert "draft_vocab_size" not in config and "d2t" not in tensors
    assert sglang_problem(config) is None
    assert_reloads_tensor_for_tensor(tmp_path, drafter, target, input_ids)


def test_a_learned_mask_embedding_is_written_into_its_embed_tokens_row(tmp_path, target, input_ids):
    drafter = tiny_drafter(target, mask_token_id=None)
    with pytest.raises(DSparkConversionError, match="learned mask embedding.*--mask-token-id"):
        export_dspark_checkpoint(drafter, target, tmp_path / "refused")
    with pytest.raises(DSparkConversionError, match=f"mask_token_id={V} is not a token id"):
        export_dspark_checkpoint(drafter, target, tmp_path / "refused", mask_token_id=V)
    assert not (tmp_path / "refused").exists()

    export_dspark_checkpoint(drafter, target, tmp_path / "out", mask_token_id=9)
    config, tensors = exported(tmp_path / "out")
    assert_the_engines_can_size_it(config, tensors)
    assert config["mask_token_id"] == 9 and config["treespark"]["learned_mask_embedding"] is True
    embed, theirs = tensors["embed_tokens.weight"], target.get_input_embeddings().weight
    assert torch.equal(embed[9], drafter.mask_embedding)  # what the engines read at the mask slots
    assert torch.equal(embed[:9], theirs[:9]) and torch.equal(embed[10:], theirs[10:])
    assert "vLLM" in sglang_problem(config)  # SGLang embeds with the target's own table
    assert_reloads_tensor_for_tensor(tmp_path / "out", drafter, target, input_ids)
    assert load_dspark_checkpoint(tmp_path / "out").config.mask_token_id is None


def test_a_drafters_own_mask_token_id_is_kept_and_another_refused(tmp_path, target):
    drafter = tiny_drafter(target)  # mask_token_id=3
    with pytest.raises(DSparkConversionError, match="mask_token_id=4: .*token id 3"):
        export_dspark_checkpoint(drafter, target, tmp_path, mask_token_id=4)
    export_dspark_checkpoint(drafter, target, tmp_path, mask_token_id=3)
    assert exported(tmp_path)[0]["mask_token_id"] == 3


@pytest.mark.parametrize("head", ["depth1_head", "depth2_head"])
def test_depth_heads_are_left_out_only_when_asked(tmp_path, target, input_ids, head):
    drafter = tiny_drafter(target, **{head: 16})
    with pytest.raises(DSparkConversionError, match=r"depth-[12] head.*--without-depth-heads"):
        export_dspark_checkpoint(drafter, target, tmp_path)
    export_dspark_checkpoint(drafter, target, tmp_path, without_depth_heads=True)
    config, tensors = exported(tmp_path)
    assert_the_engines_can_size_it(config, tensors)
    assert not any(k.startswith(head) for k in tensors)
    assert_reloads_tensor_for_tensor(tmp_path, drafter, target, input_ids, skip=(head,))


def test_a_d2t_that_is_no_draft_vocabulary_is_refused_on_load(tmp_path, target):
    from safetensors.torch import save_file

    export_dspark_checkpoint(tiny_drafter(target).restrict_vocabulary(DRAFT_IDS), target, tmp_path)
    _, tensors = exported(tmp_path)
    tensors["d2t"] = -torch.arange(len(DRAFT_IDS))  # every draft index -> target id 0
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DSparkConversionError, match="d2t does not map to a draft vocabulary"):
        load_dspark_checkpoint(tmp_path)


def test_the_docs_list_every_tensor_and_config_field_the_export_writes(tmp_path, target):
    """docs/serving.md names each key next to the engine source that reads it: nothing exported goes unlisted."""
    doc = SERVING_DOC.read_text()
    drafter = tiny_drafter(target).restrict_vocabulary(DRAFT_IDS)
    export_dspark_checkpoint(drafter, target, tmp_path)
    config, tensors = exported(tmp_path)
    for name in sorted(set(config) | {k for k in tensors if not k.startswith("layers.")}):
        assert f"`{name}`" in doc, name
    for module in {k.split(".")[-2] for k in tensors if k.startswith("layers.")}:  # `layers.i.self_attn.q_proj...`
        assert re.search(rf"`[^`\n]*\b{module}\b[^`\n]*`", doc), module
    for path in ("vllm/model_executor/models/qwen3_dspark.py", "python/sglang/srt/models/dspark.py"):
        assert path in doc


def test_serving_commands_name_the_target_the_export_and_the_block_size(tmp_path):
    config = {"block_size": 7}
    commands = serving_commands(tmp_path / "my export", config, "default")
    assert commands["vLLM"].startswith("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config ")
    assert '"method": "dspark"' in commands["vLLM"] and '"num_speculative_tokens": 7' in commands["vLLM"]
    assert f'"model": "{tmp_path / "my export"}"' in commands["vLLM"]
    assert "--speculative-algorithm DSPARK" in commands["SGLang"]
    assert f"--speculative-draft-model-path '{tmp_path / 'my export'}'" in commands["SGLang"]
    assert commands["SGLang"].endswith("--speculative-dspark-block-size 7")
    assert serving_commands("out", config, "org/model")["SGLang"].startswith(
        "python -m sglang.launch_server --model-path org/model ")


def test_treespark_export_format_dspark_writes_a_drafter_directory_as_dspark(tmp_path, target, input_ids, capsys):
    drafter = tiny_drafter(target).restrict_vocabulary(DRAFT_IDS)
    drafter.save_pretrained(tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    out = tmp_path / "dspark"
    assert cli.main(["export", str(tmp_path / "drafter"), "--format", "dspark", "--output", str(out),
                     "--target", str(tmp_path / "target"), "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "serve it with vLLM: vllm serve " in printed and "--speculative-algorithm DSPARK" in printed
    assert "draft vocabulary 12 (d2t)" in printed and "note: SGLang" in printed
    assert_reloads_tensor_for_tensor(out, drafter, target, input_ids)

    assert cli.main(["export", str(tmp_path / "drafter"), "--format", "dspark", "--output", str(out),
                     "--target", str(tmp_path / "target")]) == 2  # not a new directory
    assert "exists and is not empty" in capsys.readouterr().err


def test_treespark_export_refuses_dspark_options_without_format_dspark(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--output", str(tmp_path / "o"), "--without-depth-heads"]) == 2
    assert "--without-depth-heads applies to --format dspark only" in capsys.readouterr().err
    assert cli.main(["export", "--output", str(tmp_path / "o")]) == 2
    assert "give the training checkpoint to export" in capsys.readouterr().err


@pytest.mark.slow
def test_the_shipped_drafter_exports_for_the_engines_and_reloads_tensor_for_tensor(tmp_path, capsys):
    from hf_treespark.hub.assets import load_default_drafter, load_default_target

    out = tmp_path / "shipped"
    assert cli.main(["export", "--format", "dspark", "--output", str(out)]) == 2  # its depth-1 head
    assert "--without-depth-heads" in capsys.readouterr().err
    assert cli.main(["export", "--format", "dspark", "--without-depth-heads", "--output", str(out)]) == 0
    assert "speculative-dspark-block-size 7" in capsys.readouterr().out
    config, tensors = exported(out)
    assert_the_engines_can_size_it(config, tensors)
    shipped = load_default_drafter(dtype="bfloat16")
    target, _ = load_default_target(dtype="bfloat16")
    assert config["mask_token_id"] == shipped.config.mask_token_id == 16
    assert config["draft_vocab_size"] == shipped.config.draft_vocab_size
    ids = shipped.draft_vocab_ids
    assert torch.equal(torch.arange(ids.numel()) + tensors["d2t"], ids)
    assert torch.equal(tensors["lm_head.weight"], target.get_output_embeddings().weight[ids])
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    loaded = load_dspark_checkpoint(out).state_dict()
    want = {k: v for k, v in shipped.state_dict().items() if not k.startswith("depth1_head.")}
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)


def test_the_treespark_commands_of_the_serving_page_parse():
    import shlex

    lines = [line.split("#")[0].strip() for line in SERVING_DOC.read_text().splitlines()
             if line.startswith("treespark ")]
    assert len(lines) >= 3
    for line in lines:
        args = cli.parse(shlex.split(line)[1:])
        assert args.format == "dspark", line
