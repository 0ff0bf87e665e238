"""Saving, loading, pushing and converting drafters (`hf_treespark.hub.sharing`), on a tiny random Qwen3 target."""

from __future__ import annotations

import errno
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, Qwen3Config, Qwen3ForCausalLM

import hf_treespark  # noqa: F401  (registers the drafter with AutoModel)
from hf_treespark import TreeSparkConfig, TreeSparkDrafter
from hf_treespark.hub.sharing import (
    DSparkConversionError,
    dspark_config_to_treespark,
    export_dspark_checkpoint,
    load_dspark_checkpoint,
    model_card,
    push_drafter_to_hub,
    save_drafter,
    treespark_config_to_dspark,
)

TARGET_NAME = "tiny-org/tiny-qwen3"
V, H, TARGET_LAYERS = 256, 64, 4
ACCEPTANCE = "| set | tau |\n|---|---|\n| MT-Bench | 3.21 |"


def tiny_target() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen3ForCausalLM(cfg).eval()


def tiny_drafter(target, **overrides) -> TreeSparkDrafter:
    """A drafter with every weight random (the Markov head's W2 starts at zero otherwise)."""
    fields = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  intermediate_size=64, markov_rank=16, mask_token_id=3, target_name_or_path=TARGET_NAME,
                  tree_topk=3, tree_frontier=5, tree_budget=17)
    fields.update(overrides)
    torch.manual_seed(1)
    drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, **fields)).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return drafter


@pytest.fixture(scope="module")
def target() -> Qwen3ForCausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target) -> TreeSparkDrafter:
    return tiny_drafter(target)


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(2))


ANCHOR_POSITIONS = torch.tensor([[4, 11], [6, 9]])
PARENTS = torch.tensor([[7, 8, 9], [10, 11, 12]])


def target_features(target, input_ids, layer_ids) -> torch.Tensor:
    """`[b, s, n_layers * d]`: target `hidden_states[l + 1]` for `l` in `layer_ids`, concatenated."""
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)


def draft_outputs(drafter, target, input_ids) -> dict[str, torch.Tensor]:
    """Everything a drafter computes: depth logits, normed block states, Markov bias, confidence."""
    drafter.bind_target(target)
    with torch.no_grad():
        out = drafter(anchor_ids=input_ids.gather(1, ANCHOR_POSITIONS), anchor_positions=ANCHOR_POSITIONS,
                      target_features=target_features(target, input_ids, drafter.config.target_layer_ids))
        return {
            "depth_logits": out.depth_logits,
            "hidden": out.hidden_states,
            "markov": drafter.markov_bias(PARENTS),
            "confidence": drafter.confidence(out.hidden_states[:, :3], PARENTS),
        }


def assert_same_outputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def config_fields(config: TreeSparkConfig) -> dict:
    """The values of every `TreeSparkConfig.__init__` argument (what defines the drafter and its policy)."""
    names = [n for n in inspect.signature(TreeSparkConfig.__init__).parameters if n not in ("self", "kwargs")]
    return {n: getattr(config, n) for n in names}


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


