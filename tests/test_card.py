"""The model card (`hf_treespark.hub.card`) and what a push uploads: `drafter.push_to_hub()` carries the same card,
metadata and files as `treespark push` (`hub.push_drafter_to_hub`). No network: the Hub calls are captured."""

from __future__ import annotations

import ast
from pathlib import Path

import huggingface_hub
import pytest
import safetensors.torch
import torch
from huggingface_hub import ModelCard
from test_hub import TARGET_NAME, front_matter, tiny_drafter, tiny_target

from hf_treespark import TreeSparkDrafter
from hf_treespark.hub import card
from hf_treespark.hub.sharing import push_drafter_to_hub, save_drafter
from hf_treespark.sources.datastore import Datastore


@pytest.fixture(scope="module")
def target():
    return tiny_target()


class FakeHub:
    """`HfApi`'s calls that an upload makes, captured: each commit as `{path in repo: bytes}`."""

    def __init__(self, monkeypatch):
        self.commits: list[dict[str, bytes]] = []
        self.repos: list[tuple[str, dict]] = []
        self.branches: list[str] = []
        self.messages: list[str | None] = []
        hub = self

        def create_repo(api, repo_id, **kwargs):  # as the Hub, which puts a bare name in the token's account
            hub.repos.append((repo_id, kwargs))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'me/' + repo_id}")

        def upload_folder(api, *, repo_id, folder_path, commit_message=None, **kwargs):
            root = Path(folder_path)
            hub.commits.append({p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
                                if p.is_file()})
            hub.messages.append(commit_message)
            return "commit-info"

        def create_commit(api, repo_id, operations, commit_message=None, **kwargs):  # transformers' own upload
            hub.commits.append({op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations})
            hub.messages.append(commit_message)
            return "commit-info"

        def create_branch(api, repo_id, *, branch, **kwargs):
            hub.branches.append(branch)

        def no_remote_card(*args, **kwargs):  # transformers asks the Hub for the repo's card first
            raise huggingface_hub.errors.EntryNotFoundError("no card")

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
        monkeypatch.setattr(huggingface_hub.ModelCard, "load", no_remote_card)


def test_push_to_hub_uploads_the_card_metadata_and_files_that_treespark_push_does(monkeypatch, target):
    hub = FakeHub(monkeypatch)
    drafter = tiny_drafter(target, acceptance_profile={"8": 1.7})
    drafter.datastore = Datastore.build([list(range(5, 60))], drafter.config.target_vocab_size)

    assert drafter.push_to_hub("me/tiny-drafter") == "commit-info"
    push_drafter_to_hub(drafter, "me/tiny-drafter")  # what `treespark push` does
    python_api, cli = hub.commits

    assert set(python_api) == set(cli)
    assert {"README.md", "config.json", "model.safetensors", "datastore.safetensors", "custom_generate/generate.py",
            "custom_generate/modeling.py", "modeling.py", "configuration.py"} <= set(python_api)
    readme = python_api["README.md"].decode()
    assert readme == cli["README.md"].decode()
    assert "Model Card for Model ID" not in readme
    assert readme.startswith("---\n") and "# TreeSpark drafter for tiny-org/tiny-qwen3" in readme
    assert front_matter(readme) == {"library_name": "transformers", "license": "apache-2.0", "base_model": TARGET_NAME,
                                    "tags": ["hf_treespark", "treespark", "speculative-decoding", "drafter"]}
    assert 'AutoModel.from_pretrained("me/tiny-drafter")' in readme and "| 8 | 1.70 |" in readme
    assert python_api["model.safetensors"] == cli["model.safetensors"]
    assert python_api["config.json"] == cli["config.json"]
    stores = [safetensors.torch.load(commit["datastore.safetensors"]) for commit in (python_api, cli)]
    assert stores[0].keys() == stores[1].keys() and all(torch.equal(stores[0][k], stores[1][k]) for k in stores[0])


def test_push_to_hub_keeps_the_card_of_the_drafters_directory_and_takes_the_hub_options(tmp_path, monkeypatch,
                                                                                         target):
    hub = FakeHub(monkeypatch)
    tiny_drafter(target).save_pretrained(tmp_path / "final")
    (tmp_path / "final" / "README.md").write_text("---\nlicense: mit\n---\n\n# Mine\n\n"
                                                 'AutoModel.from_pretrained("path/or/repo-id-of-this-drafter")\n')
    drafter = TreeSparkDrafter.from_pretrained(tmp_path / "final")

    drafter.push_to_hub("me/mine", commit_message="v2", revision="dev", tags=["my-tag"])
    readme = hub.commits[0]["README.md"].decode()
    assert "# Mine" in readme and 'AutoModel.from_pretrained("me/mine")' in readme
    assert ModelCard(readme).data.to_dict() == {"license": "mit", "tags": ["my-tag"]}
    assert hub.messages == ["v2"] and hub.branches == ["dev"]
    with pytest.raises(TypeError, match="not_an_option"):
        drafter.push_to_hub("me/mine", not_an_option=True)


