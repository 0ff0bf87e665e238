"""What a saved drafter directory carries besides its weights, and what a push uploads.

The model card is a `huggingface_hub.ModelCard`: `ModelCardData` metadata the Hub knows (`library_name:
transformers`, the `hf_treespark` tag; no `pipeline_tag`, since a drafter generates nothing alone), then one small
function per section (`model_card` assembles them). Every figure on it is read from the drafter when the card is
written, and again when it is pushed (`fresh_card`): a card saved earlier keeps only its measured table.
`custom_generate/` is the tree decoding loop for users without the package.
`TreeSparkDrafter.save_pretrained` writes both (when the package is installed) and `push_to_hub` uploads them
through `push_drafter`, as `treespark push` does; so this module must not import the modeling code: it reads the
drafter's config and calls its `save_pretrained` only.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..drafter.configuration import TreeSparkConfig
from ..drafter.remote_code import module_closure, write_flat
from .default_target import DEFAULT_TARGET_CACHE_NAME, DEFAULT_TARGET_HUB_ID, DEFAULT_TARGET_NAME

CARD_NAME = "README.md"
REPO_PLACEHOLDER = "path/or/repo-id-of-this-drafter"  # the usage snippet's drafter, until a repo id is known
_HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # ORG/NAME: what base_model may name


# ----- model card ---------------------------------------------------------------------------------
LIBRARY_NAME = "transformers"  # what loads it (`AutoModel`, remote code); the Hub knows no `hf_treespark` library
LICENSE = "apache-2.0"  # the package's license, which the drafter code in the repository is under
TAGS = ("hf_treespark", "treespark", "speculative-decoding", "drafter")
_METADATA_ORDER = ["library_name", "license", "tags", "base_model"]  # the card's YAML, top down
_OWN_METADATA = ("library_name", "license", "tags", "base_model", "pipeline_tag")  # what a fresh card decides
# The sections of the cards this module writes; a card holding them all is refreshed at push time (`fresh_card`).
SECTIONS = ("## Target pairing", "## Architecture", "## Tree policy defaults", "## Measured acceptance", "## Usage")
_NO_TABLE = "No acceptance table was recorded for this drafter."
_PROFILE_LEAD = "Mean tokens committed per round"


def hub_target_id(name: str | None) -> str | None:
    """The Hub id of a recorded target name: the offline default target's local name or cached copy maps
    to `HuggingFaceTB/SmolLM2-135M-Instruct`; other names are returned unchanged."""
    if name and (name.lower() == DEFAULT_TARGET_NAME.lower()
                 or os.path.basename(os.path.normpath(name)) == DEFAULT_TARGET_CACHE_NAME):
        return DEFAULT_TARGET_HUB_ID
    return name


def hub_base_model(cfg: TreeSparkConfig) -> str | None:
    """The card's `base_model` when none is given: the recorded target's Hub id (`hub_target_id`) when it has the
    form ORG/NAME and names no local directory; None for a local path, a bare directory name or no target."""
    target = hub_target_id(cfg.target_name_or_path)
    if target and _HUB_MODEL_ID.match(target) and not os.path.exists(target):
        return target
    return None


def check_base_model(base_model: str | None) -> str | None:
    """`base_model` as given for a card (None: chosen from the drafter), or `ValueError` when it is not a Hub
    model id (ORG/NAME)."""
    if base_model is not None and not (isinstance(base_model, str) and _HUB_MODEL_ID.match(base_model)):
        raise ValueError(f"base_model {base_model!r} is not a Hub model id: give the target's repository, ORG/NAME "
                         "(e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    return base_model


def source_card(drafter) -> Path | None:
    """The model card (`README.md`) of the local directory `drafter` was loaded from, if it has one: the card a
    user wrote, or the one saved with the drafter (with the measured tables it was given)."""
    source = getattr(getattr(drafter, "config", None), "_name_or_path", None)
    card = Path(source) / CARD_NAME if source else None
    return card if card is not None and card.is_file() else None


def card_data(cfg: TreeSparkConfig, tags: Sequence[str] = (), base_model: str | None = None) -> ModelCardData:
    """The card's metadata: library (`transformers`), license, tags (`TAGS`, then `tags`) and `base_model`: the one
    given, else `hub_base_model` (left out for a local path or an unknown target). No `pipeline_tag`: the drafter
    generates nothing alone, so the Hub's text-generation widget would fail on it."""
    return ModelCardData(library_name=LIBRARY_NAME, license=LICENSE, tags=list(dict.fromkeys([*TAGS, *tags])),
                         base_model=check_base_model(base_model) or hub_base_model(cfg))