# ----- save / load ------------------------------------------------------------------------------------
def test_save_drafter_writes_remote_code_card_and_weights_without_target_parts(tmp_path, drafter, target, input_ids):
    want = draft_outputs(drafter, target, input_ids)
    save_drafter(drafter, tmp_path, acceptance_table=ACCEPTANCE)

    assert {"config.json", "modeling.py", "configuration.py", "model.safetensors", "README.md"} <= set(
        os.listdir(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration.TreeSparkConfig",
                                  "AutoModel": "modeling.TreeSparkDrafter"}
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert keys == set(drafter.state_dict())
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    assert ACCEPTANCE in (tmp_path / "README.md").read_text()

    reloaded = AutoModel.from_pretrained(tmp_path)
    assert type(reloaded) is TreeSparkDrafter
    assert config_fields(reloaded.config) == config_fields(drafter.config)
    assert_same_outputs(draft_outputs(reloaded.eval(), target, input_ids), want)


def test_feature_statistics_and_anchor_features_survive_save_and_load(tmp_path, target, input_ids):
    """The standardisation buffers and the anchor projection are weights of the checkpoint: a reloaded drafter
    drafts exactly what the saved one did (not the identity statistics a fresh drafter starts with)."""
    drafter = tiny_drafter(target, anchor_features=True, normalize_features=True)
    width = drafter.config.num_target_features * drafter.config.target_hidden_size
    generator = torch.Generator().manual_seed(3)
    drafter.set_feature_statistics(3.0 + 5.0 * torch.randn(200, width, generator=generator))
    with torch.no_grad():
        drafter.anchor_proj.weight.normal_(0.0, 0.3, generator=generator)
    assert not torch.allclose(drafter.feature_mean, torch.zeros(width))
    want = draft_outputs(drafter, target, input_ids)
    save_drafter(drafter, tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    assert torch.equal(reloaded.feature_mean, drafter.feature_mean)
    assert torch.equal(reloaded.feature_scale, drafter.feature_scale)
    assert_same_outputs(draft_outputs(reloaded, target, input_ids), want)


def test_set_feature_statistics_standardises_each_dimension(target):
    drafter = tiny_drafter(target, normalize_features=True)
    width = drafter.config.num_target_features * drafter.config.target_hidden_size
    generator = torch.Generator().manual_seed(0)
    scales = 50 + 50 * torch.rand(width, generator=generator)  # all above the floor (10% of the median)
    features = 7.0 + scales * torch.randn(4000, width, generator=generator)
    features[:, 0] = 2.0  # a constant dimension: floored, not divided by zero
    drafter.set_feature_statistics(features)
    standard = (features - drafter.feature_mean) * drafter.feature_scale
    assert standard[:, 1:].mean(0).abs().max() < 1e-3
    assert (standard[:, 1:].std(0) - 1).abs().max() < 1e-3
    assert torch.isfinite(drafter.feature_scale).all() and standard[:, 0].abs().max() < 1e-3
    with torch.no_grad():
        manual = drafter.hidden_norm(drafter.fc(standard[:5]))
        assert torch.allclose(drafter.project_context(features[:5]), manual, atol=1e-5)
    with pytest.raises(ValueError, match="normalize_features=False"):
        tiny_drafter(target).set_feature_statistics(features)


def test_save_drafter_keeps_an_existing_readme(tmp_path, drafter):
    (tmp_path / "README.md").write_text("my own card")
    save_drafter(drafter, tmp_path)
    assert (tmp_path / "README.md").read_text() == "my own card"
    assert (tmp_path / "model.safetensors").is_file()


def test_save_drafter_refuses_push_to_hub_kwarg(tmp_path, drafter):
    with pytest.raises(ValueError, match="push_drafter_to_hub"):
        save_drafter(drafter, tmp_path, push_to_hub=True)


REMOTE_CODE_SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["hf_treespark"] = None  # the package is installed editable: make it unimportable here
    try:
        import hf_treespark  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_treespark is importable in the subprocess")
    import torch
    from transformers import AutoModel, Qwen3ForCausalLM

    drafter_dir, target_dir, ids_file, out_file = sys.argv[1:5]
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    target = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    drafter.bind_target(target)
    input_ids = torch.load(ids_file)
    anchors = torch.tensor([[4, 11], [6, 9]])
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
        out = drafter(anchor_ids=input_ids.gather(1, anchors), anchor_positions=anchors, target_features=feats)
    torch.save({"depth_logits": out.depth_logits, "module": type(drafter).__module__}, out_file)
""")


def test_trust_remote_code_loads_without_the_package(tmp_path, drafter, target, input_ids):
    want = draft_outputs(drafter, target, input_ids)["depth_logits"]
    save_drafter(drafter, tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    torch.save(input_ids, tmp_path / "ids.pt")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(tmp_path / "drafter"), str(tmp_path / "target"),
         str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["module"].startswith("transformers_modules")
    assert torch.equal(got["depth_logits"], want)


# ----- push to hub -----------------------------------------------------------------------------------
def test_push_drafter_to_hub_uploads_weights_code_and_card(tmp_path, monkeypatch, drafter):
    calls = []

    def fake_create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs, self.token))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def fake_upload_folder(self, *, repo_id, folder_path, commit_message, **kwargs):
        calls.append(("upload_folder", repo_id, commit_message))
        import shutil

        shutil.copytree(folder_path, tmp_path / "uploaded")
        return "commit-info"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    result = push_drafter_to_hub(drafter, "me/tiny-drafter", acceptance_table=ACCEPTANCE, private=True,
                                 token="hf_fake", commit_message="first drafter")

    assert result == "commit-info"
    assert calls == [
        ("create_repo", "me/tiny-drafter", {"exist_ok": True, "private": True}, "hf_fake"),
        ("upload_folder", "me/tiny-drafter", "first drafter"),
    ]
    uploaded = tmp_path / "uploaded"
    assert {"config.json", "model.safetensors", "modeling.py", "configuration.py", "README.md"} <= set(
        os.listdir(uploaded))
    assert "class TreeSparkDrafter" in (uploaded / "modeling.py").read_text()
    card = (uploaded / "README.md").read_text()
    assert front_matter(card)["base_model"] == TARGET_NAME
    assert ACCEPTANCE in card
    assert "| tree_topk (children per frontier parent) | 3 |" in card
    assert "| tree_frontier (parents kept per depth) | 5 |" in card
    assert "| tree_budget (tree nodes verified per round) | 17 |" in card
    assert 'AutoModel.from_pretrained("me/tiny-drafter")' in card
    reloaded = AutoModel.from_pretrained(uploaded)
    for key, value in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


# ----- model card -------------------------------------------------------------------------------------
def test_model_card_without_table_says_so_and_shows_usage(drafter):
    card = model_card(drafter)
    meta = front_matter(card)
    assert meta["library_name"] == "transformers"
    assert meta["tags"] == ["hf_treespark", "treespark", "speculative-decoding", "drafter"]
    assert meta["base_model"] == TARGET_NAME
    assert "No acceptance table was recorded" in card
    assert "import hf_treespark" in card
    assert "drafter = AutoModel.from_pretrained(" in card
    assert "target.generate(**inputs, assistant_model=drafter, max_new_tokens=" in card
    assert "trust_remote_code=True" in card
    assert f"| target_layer_ids | `{drafter.config.target_layer_ids}`" in card
    assert "| head_dim | 32 |" in card
    assert "| Markov rank `r` | 16 |" in card
    assert "| block size `B` | 7 |" in card


def test_model_card_is_built_from_what_the_drafter_carries(target, tmp_path):
    """The calibrated `acceptance_profile` is the drafter's measured table: a re-saved drafter keeps it on its card."""
    drafter = tiny_drafter(target, acceptance_profile={"8": 1.8, "2": 1.5, "16": 1.96}, tree_lookup=5)
    drafter.restrict_vocabulary(list(range(200)))
    card = (save_drafter(drafter, tmp_path / "resaved") / "README.md").read_text()
    assert "No acceptance table was recorded" not in card
    assert "| tree budget | acceptance length |\n|---|---|\n| 2 | 1.50 |\n| 8 | 1.80 |\n| 16 | 1.96 |" in card
    assert "| tree_lookup (tokens per lookup branch, 0 = off) | 5 |" in card
    assert f"| draft vocabulary | 200 of the target's {V} ids" in card
    with_table = model_card(drafter, acceptance_table=ACCEPTANCE)
    assert ACCEPTANCE in with_table and "| 16 | 1.96 |" in with_table  # a benchmark table and the profile


def test_model_card_usage_applies_the_chat_template(drafter):
    """Raw text fed to an instruct target (SmolLM2-Instruct) gets end-of-text only: the example chats."""
    card = model_card(drafter)
    usage = card[card.index("## Usage"):]
    assert "tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True," in usage
    assert 'inputs = tokenizer("' not in usage
    assert 'tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)' in usage


def test_the_shipped_drafters_card_is_the_card_writers_with_its_tables():
    from hf_treespark.hub.assets import DEFAULT_DRAFTER_DIR

    shipped = (DEFAULT_DRAFTER_DIR / "README.md").read_text()
    drafter = TreeSparkDrafter.from_pretrained(DEFAULT_DRAFTER_DIR)
    measured = shipped[shipped.index("## Measured acceptance") + len("## Measured acceptance"):]
    table = measured[: measured.index("Mean tokens committed per round")]  # the benchmark's tables
    assert "| MT-Bench | TreeSpark + lookup + datastore |" in table
    written = huggingface_hub.ModelCard(model_card(drafter, acceptance_table=table))
    assert huggingface_hub.ModelCard(shipped).data.to_dict() == written.data.to_dict()  # the YAML's layout may differ
    assert huggingface_hub.ModelCard(shipped).text == written.text
    profile_row = f"| 16 | {drafter.config.acceptance_profile['16']:.2f} |"  # the calibrated acceptance profile
    assert "apply_chat_template(" in shipped and profile_row in shipped
    assert "| depth-1 head | MLP width 2048" in shipped


def test_push_keeps_the_card_of_the_drafters_directory(tmp_path, monkeypatch, target):
    uploaded = {}

    def fake_upload_folder(self, *, repo_id, folder_path, **kwargs):
        uploaded["card"] = (Path(folder_path) / "README.md").read_text()
        return "commit-info"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kwargs: huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}"))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    saved = save_drafter(tiny_drafter(target), tmp_path / "final", acceptance_table=ACCEPTANCE)
    own = "# My drafter\n\nLoad it with `AutoModel.from_pretrained(\"path/or/repo-id-of-this-drafter\")`.\n"
    for card in (None, own):  # the card saved with the drafter (its table), then one the user wrote
        if card is not None:
            (saved / "README.md").write_text(card)
        expected = (saved / "README.md").read_text().replace("path/or/repo-id-of-this-drafter", "me/tiny")
        push_drafter_to_hub(TreeSparkDrafter.from_pretrained(saved), "me/tiny")
        assert uploaded["card"] == expected
    assert ACCEPTANCE not in uploaded["card"] and 'AutoModel.from_pretrained("me/tiny")' in uploaded["card"]
    push_drafter_to_hub(TreeSparkDrafter.from_pretrained(saved), "me/tiny", acceptance_table="| new | 2.0 |")
    assert "| new | 2.0 |" in uploaded["card"]  # an explicit table makes a new card


def test_model_card_omits_base_model_when_target_is_unknown_or_a_local_path(target):
    for name in (None, "/home/me/models/target"):
        card = model_card(tiny_drafter(target, target_name_or_path=name))
        assert "base_model" not in front_matter(card)
    assert "(not recorded)" in model_card(tiny_drafter(target, target_name_or_path=None))


# ----- bad checkpoints ----------------------------------------------------------------------------------
def test_truncated_weights_raise_oserror_naming_the_path(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match=str(tmp_path)):
        AutoModel.from_pretrained(tmp_path)


def test_non_finite_weights_are_refused_naming_the_tensors_and_the_file(tmp_path, drafter):
    """A diverged or damaged drafter would load and draft badly without a word: its NaN / inf weights are named."""
    save_drafter(drafter, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    weights["fc.weight"][0, :2] = float("inf")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for load in (TreeSparkDrafter.from_pretrained, AutoModel.from_pretrained):
        with pytest.raises(ValueError) as err:
            load(tmp_path)
        message = str(err.value)
        assert str(tmp_path / "model.safetensors") in message
        assert "fc.weight (2 inf)" in message and "layers.1.mlp.up_proj.weight (1 NaN)" in message
        assert "layers.0." not in message and "retrain" in message and "re-save" in message


def test_missing_weights_raise_oserror(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(("field", "value"), [("block_size", 0), ("target_layer_ids", [1, TARGET_LAYERS - 1])])
def test_invalid_config_field_raises_valueerror_naming_it(tmp_path, drafter, field, value):
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"TreeSparkConfig.{field}="):
        AutoModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(("field", "value", "form"), [
    ("target_layer_ids", "1,8,14", r"expected a list of integer target layer ids, e\.g\. \[1, 8, 14\]"),
    ("target_layer_ids", [1.5, 8], "expected a list of integer target layer ids"),
    ("acceptance_profile", {"x": 1.2}, "expected a mapping from integer tree budgets to measured acceptance lengths"),
    ("acceptance_profile", {"8": "fast"}, "expected a mapping from integer tree budgets"),
    ("acceptance_profile", [1.2, 1.4], "expected a mapping from integer tree budgets"),
])
def test_config_field_of_the_wrong_form_names_the_field_and_the_expected_form(tmp_path, drafter, field, value, form):
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"TreeSparkConfig.{field}=.* is invalid: {form}"):
        AutoModel.from_pretrained(tmp_path)
    with pytest.raises(OSError, match=f"{tmp_path}.*TreeSparkConfig.{field}=.* is invalid: {form}"):
        TreeSparkDrafter.from_pretrained(tmp_path)


def test_integer_like_config_values_are_accepted():
    import numpy as np

    config = TreeSparkConfig(target_layer_ids=[np.int64(1), torch.tensor(8)], acceptance_profile={8: 1.5, "16": 2})
    assert config.target_layer_ids == [1, 8] and all(type(i) is int for i in config.target_layer_ids)
    assert config.acceptance_profile == {"8": 1.5, "16": 2.0}


def test_misshaped_weight_is_refused(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["layers.1.mlp.up_proj.weight"] = torch.zeros(32, H)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match=str(tmp_path)):
        AutoModel.from_pretrained(tmp_path)


def test_missing_and_unexpected_weights_are_refused(tmp_path, drafter):
    save_drafter(drafter, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["norm.weight"]
    weights["extra.weight"] = torch.zeros(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match="norm.weight"):
        AutoModel.from_pretrained(tmp_path)


# ----- DSpark conversion -----------------------------------------------------------------------------------
def dspark_keys(num_layers: int) -> set[str]:
    """State-dict keys of DeepSpec's `Qwen3DSparkModel` (vanilla Markov head, confidence head with Markov)."""
    keys = {"embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
            "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias"}
    for i in range(num_layers):
        keys |= {f"layers.{i}.self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "q_norm", "k_norm")}
        keys |= {f"layers.{i}.mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")}
        keys |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    return keys


def dspark_config(drafter) -> dict:
    """A DSpark `config.json` as DeepSpec writes it: the target's Qwen3 config + the DSpark fields."""
    cfg = drafter.config
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": 32768, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers, "num_target_layers": TARGET_LAYERS,
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids), "num_anchors": 512, "enable_confidence_head": True,
        "confidence_head_with_markov": True, "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
    }