def test_save_pretrained_with_push_to_hub_uploads_the_treespark_card(tmp_path, monkeypatch, target):
    hub = FakeHub(monkeypatch)
    tiny_drafter(target).save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="me/out")
    readme = hub.commits[0]["README.md"].decode()
    assert readme == (tmp_path / "out" / "README.md").read_text()
    assert "TreeSpark drafter" in readme and "Model Card for Model ID" not in readme
    assert "custom_generate/generate.py" in hub.commits[0] and [repo for repo, _ in hub.repos] == ["me/out"]


def test_the_card_metadata_is_modelcarddata_and_the_body_is_unchanged(target):
    drafter = tiny_drafter(target, target_name_or_path="SmolLM2-135M-Instruct")
    text = card.model_card(drafter, repo_id="me/drafter")
    parsed = ModelCard(text)
    assert parsed.data.to_dict() == card.card_data(drafter.config).to_dict()
    assert parsed.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert text.startswith("---\nlibrary_name: transformers\nlicense: apache-2.0\n"
                           "tags:\n- hf_treespark\n- treespark\n- speculative-decoding\n- drafter\n"
                           "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n---\n\n# TreeSpark drafter for ")
    assert card.card_data(tiny_drafter(target, target_name_or_path="/local/dir").config).base_model is None


def test_the_card_is_built_from_small_section_functions():
    tree = ast.parse(Path(card.__file__).read_text())
    sizes = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
             if isinstance(node, ast.FunctionDef)}
    assert max(sizes.values()) <= 60, sizes
    assert sizes["model_card"] <= 30


def test_a_pushed_drafters_weights_round_trip(monkeypatch, target, tmp_path):
    hub = FakeHub(monkeypatch)
    drafter = tiny_drafter(target)
    drafter.push_to_hub("me/tiny")
    for name, data in hub.commits[0].items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    reloaded = TreeSparkDrafter.from_pretrained(tmp_path)
    for key, value in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


@pytest.mark.parametrize("repo_id", [None, "", 42])
@pytest.mark.parametrize("push", ["drafter.push_to_hub", "push_drafter_to_hub"])
def test_a_push_without_a_repo_id_is_refused_naming_repo_id_before_anything_is_saved(monkeypatch, target, push,
                                                                                      repo_id):
    """`push_to_hub(None)` used to end in a TypeError from deep inside the card's writer."""
    hub = FakeHub(monkeypatch)
    drafter = tiny_drafter(target)
    saves = []
    monkeypatch.setattr(TreeSparkDrafter, "save_pretrained", lambda self, *args, **kwargs: saves.append(args))
    call = drafter.push_to_hub if push == "drafter.push_to_hub" else lambda r: push_drafter_to_hub(drafter, r)
    with pytest.raises(ValueError, match=rf"repo_id.*'org/name'.*got {repo_id!r}") as raised:
        call(repo_id)
    assert push.split(".")[-1] in str(raised.value)
    assert not saves and not hub.repos and not hub.commits  # refused before the staging save and the Hub


def test_a_full_disk_while_a_push_stages_the_drafter_names_the_staging_directory_and_tmpdir(monkeypatch, target):
    """A push first saves the drafter into a temporary directory: on a full disk there, the error names that
    directory, what it needed and what was free, and TMPDIR (which moves it); nothing reaches the Hub."""
    import errno
    import tempfile

    from test_hub import disk_full

    hub = FakeHub(monkeypatch)
    drafter = tiny_drafter(target)
    needed = sum(t.numel() * t.element_size() for t in drafter.state_dict().values())
    disk_full(monkeypatch, free=99)
    with pytest.raises(OSError) as raised:
        drafter.push_to_hub("me/tiny")
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC and raised.value.__cause__.errno == errno.ENOSPC
    assert tempfile.gettempdir() in message and "TMPDIR" in message, message
    assert f"needs {needed} bytes" in message and "99 bytes are free there" in message, message
    assert not hub.repos and not hub.commits


@pytest.mark.parametrize("repo_id", [None, ""])
def test_the_training_push_helpers_refuse_a_missing_repo_id_naming_it(monkeypatch, target, tmp_path, repo_id):
    """`treespark train`'s push helpers: the check before training, and the push after it (which would otherwise
    report a failed upload to the repository None and a retry command with `--repo-id None`)."""
    from hf_treespark.training.push import check_push_target, push_trained_drafter

    hub = FakeHub(monkeypatch)
    with pytest.raises(ValueError, match=rf"--push-to-hub needs a Hub repository id.*got {repo_id!r}"):
        check_push_target(repo_id)
    with pytest.raises(ValueError, match=rf"push_drafter_to_hub needs repo_id.*'org/name'.*got {repo_id!r}"):
        push_trained_drafter(tiny_drafter(target), repo_id, tmp_path / "final")
    assert not hub.repos and not hub.commits


