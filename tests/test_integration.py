"""TreeSpark inside transformers' own clients: pipelines, stop strings, assisted-decoding knobs."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_drafter, make_target
from transformers import GenerationConfig, pipeline

from hf_treespark.decoding import integration
from hf_treespark.hub import assets

PROMPT = "List the planets of the solar system, one per line."


@pytest.fixture(scope="module")
def real():
    """The offline default target, its tokenizer and the shipped drafter (real text, real stop strings)."""
    target, tokenizer = assets.load_default_target(dtype=torch.float32)  # strict equality: float32
    return target, tokenizer, assets.load_default_drafter()


@pytest.mark.slow
def test_pipeline_built_with_the_drafter_and_called_with_it_equal_plain_greedy(real):
    target, tokenizer, drafter = real
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    built = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    assert built.assistant_model is drafter and built.assistant_tokenizer is None
    args = {"max_new_tokens": 24, "do_sample": False, "return_full_text": False}
    reference = plain(PROMPT, **args)[0]["generated_text"]
    assert built(PROMPT, **args)[0]["generated_text"] == reference
    assert plain(PROMPT, assistant_model=drafter, **args)[0]["generated_text"] == reference


@pytest.mark.slow
def test_a_batched_pipeline_with_the_drafter_equals_the_plain_batched_pipeline(real):
    target, tokenizer, drafter = real
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path, padding_side="left")
    prompts = [PROMPT, "What is 2 + 2?", "Write a haiku about the sea.", "Name three colours."]
    args = {"max_new_tokens": 16, "do_sample": False, "return_full_text": False, "batch_size": 4}
    reference = pipeline("text-generation", model=target, tokenizer=tokenizer)(prompts, **args)
    built = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    rows = []
    handle = target.register_forward_pre_hook(lambda module, a, kw: rows.append(kw["input_ids"].shape[0]),
                                              with_kwargs=True)
    try:
        assert built(prompts, **args) == reference
    finally:
        handle.remove()
    assert rows[0] == 4  # the four prompts were decoded as one batch


@pytest.mark.slow
def test_pipeline_loads_a_drafter_given_as_a_directory(real, tmp_path):
    target, tokenizer, drafter = real
    drafter.save_pretrained(tmp_path / "drafter")
    built = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=str(tmp_path / "drafter"))
    assert built.assistant_model.config.model_type == "treespark"
    args = {"max_new_tokens": 12, "do_sample": False, "return_full_text": False}
    reference = pipeline("text-generation", model=target, tokenizer=tokenizer)(PROMPT, **args)
    assert built(PROMPT, **args) == reference


@pytest.mark.slow
@pytest.mark.parametrize("stop", [["Mars"], ["\n\n", "Earth"]])
def test_stop_strings_end_where_plain_greedy_ends(real, stop):
    target, tokenizer, drafter = real
    inputs = assets.chat_inputs(tokenizer, PROMPT)
    args = {"max_new_tokens": 60, "do_sample": False, "stop_strings": stop, "tokenizer": tokenizer}
    reference = target.generate(**inputs, **args)
    assert reference.shape[1] < inputs["input_ids"].shape[1] + 60  # the stop string really ended it
    out = target.generate(**inputs, assistant_model=drafter, **args)
    assert torch.equal(out, reference)
    via_config = GenerationConfig(max_new_tokens=60, do_sample=False, stop_strings=stop)
    out = target.generate(**inputs, assistant_model=drafter, generation_config=via_config, tokenizer=tokenizer)
    assert torch.equal(out, reference)


def test_stop_strings_without_a_tokenizer_name_both_arguments(llama_pair):
    target, drafter = llama_pair
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer: pass tokenizer="):
        target.generate(torch.tensor([[1, 5, 9]]), assistant_model=drafter, stop_strings=["x"], max_new_tokens=4)


def test_assisted_decoding_knobs_are_ignored_with_one_warning_each(llama_pair, monkeypatch):
    target, drafter = llama_pair
    monkeypatch.setattr(integration, "_WARNED_IGNORED", set())
    ids = torch.tensor([[1, 5, 9, 17]])
    reference = target.generate(ids, do_sample=False, max_new_tokens=12)
    knobs = {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "heuristic",
             "assistant_confidence_threshold": 0.9, "prompt_lookup_num_tokens": 2}
    with pytest.warns(UserWarning) as caught:
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12, **knobs)
    assert torch.equal(out, reference)
    message = str(caught[0].message)
    assert all(name in message for name in knobs) and "ignores" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same knobs again: no second warning in this process
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12, **knobs)
    assert torch.equal(out, reference)
    config = GenerationConfig(do_sample=False, max_new_tokens=12, assistant_early_exit=2)
    with pytest.warns(UserWarning, match="assistant_early_exit"):
        out = target.generate(ids, assistant_model=drafter, generation_config=config)
    assert torch.equal(out, reference)
    assert config.assistant_early_exit == 2  # the caller's config is not modified


def test_no_warning_without_assisted_knobs(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    monkeypatch.setattr(integration, "_WARNED_IGNORED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        target.generate(torch.tensor([[1, 5, 9]]), assistant_model=drafter, do_sample=False, max_new_tokens=6,
                        generation_config=GenerationConfig(do_sample=False, max_new_tokens=6))


def test_generate_names_an_assistant_model_that_is_not_a_model(llama_pair, tmp_path):
    target, drafter = llama_pair
    ids = torch.tensor([[1, 5, 9]])
    with pytest.raises(TypeError, match=r"assistant_model=123 \(int\) is not a model: pass a TreeSpark drafter"):
        target.generate(ids, assistant_model=123, max_new_tokens=4)
    missing = str(tmp_path / "no_drafter_here")
    with pytest.raises(TypeError, match=f"assistant_model='{missing}': no such directory"):
        target.generate(ids, assistant_model=missing, max_new_tokens=4)
    drafter.save_pretrained(tmp_path / "drafter")
    with pytest.raises(TypeError, match=r"is a path: generate\(\) takes the drafter itself.*from_pretrained"):
        target.generate(ids, assistant_model=tmp_path / "drafter", max_new_tokens=4)


def test_a_pipeline_names_an_assistant_model_that_is_not_a_model_or_a_directory(llama_pair, tmp_path):
    from transformers import AutoTokenizer

    target, _ = llama_pair
    tokenizer = AutoTokenizer.from_pretrained(assets.default_target_path())
    with pytest.raises(TypeError, match=r"assistant_model=123 \(int\) is not a model.*directory or Hub repo id"):
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=123)
    missing = str(tmp_path / "no_drafter_here")
    with pytest.raises(FileNotFoundError, match=f"assistant_model='{missing}': no such directory"):
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=missing)


@pytest.mark.parametrize("damage", [
    ("generate.py", "def generate(model, **kwargs:\n", "is not valid Python"),
    ("engine.py", "\x00", "is not valid Python"),
    ("generate.py", "x = 1\n", "defines no generate"),
    ("generate.py", None, "is missing"),
])
def test_a_damaged_custom_generate_folder_is_named_with_what_to_do(llama_pair, tmp_path, damage):
    target, drafter = llama_pair
    name, text, problem = damage
    drafter.save_pretrained(tmp_path / "drafter")
    path = tmp_path / "drafter" / "custom_generate" / name
    if text is None:
        path.unlink()
    else:
        path.write_text(text)
    with pytest.raises(ValueError, match=rf"custom_generate/{name}.*{problem}.*save_pretrained"):
        target.generate(torch.tensor([[1, 5, 9]]), assistant_model=drafter, max_new_tokens=4,
                        custom_generate=str(tmp_path / "drafter"), trust_remote_code=True)


@pytest.mark.parametrize("with_drafter", [True, False])
@pytest.mark.parametrize("given", ["./no/such/dir", "../no/such/dir", "absolute", "~/no/such/dir", "no/such/dir"])
def test_a_custom_generate_directory_that_does_not_exist_is_named_with_what_to_pass(llama_pair, tmp_path, monkeypatch,
                                                                                   given, with_drafter):
    """A missing local directory used to reach the Hub client, which refused it as a repo id (HFValidationError)."""
    target, drafter = llama_pair
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = str(tmp_path / "no" / "such" / "dir") if given == "absolute" else given
    assistant = {"assistant_model": drafter} if with_drafter else {}
    with pytest.raises(FileNotFoundError) as raised:
        target.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, custom_generate=path, trust_remote_code=True,
                        **assistant)
    message = str(raised.value)
    assert f"custom_generate={path!r}: no such directory" in message, message
    assert "custom_generate/generate.py" in message and "Hub repo id" in message, message


def test_a_custom_generate_hub_repo_id_or_existing_directory_goes_to_transformers_as_given(llama_pair, tmp_path,
                                                                                         monkeypatch):
    """Only a missing local path is refused: a repo id, or a directory that exists, reaches transformers' own
    `generate` with every argument as given."""
    import functools

    target, _ = llama_pair
    calls = []

    @functools.wraps(integration._ORIGINAL_GENERATE)
    def original(self, *args, **kwargs):
        calls.append(kwargs)
        return "transformers"

    monkeypatch.setattr(integration, "_ORIGINAL_GENERATE", original)
    (tmp_path / "recipe" / "custom_generate").mkdir(parents=True)
    for custom in ("org/name", "name", str(tmp_path / "recipe")):
        assert target.generate(torch.tensor([[1]]), custom_generate=custom, trust_remote_code=True) == "transformers"
        assert calls.pop() == {"custom_generate": custom, "trust_remote_code": True}


# ----- turning the routing off: hf_treespark.uninstall() and HF_TREESPARK_NO_PATCH ---------------------------------

@pytest.fixture
def routed_again():
    """Whatever a test does to the routing, the next test finds it installed, as `import hf_treespark` left it."""
    yield
    integration.install()


def _transformers_own() -> dict:
    from transformers import GenerationMixin
    from transformers.pipelines import base

    return {"generate": GenerationMixin.generate, "candidates": GenerationMixin._get_candidate_generator,
            "pipeline loader": base.load_assistant_model}


def test_uninstall_puts_transformers_own_functions_back_and_install_routes_again(llama_pair, routed_again):
    import hf_treespark
    from hf_treespark.drafter.modeling import NEEDS_PACKAGE

    target, drafter = llama_pair
    ids = torch.tensor([[1, 5, 9, 17]])
    routed = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    plain = target.generate(ids, do_sample=False, max_new_tokens=12)
    assert torch.equal(routed, plain)  # float32: exact
    hf_treespark.uninstall()
    hf_treespark.uninstall()  # idempotent
    assert _transformers_own() == {"generate": integration._ORIGINAL_GENERATE,
                                   "candidates": integration._ORIGINAL_CANDIDATE_GENERATOR,
                                   "pipeline loader": integration._ORIGINAL_LOAD_ASSISTANT_MODEL}
    assert integration._ORIGINAL_GENERATE.__module__ == "transformers.generation.utils"
    with pytest.raises(AttributeError) as refused:  # transformers' assisted decoding cannot use a tree drafter
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    assert str(refused.value) == NEEDS_PACKAGE
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=12), plain)  # transformers' own path
    assert torch.equal(hf_treespark.generate(target, drafter, ids, do_sample=False, max_new_tokens=12), plain)
    hf_treespark.install()
    assert _transformers_own()["generate"] is integration._generate
    assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12), plain)


def test_without_the_routing_a_saved_drafters_custom_generate_still_decodes(llama_pair, tmp_path, routed_again):
    import hf_treespark

    target, drafter = llama_pair
    drafter.save_pretrained(tmp_path / "drafter")
    ids = torch.tensor([[1, 5, 9, 17]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=12)
    hf_treespark.uninstall()
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12,
                          return_dict_in_generate=True, custom_generate=str(tmp_path / "drafter"),
                          trust_remote_code=True)
    assert torch.equal(out.sequences, plain) and len(out.rounds) > 0  # tree decoding, by the drafter's own recipe


_IMPORT = """
import hf_treespark
from transformers import AutoConfig, GenerationMixin
from transformers.pipelines import base
from hf_treespark.decoding import integration
print("routed", GenerationMixin.generate is integration._generate, "loader",
      base.load_assistant_model is integration._load_assistant_model, "registered",
      AutoConfig.for_model("treespark").model_type)
"""


@pytest.mark.parametrize(("value", "routed"), [("1", False), ("yes", False), ("0", True), ("", True)])
def test_hf_treespark_no_patch_keeps_transformers_untouched_at_import(value, routed):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_TREESPARK_NO_PATCH": value}
    done = subprocess.run([sys.executable, "-c", _IMPORT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"routed {routed} loader {routed} registered treespark"


def test_the_generate_function_documents_every_tree_knob():
    """`hf_treespark.generate`'s docstring names every `tree_*` keyword the loop takes (the list cannot drift)."""
    import inspect

    import hf_treespark
    from hf_treespark.decoding.generation import treespark_decoding
    from hf_treespark.decoding.integration import TREE_KWARGS

    taken = [name for name in inspect.signature(treespark_decoding).parameters if name.startswith("tree_")]
    assert set(taken) == set(TREE_KWARGS)
    assert not [name for name in taken if f"`{name}`" not in hf_treespark.generate.__doc__]


def test_the_api_page_names_every_exported_name():
    """docs/api.md lists `hf_treespark.__all__`: the public API is the package's `__init__` and that page."""
    from pathlib import Path

    import hf_treespark

    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    assert not [name for name in hf_treespark.__all__ if f"`{name}`" not in page]