def dspark_state_dict(drafter, target) -> dict[str, torch.Tensor]:
    """DSpark tensors named as DeepSpec names them, taken from `drafter`, plus the target's embeddings/head."""
    ours = drafter.state_dict()
    state = {k: ours[k].clone() for k in dspark_keys(drafter.config.num_hidden_layers) if k in ours}
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    state["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    return state


def test_dspark_state_dict_has_the_published_layout(drafter, target):
    cfg = drafter.config
    state = dspark_state_dict(drafter, target)
    assert set(state) == dspark_keys(cfg.num_hidden_layers)  # every DSpark key exists in our drafter by name
    r, t = cfg.markov_rank, cfg.num_target_features
    assert state["fc.weight"].shape == (H, t * H)
    assert state["markov_head.markov_w1.weight"].shape == (V, r)
    assert state["markov_head.markov_w2.weight"].shape == (V, r)
    assert state["confidence_head.proj.weight"].shape == (1, H + r)
    assert state["layers.0.self_attn.q_norm.weight"].shape == (cfg.head_dim,)


def test_load_dspark_state_dict_reproduces_the_source_drafter(drafter, target, input_ids):
    want = draft_outputs(drafter, target, input_ids)
    loaded = load_dspark_checkpoint(state_dict=dspark_state_dict(drafter, target), config=dspark_config(drafter),
                                    target_name_or_path=TARGET_NAME)
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids
    assert loaded.config.target_name_or_path == TARGET_NAME
    assert_same_outputs(draft_outputs(loaded, target, input_ids), want)


def test_load_dspark_keeps_checkpoint_dtype(drafter, target):
    state = {k: v.to(torch.bfloat16) for k, v in dspark_state_dict(drafter, target).items()}
    loaded = load_dspark_checkpoint(state_dict=state, config=dspark_config(drafter))
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.markov_head.markov_w2.weight, state["markov_head.markov_w2.weight"])


