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
from hf_treespark.hub.sharing import push_drafter_to_hub
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

        def create_repo(api, repo_id, **kwargs):
            hub.repos.append((repo_id, kwargs))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

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
    assert front_matter(readme) == {"library_name": "hf_treespark", "license": "apache-2.0",
                                    "pipeline_tag": "text-generation", "base_model": TARGET_NAME,
                                    "tags": ["treespark", "speculative-decoding", "drafter"]}
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
    assert text.startswith("---\nlibrary_name: hf_treespark\nlicense: apache-2.0\npipeline_tag: text-generation\n"
                           "tags:\n- treespark\n- speculative-decoding\n- drafter\n"
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
