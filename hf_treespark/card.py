"""What a saved drafter directory carries besides its weights: the model card and `custom_generate/`.

`TreeSparkDrafter.save_pretrained` writes both (when the package is installed), so this module must
not import the modeling code: it reads the drafter's config only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from .configuration import TreeSparkConfig
from .default_target import DEFAULT_TARGET_CACHE_NAME, DEFAULT_TARGET_HUB_ID, DEFAULT_TARGET_NAME

CARD_NAME = "README.md"
REPO_PLACEHOLDER = "path/or/repo-id-of-this-drafter"  # the usage snippet's drafter, until a repo id is known
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


# ----- model card ---------------------------------------------------------------------------------
LICENSE = "apache-2.0"  # the package's license, which the drafter code in the repository is under
PIPELINE_TAG = "text-generation"  # what the drafter is used for: the target's text generation


def hub_target_id(name: str | None) -> str | None:
    """The Hub id of a recorded target name: the offline default target's local name or cached copy maps
    to `HuggingFaceTB/SmolLM2-135M-Instruct`; other names are returned unchanged."""
    if name and (name.lower() == DEFAULT_TARGET_NAME.lower()
                 or os.path.basename(os.path.normpath(name)) == DEFAULT_TARGET_CACHE_NAME):
        return DEFAULT_TARGET_HUB_ID
    return name


def source_card(drafter) -> Path | None:
    """The model card (`README.md`) of the local directory `drafter` was loaded from, if it has one: the card a
    user wrote, or the one saved with the drafter (with the measured tables it was given)."""
    source = getattr(getattr(drafter, "config", None), "_name_or_path", None)
    card = Path(source) / CARD_NAME if source else None
    return card if card is not None and card.is_file() else None


def _datastore(drafter) -> str:
    store = getattr(drafter, "datastore", None)
    if store is None:
        return "none (`treespark datastore` builds one)"
    state = "on" if getattr(drafter.config, "tree_datastore", True) else "off"
    return f"{state}: `datastore.safetensors`, {store.num_tokens:,} tokens of the target's earlier outputs"


def model_card(drafter, acceptance_table: str | None = None, repo_id: str | None = None) -> str:
    """A markdown model card for `drafter`: target pairing, architecture, tree policy, acceptance, usage.

    Args:
        drafter: the drafter (or anything with a `TreeSparkConfig` as `.config`).
        acceptance_table: a markdown table of measured acceptance lengths, inserted verbatim. The
            drafter's own `config.acceptance_profile` (what `treespark calibrate` measured) is shown
            too; with neither, the card says that no measurement was recorded.
        repo_id: the Hub id (or local path) the drafter will be loaded from, used in the usage snippet.
    """
    cfg: TreeSparkConfig = drafter.config
    target = hub_target_id(cfg.target_name_or_path)
    repo = repo_id or REPO_PLACEHOLDER
    target_ref = target or "the-target-model"

    front = ["---", "library_name: hf_treespark", f"license: {LICENSE}", f"pipeline_tag: {PIPELINE_TAG}", "tags:",
             "- treespark", "- speculative-decoding", "- drafter"]
    if target and _REPO_ID.match(target):
        front.append(f"base_model: {json.dumps(target)}")
    front.append("---")

    params = sum(p.numel() for p in drafter.parameters()) if hasattr(drafter, "parameters") else None
    mask = (f"token id {cfg.mask_token_id} of the target's vocabulary" if cfg.mask_token_id is not None
            else "a learned mask embedding owned by the drafter")
    confidence = (f"yes: `c_k(y) = sigmoid(w . [h_k ; W1[y]] + b)`, input width {cfg.hidden_size + cfg.markov_rank}"
                  if cfg.use_confidence_head else "no")
    title = f"TreeSpark drafter for {target}" if target else "TreeSpark drafter"

    lines = [
        *front,
        "",
        f"# {title}",
        "",
        "A TreeSpark drafter: a DSpark-style parallel block drafter that drafts a block of "
        f"{cfg.block_size} future tokens in one forward pass, conditioned on hidden states of its target model, "
        "with a low-rank Markov head (parent-token correction) and a confidence head. `hf_treespark` grows a "
        "candidate tree from its outputs and verifies the whole tree in one target forward, so decoding stays "
        "lossless: the output is the target's own.",
        "",
        "The drafter shares the target's token embeddings and LM head; they are not stored here, and the drafter "
        "refuses a target whose vocabulary, hidden size or depth differs from the one below.",
        "",
        "## Target pairing",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{target_ref}`{'' if target else ' (not recorded)'} |",
        f"| target hidden size | {cfg.target_hidden_size} |",
        f"| target vocabulary | {cfg.target_vocab_size} |",
        f"| target layers | {cfg.target_num_hidden_layers} |",
        f"| target_layer_ids | `{list(cfg.target_layer_ids)}` (read from `hidden_states[l + 1]`) |",
        "",
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
    if params is not None:
        lines.append(f"| stored parameters | {params:,} |")
    lines += [
        "",
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
        "",
        "## Measured acceptance",
        "",
    ]
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
    lines += [
        "",
        "## Usage",
        "",
        "```python",
        "import hf_treespark  # registers the drafter with AutoModel and routes generate() to tree decoding",
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target_ref}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target_ref}")',
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
        "",
    ]
    return "\n".join(lines)


def _draft_vocabulary(cfg: TreeSparkConfig) -> str:
    if cfg.draft_vocab_size is None:
        return f"the whole target vocabulary ({cfg.target_vocab_size})"
    return (f"{cfg.draft_vocab_size} of the target's {cfg.target_vocab_size} ids (`draft_vocab_ids`, stored with the "
            "weights); verification uses the whole vocabulary")


# ----- custom_generate/: tree decoding without the package ------------------------------------------
CUSTOM_GENERATE_DIR = "custom_generate"
# The package modules that `hub_generate.py` needs (it and they import only torch, transformers, numpy and
# each other). Adjust when the decoding loop's modules change; a test checks the set is closed under imports.
CUSTOM_GENERATE_MODULES = ("batch.py", "budget.py", "configuration.py", "datastore.py", "engine.py", "generation.py",
                           "integration.py", "lookup.py", "modeling.py", "storage.py", "tree.py", "verify.py",
                           "cpu_gemm.py")


def write_custom_generate(save_directory: str | os.PathLike) -> Path:
    """Write `custom_generate/` into a drafter directory: `generate.py` (from `hub_generate.py`) and copies of
    `CUSTOM_GENERATE_MODULES`, so that `target.generate(..., assistant_model=drafter,
    custom_generate=<directory or repo>, trust_remote_code=True)` decodes without the package. Returns the folder."""
    package = Path(__file__).parent
    folder = Path(save_directory) / CUSTOM_GENERATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(package / "hub_generate.py", folder / "generate.py")
    for name in CUSTOM_GENERATE_MODULES:
        shutil.copyfile(package / name, folder / name)
    return folder