def _introduction(cfg: TreeSparkConfig, target: str | None) -> list[str]:
    return [
        f"# TreeSpark drafter for {target}" if target else "# TreeSpark drafter",
        "",
        "A TreeSpark drafter: a DSpark-style parallel block drafter that drafts a block of "
        f"{cfg.block_size} future tokens in one forward pass, conditioned on hidden states of its target model, "
        "with a low-rank Markov head (parent-token correction) and a confidence head. `hf_treespark` grows a "
        "candidate tree from its outputs and verifies the whole tree in one target forward, so decoding stays "
        "lossless: the output is the target's own.",
        "",
        "The drafter shares the target's token embeddings and LM head; they are not stored here, and the drafter "
        "refuses a target whose vocabulary, hidden size or depth differs from the one below.",
    ]


def _target_pairing(cfg: TreeSparkConfig, target: str | None) -> list[str]:
    return [
        "## Target pairing",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{target or 'the-target-model'}`{'' if target else ' (not recorded)'} |",
        f"| target hidden size | {cfg.target_hidden_size} |",
        f"| target vocabulary | {cfg.target_vocab_size} |",
        f"| target layers | {cfg.target_num_hidden_layers} |",
        f"| target_layer_ids | `{list(cfg.target_layer_ids)}` (read from `hidden_states[l + 1]`) |",
    ]


def _architecture(drafter, cfg: TreeSparkConfig) -> list[str]:
    mask = (f"token id {cfg.mask_token_id} of the target's vocabulary" if cfg.mask_token_id is not None
            else "a learned mask embedding owned by the drafter")
    confidence = (f"yes: `c_k(y) = sigmoid(w . [h_k ; W1[y]] + b)`, input width {cfg.hidden_size + cfg.markov_rank}"
                  if cfg.use_confidence_head else "no")
    lines = [
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| block size `B` | {cfg.block_size} |",
        f"| draft layers | {cfg.num_hidden_layers} |",
        f"| attention heads / KV heads | {cfg.num_attention_heads} / {cfg.num_key_value_heads} |",
        f"| head_dim | {cfg.head_dim} |",
        f"| MLP width | {cfg.intermediate_size} |",
        f"| Markov rank `r` | {cfg.markov_rank} |",
        f"| confidence head | {confidence} |",
        f"| mask slots | {mask} |",
    ]
    if getattr(cfg, "depth1_head", 0):
        lines.append(f"| depth-1 head | MLP width {cfg.depth1_head}: the target features of the position before the "
                     "anchor, the anchor's embedding and the anchor slot's state, added to that state "
                     "(`treespark train-depth1`) |")
    if getattr(cfg, "depth2_head", 0):
        lines.append(f"| depth-2 head | MLP width {cfg.depth2_head}: the second depth given its parent (the token the "
                     "tree put at depth 1), the features before the anchor and the anchor's embedding |")
    if hasattr(drafter, "parameters"):
        lines.append(f"| stored parameters | {sum(p.numel() for p in drafter.parameters()):,} |")
    return lines


def _tree_policy(drafter, cfg: TreeSparkConfig) -> list[str]:
    return [
        "## Tree policy defaults",
        "",
        "Each round drafts one block and grows a tree of depth up to `B` from it; the tree is verified in one "
        "target forward. Every knob can be overridden per call (`tree_topk=`, `tree_frontier=`, `tree_budget=`, "
        "`tree_lookup=`).",
        "",
        "| | |",
        "|---|---|",
        f"| tree_topk (children per frontier parent) | {cfg.tree_topk} |",
        f"| tree_frontier (parents kept per depth) | {cfg.tree_frontier} |",
        f"| tree_budget (tree nodes verified per round) | {cfg.tree_budget} |",
        f"| tree_lookup (tokens per lookup branch, 0 = off) | {cfg.tree_lookup} |",
        f"| max depth (block size) | {cfg.block_size} |",
        f"| draft vocabulary | {_draft_vocabulary(cfg)} |",
        f"| tree_datastore (retrieved branches) | {_datastore(drafter)} |",
    ]


def _draft_vocabulary(cfg: TreeSparkConfig) -> str:
    if cfg.draft_vocab_size is None:
        return f"the whole target vocabulary ({cfg.target_vocab_size})"
    return (f"{cfg.draft_vocab_size} of the target's {cfg.target_vocab_size} ids (`draft_vocab_ids`, stored with the "
            "weights); verification uses the whole vocabulary")


def _datastore(drafter) -> str:
    store = getattr(drafter, "datastore", None)
    if store is None:
        return "none (`treespark datastore` builds one)"
    state = "on" if getattr(drafter.config, "tree_datastore", True) else "off"
    return f"{state}: `datastore.safetensors`, {store.num_tokens:,} tokens of the target's earlier outputs"


def _measured_acceptance(cfg: TreeSparkConfig, acceptance_table: str | None) -> list[str]:
    lines = ["## Measured acceptance", ""]
    table, profile = (acceptance_table or "").strip(), cfg.acceptance_profile or {}
    if table:
        lines += [table]
    if profile:
        lines += [""] if table else []
        lines += ["Mean tokens committed per round at each tree budget (the config's `acceptance_profile`, measured "
                  'by `treespark calibrate`; `tree_budget="auto"` reads it):', "",
                  "| tree budget | acceptance length |", "|---|---|"]
        lines += [f"| {n} | {tau:.2f} |" for n, tau in sorted(profile.items(), key=lambda item: int(item[0]))]
    if not table and not profile:
        lines += ["No acceptance table was recorded for this drafter."]
    return lines


def _usage(target: str | None, repo: str) -> list[str]:
    target = target or "the-target-model"
    return [
        "## Usage",
        "",
        "```python",
        "import hf_treespark  # registers the drafter with AutoModel and routes generate() to tree decoding",
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        f'drafter = AutoModel.from_pretrained("{repo}")',
        "# an instruct target answers a chat: apply its chat template",
        'messages = [{"role": "user", "content": "Write a haiku about trees."}]',
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,",
        '                                       return_tensors="pt")',
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128)",
        'print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
        "",
        "Without the package: the drafter code and the tree decoding loop also ship with this repository "
        "(`custom_generate/`, transformers' `custom_generate` recipe), so remote code alone decodes:",
        "",
        "```python",
        f'drafter = AutoModel.from_pretrained("{repo}", trust_remote_code=True)',
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128,",
        f'                      custom_generate="{repo}", trust_remote_code=True)',
        "```",
    ]


