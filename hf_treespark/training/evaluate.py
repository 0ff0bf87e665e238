"""The learning curve's measure: acceptance on a development set, computed without decoding.

A greedy round anchored at `x_a` (the target's cache holds the positions before `a`) accepts the
longest prefix of the target's own greedy continuation `x_{a+1}, x_{a+2}, ...` that the packed tree
holds, plus the bonus token. On the target's greedy responses (the development references), that
is computable for every response position at once: one target forward for the features, one
drafter pass with every position as an anchor (the training mask lets anchor `a` see the context
before `a`, exactly what decoding gives it), `tree.build_tree` per anchor, and a walk along the
reference. The mean over positions weights every position equally, where decoding visits only the
positions that start a round; the two agree to the extent that acceptance does not depend on the
position, and this one needs no decoding loop (seconds, not minutes).

The development set the training commands evaluate on is `dev_set.py`'s (committed, 207 prompts of five kinds);
`scripts/compare_drafters_dev.py` compares two drafters on it (`dev_compare.py`). `build_dev_set` makes the
earlier one, 32 held-out ShareGPT first turns (`DEV_PROMPTS`, inside `dev_set.py`'s band), for
`scripts/diagnose_drafter.py` and the runs recorded with it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.tree import TreePolicy, build_tree
from ..decoding.engine import target_features
from .data import ReferenceSequence, collate_references, load_references, regenerate_responses, sharegpt_chat_prompts

DEV_PROMPTS = slice(400, 432)  # the earlier development set: held-out ShareGPT first turns 400-431


def build_dev_set(target, tokenizer, path: str | Path, prompts: slice = DEV_PROMPTS, max_new_tokens: int = 128,
                  batch_size: int = 8, progress: bool = True) -> list[ReferenceSequence]:
    """The earlier development references (`DEV_PROMPTS`) at `path` (JSONL), generated greedily by `target` the first
    time."""
    path = Path(path)
    chosen = sharegpt_chat_prompts("heldout", limit=prompts.stop)[prompts]
    regenerate_responses(target, tokenizer, chosen, path, batch_size=batch_size, max_new_tokens=max_new_tokens,
                         progress=progress)  # resumable: prompts already in the file are skipped
    return load_references(path)


@torch.no_grad()
def accepted_depths(drafter, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                    policy: TreePolicy) -> torch.Tensor:
    """`[A]` nodes a greedy round anchored at each of `anchors` accepts, on the greedy sequence `ids` `[T]`.

    `features` `[1, T, n_layers * d]`: the target's features of `ids`; every anchor needs `policy.depth`
    tokens after it.
    """
    depth = policy.depth
    out = drafter(anchor_ids=ids[anchors][None], anchor_positions=anchors[None], target_features=features,
                  logit_slots=policy.expanded_depth)
    depth_logits = out.depth_logits.view(len(anchors), policy.expanded_depth, -1)
    tree = build_tree(depth_logits, drafter.markov_bias, ids[anchors], policy, drafter.draft_vocab_ids)
    continuation = ids[anchors[:, None] + torch.arange(depth + 1, device=ids.device)]  # [A, D + 1], x_a first
    correct = tree.tokens == continuation.gather(1, tree.depths)
    on_path = ~(tree.ancestors & ~correct[:, None, :]).any(dim=-1)  # the node and all its ancestors are right
    return torch.where(on_path, tree.depths, 0).max(dim=1).values


@torch.no_grad()
def reference_acceptance(target, drafter, references: list[ReferenceSequence], policy: TreePolicy,
                         anchors_per_sequence: int = 64, batch_size: int = 4) -> dict:
    """Acceptance on the target's greedy `references` (see the module docstring).

    Returns `{"acceptance_length": mean accepted nodes + 1, "depth_rates": [fraction of anchors whose
    accepted path reaches depth d, d = 1..D], "anchors": count}`. Anchors are spread evenly over each
    response, at most `anchors_per_sequence` of them, and need `D` reference tokens after them.
    """
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    depth = policy.depth
    accepted_total, reach, count = 0, torch.zeros(depth), 0
    for start in range(0, len(references), batch_size):
        batch = references[start: start + batch_size]
        tensors = collate_references(batch, pad_id=0)
        input_ids = tensors["input_ids"].to(device)
        features, _ = target_features(target, drafter.config.target_layer_ids, input_ids,
                                      tensors["attention_mask"].to(device))
        for row, ref in enumerate(batch):
            last = len(ref.input_ids) - 1 - depth  # the anchor needs D reference tokens after it
            if last < ref.prompt_len:
                continue
            positions = torch.linspace(ref.prompt_len, last, min(anchors_per_sequence, last - ref.prompt_len + 1))
            anchors = positions.round().long().unique().to(device)
            ids = input_ids[row, : len(ref.input_ids)]
            accepted = accepted_depths(drafter, ids, features[row: row + 1, : len(ref.input_ids)], anchors, policy)
            accepted_total += int(accepted.sum())
            reach += (accepted[:, None] >= torch.arange(1, depth + 1, device=device)).sum(0).float().cpu()
            count += len(anchors)
    drafter.train(was_training)
    if count == 0:
        raise ValueError("no development reference is long enough to anchor a tree on")
    return {"acceptance_length": 1 + accepted_total / count, "depth_rates": (reach / count).tolist(),
            "anchors": count}


def read_curve(metrics_path: str | Path) -> list[dict]:
    """The development-set evaluations logged in a run's `metrics.jsonl` (lines with `dev_acceptance_length`)."""
    import json

    rows = []
    for line in Path(metrics_path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if isinstance(record, dict) and "dev_acceptance_length" in record:
            rows.append(record)
    return rows


def plot_learning_curve(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Acceptance length and depth-1 acceptance on the development set against training anchors seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_curve(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} has no development-set evaluation yet (train with --eval-every)")
    anchors = [r["anchors_seen"] for r in rows]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(anchors, [r["dev_acceptance_length"] for r in rows], "o-", color="#1f77b4", label="acceptance length")
    left.set_xlabel("training anchors seen")
    left.set_ylabel("acceptance length (dev set)")
    right = left.twinx()
    right.plot(anchors, [100 * r["dev_depth_rates"][0] for r in rows], "s--", color="#d62728", label="depth-1 %")
    right.set_ylabel("depth-1 acceptance (%)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.95))  # rising curves leave that corner free
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