def test_export_then_load_dspark_round_trips(tmp_path, drafter, target, input_ids):
    want = draft_outputs(drafter, target, input_ids)
    export_dspark_checkpoint(drafter, target, tmp_path)

    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    stored = load_file(tmp_path / "model.safetensors")
    assert set(stored) == dspark_keys(drafter.config.num_hidden_layers)
    assert torch.equal(stored["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(stored["lm_head.weight"], target.get_output_embeddings().weight)
    config = json.loads((tmp_path / "config.json").read_text())
    expected = dspark_config(drafter)
    assert {k: config[k] for k in expected} == expected

    loaded = load_dspark_checkpoint(tmp_path)
    for field in ("target_name_or_path", "tree_topk", "tree_frontier", "tree_budget", "block_size", "head_dim"):
        assert getattr(loaded.config, field) == getattr(drafter.config, field), field
    assert_same_outputs(draft_outputs(loaded, target, input_ids), want)


def test_load_dspark_reads_sharded_checkpoints(tmp_path, drafter, target, input_ids):
    state = dspark_state_dict(drafter, target)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(dspark_config(drafter)))
    loaded = load_dspark_checkpoint(tmp_path)
    assert_same_outputs(draft_outputs(loaded, target, input_ids), draft_outputs(drafter, target, input_ids))


def test_dspark_config_conversion_round_trips(drafter):
    back = dspark_config_to_treespark(treespark_config_to_dspark(drafter.config))
    assert config_fields(back) == config_fields(drafter.config)


def test_dspark_config_reads_legacy_top_level_rope_theta(drafter):
    cfg = dspark_config(drafter)
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 1234567.0
    cfg["rope_scaling"] = None
    assert dspark_config_to_treespark(cfg).rope_theta == 1234567.0


@pytest.mark.parametrize(("change", "message"), [
    ({"markov_head_type": "gated"}, "markov_head_type='gated'"),
    ({"markov_head_type": "rnn"}, "markov_head_type='rnn'"),
    ({"markov_rank": 0}, "markov_rank=0"),
    ({"confidence_head_with_markov": False}, "confidence_head_with_markov"),
    ({"mask_token_id": None}, "mask_token_id"),
    ({"target_layer_ids": [-1, 1]}, "target_layer_ids"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"num_target_layers": None}, "num_target_layers"),
])
def test_load_dspark_refuses_unsupported_configs(drafter, target, change, message):
    config = dspark_config(drafter) | change
    with pytest.raises(DSparkConversionError, match=message):
        load_dspark_checkpoint(state_dict=dspark_state_dict(drafter, target), config=config)