def drafter_card(drafter, acceptance_table: str | None = None, repo_id: str | None = None,
                 tags: Sequence[str] = (), base_model: str | None = None) -> ModelCard:
    """The `huggingface_hub.ModelCard` of `drafter`: `card_data` as metadata, then target pairing, architecture,
    tree policy, measured acceptance and usage (arguments as for `model_card`; `tags` are added to `TAGS`)."""
    cfg: TreeSparkConfig = drafter.config
    target = check_base_model(base_model) or hub_target_id(cfg.target_name_or_path)
    sections = [_introduction(cfg, target), _target_pairing(cfg, target), _architecture(drafter, cfg),
                _tree_policy(drafter, cfg), _measured_acceptance(cfg, acceptance_table),
                _usage(target, repo_id or REPO_PLACEHOLDER)]
    body = "\n\n".join("\n".join(lines) for lines in sections)
    metadata = card_data(cfg, tags, base_model).to_yaml(original_order=_METADATA_ORDER)
    return ModelCard(f"---\n{metadata}\n---\n\n{body}\n")


def model_card(drafter, acceptance_table: str | None = None, repo_id: str | None = None,
               base_model: str | None = None) -> str:
    """The markdown model card (`README.md`) of `drafter`: the one card that `save_pretrained`, `push_to_hub` and
    `treespark push` write (see `drafter_card`).

    Args:
        drafter: the drafter (or anything with a `TreeSparkConfig` as `.config`).
        acceptance_table: a markdown table of measured acceptance lengths, inserted verbatim. The
            drafter's own `config.acceptance_profile` (what `treespark calibrate` measured) is shown
            too; with neither, the card says that no measurement was recorded.
        repo_id: the Hub id (or local path) the drafter will be loaded from, used in the usage snippet.
        base_model: the target's Hub id (ORG/NAME) for the metadata and the usage snippet; default
            `hub_base_model` (the recorded target when it is a Hub id). Raises `ValueError` for another form.
    """
    return str(drafter_card(drafter, acceptance_table, repo_id, base_model=base_model))