# ----- cards that stay true ---------------------------------------------------------------------------------------
TABLE = "| suite | acceptance length |\n|---|---|\n| MT-Bench | 2.10 |"


def test_a_push_reads_every_figure_of_a_saved_card_from_the_drafter_again(tmp_path, monkeypatch, target):
    """A card saved with the drafter goes stale when its datastore grows or `treespark calibrate` measures again; the
    push writes it from the drafter, keeping the measured table, a section the user added and their metadata."""
    hub = FakeHub(monkeypatch)
    drafter = tiny_drafter(target)
    drafter.datastore = Datastore.build([list(range(5, 60))], drafter.config.target_vocab_size)
    saved = tmp_path / "final"
    save_drafter(drafter, saved, acceptance_table=TABLE)
    stale = (saved / "README.md").read_text()
    assert ", 55 tokens" in stale and TABLE in stale
    card_text = stale.replace("tags:\n", "datasets:\n- my/answers\ntags:\n- my-tag\n") + "\n## Notes\n\nMine.\n"
    (saved / "README.md").write_text(card_text)

    grown = TreeSparkDrafter.from_pretrained(saved)  # the datastore grows and the profile is measured since
    grown.datastore = Datastore.build([list(range(5, 60)), list(range(70, 170))], drafter.config.target_vocab_size)
    grown.config.acceptance_profile = {"8": 2.25}
    grown.save_pretrained(saved)  # keeps the directory's card, as `treespark datastore` and calibrate leave it
    assert (saved / "README.md").read_text() == card_text
    grown.push_to_hub("me/tiny")

    pushed = hub.commits[0]["README.md"].decode()
    assert ", 155 tokens" in pushed and ", 55 tokens" not in pushed
    assert "| 8 | 2.25 |" in pushed and TABLE in pushed  # the new profile, the kept benchmark table
    assert pushed.rstrip().endswith("## Notes\n\nMine.")
    meta = front_matter(pushed)
    assert meta["datasets"] == ["my/answers"] and "my-tag" in meta["tags"] and "hf_treespark" in meta["tags"]
    assert meta["library_name"] == "transformers" and "pipeline_tag" not in meta
    assert 'AutoModel.from_pretrained("me/tiny")' in pushed and card.REPO_PLACEHOLDER not in pushed
    expected = ModelCard(card.model_card(grown, TABLE, "me/tiny")).text.rstrip("\n") + "\n\n## Notes\n\nMine.\n"
    assert ModelCard(pushed).text == expected  # the body a fresh save writes today, and the user's section


def test_a_users_own_card_is_pushed_as_written(tmp_path, monkeypatch, target):
    hub = FakeHub(monkeypatch)
    save_drafter(tiny_drafter(target), tmp_path / "final")
    own = "# Mine\n\nSee `path/or/repo-id-of-this-drafter`; 55 tokens of a datastore I describe myself.\n"
    (tmp_path / "final" / "README.md").write_text(own)
    TreeSparkDrafter.from_pretrained(tmp_path / "final").push_to_hub("me/mine")
    assert hub.commits[0]["README.md"].decode() == own.replace(card.REPO_PLACEHOLDER, "me/mine")


def test_the_shipped_drafters_card_body_is_what_a_push_writes_again():
    from hf_treespark.hub.assets import DEFAULT_DRAFTER_DIR

    shipped = (DEFAULT_DRAFTER_DIR / "README.md").read_text()
    drafter = TreeSparkDrafter.from_pretrained(DEFAULT_DRAFTER_DIR)
    assert card.written_here(shipped)
    fresh = card.fresh_card(drafter, shipped, card.REPO_PLACEHOLDER)
    assert ModelCard(fresh).text == ModelCard(shipped).text  # every figure on it is the drafter's own today


@pytest.mark.parametrize(("recorded", "expected"), [
    ("tiny-org/tiny-qwen3", "tiny-org/tiny-qwen3"),  # a Hub id
    ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),  # the offline default's local name
    ("my-target", None),  # a local directory's name
    ("/home/me/models/target", None),
    (None, None),
])
def test_base_model_is_the_targets_hub_id_when_known(target, recorded, expected):
    drafter = tiny_drafter(target, target_name_or_path=recorded)
    assert card.card_data(drafter.config).base_model == expected
    assert front_matter(card.model_card(drafter)).get("base_model") == expected


def test_a_local_directory_named_like_a_hub_id_is_no_base_model(tmp_path, monkeypatch, target):
    (tmp_path / "org" / "target").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert card.card_data(tiny_drafter(target, target_name_or_path="org/target").config).base_model is None