def test_load_dspark_refuses_gated_markov_weights(drafter, target):
    state = dspark_state_dict(drafter, target)
    state["markov_head.gate_proj.weight"] = torch.zeros(16, H + 16)
    with pytest.raises(DSparkConversionError, match="gated/rnn Markov head"):
        load_dspark_checkpoint(state_dict=state, config=dspark_config(drafter))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.pop("layers.1.mlp.up_proj.weight"), r"missing \['layers.1.mlp.up_proj.weight'\]"),
    (lambda s: s.update({"layers.2.mlp.up_proj.weight": torch.zeros(64, H)}), "unexpected"),
    (lambda s: s.update({"fc.weight": torch.zeros(H, H)}), r"wrong shapes \['fc.weight: \(64, 64\)"),
    (lambda s: s.update({"lm_head.weight": torch.zeros(V - 1, H)}), "lm_head.weight has shape"),
])
def test_load_dspark_refuses_mismatched_weights(drafter, target, edit, message):
    state = dspark_state_dict(drafter, target)
    edit(state)
    with pytest.raises(DSparkConversionError, match=message):
        load_dspark_checkpoint(state_dict=state, config=dspark_config(drafter))


def test_load_dspark_refuses_truncated_file(tmp_path, drafter, target):
    export_dspark_checkpoint(drafter, target, tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(OSError, match=str(weights)):
        load_dspark_checkpoint(tmp_path)


def test_load_dspark_refuses_directory_without_weights(tmp_path, drafter):
    (tmp_path / "config.json").write_text(json.dumps(dspark_config(drafter)))
    with pytest.raises(OSError, match="no model.safetensors"):
        load_dspark_checkpoint(tmp_path)


def test_export_dspark_refuses_learned_mask_embedding(tmp_path, target):
    learned_mask = tiny_drafter(target, mask_token_id=None)
    with pytest.raises(DSparkConversionError, match="learned mask embedding"):
        export_dspark_checkpoint(learned_mask, target, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("option", ["anchor_features", "normalize_features"])
def test_export_dspark_refuses_anchor_and_normalized_features(tmp_path, target, option):
    with_option = tiny_drafter(target, **{option: True})
    with pytest.raises(DSparkConversionError, match=f"{option}=True"):
        export_dspark_checkpoint(with_option, target, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_export_dspark_refuses_a_target_that_does_not_fit(tmp_path, drafter):
    other = Qwen3ForCausalLM(Qwen3Config(vocab_size=V + 8, hidden_size=H, intermediate_size=32,
                                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="vocabulary size"):
        export_dspark_checkpoint(drafter, other, tmp_path)



def test_plain_save_pretrained_writes_a_card_so_push_to_hub_uploads_one(tmp_path, drafter):
    drafter.save_pretrained(tmp_path / "plain")
    card = (tmp_path / "plain" / "README.md").read_text()
    assert "treespark" in card.lower() and "assistant_model" in card


def disk_full(monkeypatch, free: int, error: int = errno.ENOSPC) -> None:
    """transformers' weights writer fails with `error` (by default as on a full disk), and every disk reports `free`
    bytes free."""
    import transformers.modeling_utils

    def write(*args, **kwargs):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", write)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12 - free, free=free))


@pytest.mark.parametrize("with_datastore", [False, True])
def test_a_full_disk_while_saving_names_the_directory_the_bytes_needed_and_the_space_free(tmp_path, monkeypatch,
                                                                                         target, with_datastore):
    """A full disk used to end in a bare `[Errno 28] No space left on device`."""
    from safetensors.numpy import load_file as load_numpy

    from hf_treespark.sources.datastore import DATASTORE_FILE, Datastore

    drafter = tiny_drafter(target)
    needed = sum(t.numel() * t.element_size() for t in drafter.state_dict().values())
    if with_datastore:
        drafter.datastore = Datastore.build([list(range(5, 200)), list(range(7, 90))], V)
        stored = drafter.datastore.save(tmp_path / "store")
        assert stored.name == DATASTORE_FILE
        needed += sum(array.nbytes for array in load_numpy(stored).values())
    disk_full(monkeypatch, free=1234)
    with pytest.raises(OSError) as raised:
        drafter.save_pretrained(tmp_path / "out")
    err = raised.value
    assert err.errno == errno.ENOSPC and isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
    assert str(tmp_path / "out") in str(err) and f"needs {needed} bytes" in str(err), str(err)
    assert "1234 bytes (1.2 KiB) are free there" in str(err) and "another directory" in str(err), str(err)


def test_an_error_other_than_a_full_disk_while_saving_is_left_as_it_is(tmp_path, monkeypatch, drafter):
    disk_full(monkeypatch, free=1234, error=errno.EACCES)
    with pytest.raises(PermissionError) as raised:
        drafter.save_pretrained(tmp_path / "out")
    assert raised.value.__cause__ is None and "bytes" not in str(raised.value)


@pytest.mark.parametrize("recorded", ["SmolLM2-135M-Instruct", "/root/.cache/hf_treespark/smollm2-135m-instruct"])
def test_model_card_names_the_default_target_by_its_hub_id_with_license_and_no_pipeline_tag(target, recorded):
    card = model_card(tiny_drafter(target, target_name_or_path=recorded), repo_id="me/drafter")
    meta = front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["license"] == "apache-2.0" and "pipeline_tag" not in meta  # a drafter cannot generate alone
    assert 'AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in card
    assert '"SmolLM2-135M-Instruct"' not in card  # never the bare local name where a Hub id belongs


# ----- dtype on save ------------------------------------------------------------------------------------
def stored_dtypes(directory) -> set[torch.dtype]:
    return {t.dtype for t in load_file(directory / "model.safetensors").values()}


def test_save_keeps_the_dtype_the_weights_were_stored_in(tmp_path, target):
    tiny_drafter(target).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = TreeSparkDrafter.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    assert loaded.dtype == torch.float32
    loaded.save_pretrained(tmp_path / "again")
    assert stored_dtypes(tmp_path / "again") == {torch.bfloat16}
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"
    size = os.path.getsize(tmp_path / "again" / "model.safetensors")
    assert abs(size - os.path.getsize(tmp_path / "bf16" / "model.safetensors")) < 4096
    assert loaded.dtype == torch.float32 and loaded.config.dtype == torch.float32  # the model in memory is untouched
    assert_same_outputs(load_file(tmp_path / "again" / "model.safetensors"),
                        load_file(tmp_path / "bf16" / "model.safetensors"))

    loaded.save_pretrained(tmp_path / "asked", dtype=torch.float32)  # the caller asks otherwise
    assert stored_dtypes(tmp_path / "asked") == {torch.float32}

    with torch.no_grad():  # a weight that bfloat16 cannot hold (e.g. after fine-tuning): never rounded silently
        loaded.fc.weight[0, 0] = 1.0 + 2.0**-12
    loaded.save_pretrained(tmp_path / "tuned")
    assert stored_dtypes(tmp_path / "tuned") == {torch.float32}
    assert TreeSparkDrafter.from_pretrained(tmp_path / "tuned").fc.weight[0, 0].item() == 1.0 + 2.0**-12


@pytest.mark.slow
def test_default_drafter_saved_as_float32_in_memory_keeps_its_bfloat16_file(tmp_path):
    from hf_treespark.hub import assets

    drafter = assets.load_default_drafter()  # float32 in memory
    drafter.save_pretrained(tmp_path)
    shipped = assets.DEFAULT_DRAFTER_DIR / "model.safetensors"
    floating = {d for d in stored_dtypes(tmp_path) if d.is_floating_point}  # draft_vocab_ids is an int64 buffer
    assert stored_dtypes(tmp_path) == stored_dtypes(assets.DEFAULT_DRAFTER_DIR) and floating == {torch.bfloat16}
    assert abs(os.path.getsize(tmp_path / "model.safetensors") - os.path.getsize(shipped)) < 64 * 1024
    assert_same_outputs(load_file(tmp_path / "model.safetensors"), load_file(shipped))


# ----- remote code without the package: a clear error, and custom_generate/ ---------------------------------
NO_PACKAGE_SCRIPT = textwrap.dedent("""
    import json, sys
    try:
        import hf_treespark  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"hf_treespark is importable in this environment: {hf_treespark.__file__}")
    import torch
    from transformers import AutoModel, Qwen3ForCausalLM

    drafter_dir, target_dir, out_file = sys.argv[1:4]
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True).eval()
    target = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    result = {"module": type(drafter).__module__, "drafter_has_generate": hasattr(drafter, "generate")}
    try:
        target.generate(ids, assistant_model=drafter, max_new_tokens=4)
    except Exception as err:
        result["assisted_error"] = f"{type(err).__name__}: {err}"
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, custom_generate=drafter_dir,
                          trust_remote_code=True, return_dict_in_generate=True)
    result["plain"], result["tree"] = plain[0].tolist(), out.sequences[0].tolist()
    result["rounds"], result["loop_module"] = len(out.rounds), type(out).__module__
    result["datastore"] = type(getattr(drafter, "datastore", None)).__module__
    result["datastore_accepted"] = sum(r.datastore_accepted for r in out.rounds)
    json.dump(result, open(out_file, "w"))
""")


@pytest.fixture(scope="module")
def package_free_python(tmp_path_factory) -> str:
    """A virtual environment with this interpreter's torch and transformers but without hf_treespark.

    A fresh venv (no system site-packages) whose one `.pth` line puts the project venv's site-packages
    on `sys.path`. Python runs `.pth` files only in site directories, so the editable install's finder
    hook in that directory never runs: `import hf_treespark` fails as it would for a user who never
    installed it (the test runs with another working directory, so the checkout is not on the path).
    """
    import sysconfig

    root = tmp_path_factory.mktemp("nopkg") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = str(root / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_remote_code_without_the_package_says_what_to_install_and_custom_generate_decodes(
        tmp_path, drafter, target, package_free_python):
    from hf_treespark.sources.datastore import Datastore

    plain = target.generate(torch.tensor([[1, 5, 9, 17, 33]]), do_sample=False, max_new_tokens=30)
    drafter.datastore = Datastore.build([plain[0].tolist()], drafter.config.target_vocab_size)  # travels along
    save_drafter(drafter, tmp_path / "drafter")
    drafter.datastore = None
    target.save_pretrained(tmp_path / "target")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([package_free_python, "-c", NO_PACKAGE_SCRIPT, str(tmp_path / "drafter"),
                           str(tmp_path / "target"), str(tmp_path / "out.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["module"].startswith("transformers_modules")
    assert not result["drafter_has_generate"]  # custom_generate/ does not replace anything on the drafter
    assert result["assisted_error"].startswith("AttributeError: transformers' assisted decoding reached a TreeSpark")
    assert "pip install hf_treespark" in result["assisted_error"] and "custom_generate=" in result["assisted_error"]
    assert result["tree"] == result["plain"] and result["rounds"] > 0
    assert result["loop_module"].startswith("transformers_modules") and "custom_generate" in result["loop_module"]
    assert result["datastore"].startswith("transformers_modules") and result["datastore_accepted"] > 0


def test_custom_generate_folder_holds_every_module_it_imports(tmp_path, drafter):
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    from hf_treespark.hub.card import custom_generate_modules

    drafter.save_pretrained(tmp_path)
    folder = tmp_path / "custom_generate"
    assert sorted(p.name for p in folder.iterdir()) == custom_generate_modules()
    needed = get_relative_import_files(folder / "generate.py")
    assert all(Path(f).is_file() for f in needed), [f for f in needed if not Path(f).is_file()]
    # the computed set is exactly what transformers follows from generate.py: nothing missing, nothing extra
    assert sorted({Path(f).name for f in needed} | {"generate.py"}) == custom_generate_modules()
    for source in folder.iterdir():  # what transformers' check_imports asks the environment for
        outside = {name for name in get_imports(source) if name not in sys.stdlib_module_names}
        # tqdm, numpy, safetensors and filelock (through huggingface_hub): dependencies of transformers itself
        allowed = {"torch", "transformers", "tqdm", "numpy", "safetensors", "filelock"}
        assert outside <= allowed, (source.name, outside)


def test_custom_generate_recipe_with_the_package_imported_equals_plain_greedy(tmp_path, drafter, target):
    save_drafter(drafter, tmp_path / "drafter")
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=16)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                          custom_generate=str(tmp_path / "drafter"), trust_remote_code=True)
    assert torch.equal(out, plain)


def test_custom_generate_recipe_refuses_to_run_as_the_drafters_own_generate(drafter, target):
    from hf_treespark.hub.custom_generate import generate

    with pytest.raises(RuntimeError, match="call it from the target"):
        generate(model=drafter, assistant_model=drafter)
    with pytest.raises(ValueError, match="needs the drafter too: pass assistant_model="):
        generate(model=target, inputs=torch.tensor([[1, 2]]))


def test_plain_assisted_path_without_the_routing_names_the_package(drafter, target, monkeypatch):
    from transformers import GenerationMixin

    from hf_treespark.decoding import integration

    monkeypatch.setattr(GenerationMixin, "generate", integration._ORIGINAL_GENERATE)  # as if never imported
    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", integration._ORIGINAL_CANDIDATE_GENERATOR)
    with pytest.raises(AttributeError, match=r"pip install hf_treespark\) and `import hf_treespark`"):
        target.generate(torch.tensor([[1, 5, 9]]), assistant_model=drafter, max_new_tokens=4)