def recorded_table(text: str) -> str | None:
    """The measured table a card written by `model_card` carries (what its `acceptance_table` was), or None."""
    section = _sections(text).get("## Measured acceptance", "")
    table = section.split(_PROFILE_LEAD)[0].strip()  # the calibrated profile after it is the drafter's own
    return None if not table or table == _NO_TABLE else table


def _sections(text: str) -> dict[str, str]:
    """A card's body split at its `## ` headings: `{heading: the text under it}` (the text before the first is
    under "")."""
    if text.startswith("---\n") and "\n---\n" in text[3:]:  # the YAML metadata block
        text = text[text.index("\n---\n", 3) + 5:]
    parts, heading = {"": []}, ""
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line.rstrip()
            parts[heading] = []
        else:
            parts[heading].append(line)
    return {h: "\n".join(lines) for h, lines in parts.items()}


def written_here(text: str) -> bool:
    """Whether card `text` is one this module wrote (it holds every heading of `SECTIONS`), not a user's own."""
    sections = _sections(text)
    return all(heading in sections for heading in SECTIONS)


def fresh_card(drafter, text: str, repo_id: str, tags: Sequence[str] = (), base_model: str | None = None) -> str:
    """`text`, a drafter directory's card, made true for a push of `drafter` to `repo_id`.

    A card this module wrote (it holds every heading of `SECTIONS`) is written again from the drafter, so every
    figure on it (parameters, datastore tokens, tree policy, acceptance profile, target) is the drafter's own now:
    only its measured table (`recorded_table`), its `base_model` (an ORG/NAME one, unless `base_model` is given),
    sections a user added and metadata it does not decide are kept. Any other card (a user's own) is kept as
    written, its usage placeholder pointed at `repo_id`, `tags` added and `base_model` set when given."""
    if not written_here(text):
        text = text.replace(REPO_PLACEHOLDER, repo_id)
        if not tags and base_model is None:
            return text
        card = ModelCard(text)
        card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *tags])) or None
        if base_model is not None:
            card.data.base_model = check_base_model(base_model)
        return str(card)
    kept = ModelCard(text)
    chosen = kept.data.base_model if isinstance(kept.data.base_model, str) else None  # a choice, not a figure
    if base_model is None and chosen and _HUB_MODEL_ID.match(chosen):
        base_model = chosen
    card = drafter_card(drafter, recorded_table(text), repo_id, [*(kept.data.tags or []), *tags], base_model)
    extra = {k: v for k, v in kept.data.to_dict().items() if k not in _OWN_METADATA}
    if extra:
        card.data = ModelCardData(**card.data.to_dict(), **extra)
    added = [f"{heading}\n{body}".rstrip() for heading, body in _sections(text).items()
             if heading and heading not in SECTIONS]
    return str(card).rstrip("\n") + "".join(f"\n\n{section}" for section in added) + "\n"


# ----- custom_generate/: tree decoding without the package ------------------------------------------
CUSTOM_GENERATE_DIR = "custom_generate"
# The package modules that `hub_generate.py` needs (it and they import only torch, transformers, numpy and
# each other). Adjust when the decoding loop's modules change; a test checks the set is closed under imports.
CUSTOM_GENERATE_ENTRY = "hub.custom_generate"  # written as custom_generate/generate.py


def custom_generate_modules() -> list[str]:
    """The file names `custom_generate/` holds: the recipe's entry (as `generate.py`) and every package module it
    imports, directly or not (`remote_code.module_closure`), computed from the imports, not kept by hand."""
    return sorted("generate.py" if m == CUSTOM_GENERATE_ENTRY else m.split(".")[-1] + ".py"
                  for m in module_closure(CUSTOM_GENERATE_ENTRY))


def write_custom_generate(save_directory: str | os.PathLike) -> Path:
    """Write `custom_generate/` into a drafter directory: `generate.py` (from `hub/custom_generate.py`) and the
    modules it imports (`custom_generate_modules`), so that `target.generate(..., assistant_model=drafter,
    custom_generate=<directory or repo>, trust_remote_code=True)` decodes without the package. Returns the folder."""
    folder = Path(save_directory) / CUSTOM_GENERATE_DIR
    write_flat(folder, CUSTOM_GENERATE_ENTRY, rename={CUSTOM_GENERATE_ENTRY: "generate.py"})
    return folder


# ----- the card in a directory, and what a push uploads ---------------------------------------------------
PUSH_COMMIT_MESSAGE = "Upload TreeSpark drafter"