def test_the_base_model_given_names_the_target_on_the_card(tmp_path, monkeypatch, target):
    hub = FakeHub(monkeypatch)
    drafter = tiny_drafter(target, target_name_or_path="my-target")
    push_drafter_to_hub(drafter, "me/tiny", base_model="org/real-target")
    pushed = hub.commits[0]["README.md"].decode()
    assert front_matter(pushed)["base_model"] == "org/real-target"
    assert "# TreeSpark drafter for org/real-target" in pushed
    assert 'AutoModelForCausalLM.from_pretrained("org/real-target")' in pushed
    for bad in ("my-target", "/a/path", "org/name/extra"):
        with pytest.raises(ValueError, match=f"base_model '{bad}' is not a Hub model id"):
            push_drafter_to_hub(drafter, "me/tiny", base_model=bad)
    assert len(hub.commits) == 1 and len(hub.repos) == 1  # refused before the Hub


def test_a_base_model_chosen_on_a_saved_card_is_kept_by_later_pushes(tmp_path, monkeypatch, target):
    hub = FakeHub(monkeypatch)
    saved = save_drafter(tiny_drafter(target, target_name_or_path="my-target"), tmp_path / "final")
    text = (saved / "README.md").read_text()
    assert "base_model" not in front_matter(text)
    (saved / "README.md").write_text(text.replace("- drafter\n", "- drafter\nbase_model: org/real-target\n", 1))
    TreeSparkDrafter.from_pretrained(saved).push_to_hub("me/tiny")
    pushed = hub.commits[0]["README.md"].decode()
    assert front_matter(pushed)["base_model"] == "org/real-target"
    assert 'AutoModelForCausalLM.from_pretrained("org/real-target")' in pushed


def test_save_pretrained_with_push_to_hub_and_no_repo_id_names_the_repo_the_hub_made(tmp_path, monkeypatch, target):
    """transformers' default repo id is the directory's name, which the Hub puts in the token's account: the card
    names that repo, never the placeholder."""
    hub = FakeHub(monkeypatch)
    tiny_drafter(target).save_pretrained(tmp_path / "my-drafter", push_to_hub=True)
    readme = hub.commits[0]["README.md"].decode()
    assert 'AutoModel.from_pretrained("me/my-drafter")' in readme and card.REPO_PLACEHOLDER not in readme
    assert readme == (tmp_path / "my-drafter" / "README.md").read_text()


def test_treespark_push_takes_the_base_model_and_says_what_card_it_pushed(tmp_path, monkeypatch, capsys, target):
    from hf_treespark.cli import commands as cli

    hub = FakeHub(monkeypatch)
    save_drafter(tiny_drafter(target, target_name_or_path="my-target"), tmp_path / "final")
    assert cli.main(["push", "--drafter", str(tmp_path / "final"), "--repo-id", "me/tiny",
                     "--base-model", "org/real-target"]) == 0
    assert front_matter(hub.commits[0]["README.md"].decode())["base_model"] == "org/real-target"
    assert "every figure read from the drafter again" in capsys.readouterr().out
    assert cli.main(["push", "--drafter", str(tmp_path / "final"), "--repo-id", "me/tiny",
                     "--base-model", "not a model"]) == 2
    assert "--base-model: base_model 'not a model' is not a Hub model id" in capsys.readouterr().err


def test_the_cards_usage_snippets_run_as_written(tmp_path):
    """Both code blocks of the card (with the package, and with remote code and `custom_generate/` alone) decode with
    a drafter directory and a target that has a chat template; greedy, so both give the same tokens."""
    import re

    import transformers
    from transformers import AutoTokenizer

    from hf_treespark import TreeSparkConfig
    from hf_treespark.hub import assets

    tokenizer = AutoTokenizer.from_pretrained(assets.default_target_path())
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(config).eval()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter = TreeSparkDrafter(TreeSparkConfig.for_target(
        target, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
        markov_rank=8, mask_token_id=16, target_name_or_path=str(tmp_path / "target"))).eval()
    drafter.save_pretrained(tmp_path / "drafter")

    text = card.model_card(drafter, repo_id=str(tmp_path / "drafter"))
    blocks = [b.replace("max_new_tokens=128", "max_new_tokens=6") for b in re.findall(r"```python\n(.*?)```", text,
                                                                                         flags=re.S)]
    assert len(blocks) == 2
    scope = {}
    exec(blocks[0], scope)  # noqa: S102  (the card's own snippet)
    with_package = scope["out"]
    exec(blocks[1], scope)  # noqa: S102
    assert with_package.shape[1] > scope["inputs"]["input_ids"].shape[1]
    assert torch.equal(scope["out"], with_package)