def write_card(directory: str | os.PathLike, drafter, acceptance_table: str | None = None,
               repo_id: str | None = None) -> Path:
    """Write `model_card(drafter, ...)` as `directory/README.md` unless a card is there already (a user's own, or
    one saved with measured tables, is kept). Returns the card's path."""
    card = Path(directory) / CARD_NAME
    if not card.exists():
        card.parent.mkdir(parents=True, exist_ok=True)
        card.write_text(model_card(drafter, acceptance_table, repo_id=repo_id), encoding="utf-8")
    return card


def push_card(drafter, repo_id: str, acceptance_table: str | None = None, tags: Sequence[str] = (),
              base_model: str | None = None) -> str:
    """The `README.md` a push of `drafter` to `repo_id` uploads: the card of the directory it was loaded from
    (`source_card`) made true for this push (`fresh_card`) unless `acceptance_table` is given, else `model_card`.
    `tags` are added to the card's metadata; `base_model` (ORG/NAME) overrides the recorded target's Hub id."""
    kept = source_card(drafter) if acceptance_table is None else None
    if kept is None:
        return str(drafter_card(drafter, acceptance_table, repo_id=repo_id, tags=tags, base_model=base_model))
    return fresh_card(drafter, kept.read_text(encoding="utf-8"), repo_id, tags, base_model)


def push_drafter(drafter, repo_id: str, *, acceptance_table: str | None = None, commit_message: str | None = None,
                 commit_description: str | None = None, private: bool | None = None, token: str | bool | None = None,
                 revision: str | None = None, create_pr: bool = False, max_shard_size: int | str | None = None,
                 tags: Sequence[str] | None = None, base_model: str | None = None):
    """Save `drafter` into a temporary directory (`save_pretrained`: the weights, remote code, `custom_generate/` and
    the datastore), create the Hub repo `repo_id` if needed, write `push_card` for the repo's full id as its
    `README.md` and upload the folder. What `drafter.push_to_hub(...)` and `treespark push` do; the options are
    `push_to_hub`'s, and `base_model` the card's (see `push_card`). Returns `huggingface_hub`'s `CommitInfo`."""
    check_base_model(base_model)
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(tmp, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
        api, repo_id = _create_repo(repo_id, token, private)
        card = push_card(drafter, repo_id, acceptance_table, tags or (), base_model)
        (Path(tmp) / CARD_NAME).write_text(card, encoding="utf-8")
        return _upload(api, tmp, repo_id, commit_message=commit_message, commit_description=commit_description,
                       revision=revision, create_pr=create_pr)


def save_and_push(drafter, save_directory: str | os.PathLike, *args, repo_id: str | None = None,
                  commit_message: str | None = None, commit_description: str | None = None,
                  private: bool | None = None, token: str | bool | None = None, create_pr: bool = False,
                  revision: str | None = None, **save_kwargs):
    """`drafter.save_pretrained(save_directory, push_to_hub=True, ...)`: save, then upload what the save wrote and
    the directory's card to `repo_id` (default: the directory's name, in the account of the token, as transformers
    does). The card is made true for the repo's full id first (`fresh_card`), in the directory too."""
    folder = Path(save_directory)
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else {}
    drafter.save_pretrained(folder, *args, **save_kwargs)
    written = [p for p in folder.rglob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns]
    names = sorted({p.relative_to(folder).as_posix() for p in written} | {CARD_NAME})
    api, repo_id = _create_repo(repo_id or folder.resolve().name, token, private)
    card = folder / CARD_NAME
    card.write_text(fresh_card(drafter, card.read_text(encoding="utf-8"), repo_id), encoding="utf-8")
    return _upload(api, folder, repo_id, commit_message=commit_message, commit_description=commit_description,
                   revision=revision, create_pr=create_pr, allow_patterns=[glob.escape(name) for name in names])


def _create_repo(repo_id: str, token: str | bool | None, private: bool | None):
    """`(HfApi, the repo's full id)`: the repo `repo_id` created if needed; the Hub fills in a missing namespace."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    url = api.create_repo(repo_id, exist_ok=True, private=private)
    return api, getattr(url, "repo_id", None) or repo_id


def _upload(api, folder, repo_id: str, *, commit_message: str | None, commit_description: str | None,
            revision: str | None, create_pr: bool, allow_patterns: list[str] | None = None):
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message or PUSH_COMMIT_MESSAGE,
                             commit_description=commit_description, revision=revision, create_pr=create_pr,
                             allow_patterns=allow_patterns)
