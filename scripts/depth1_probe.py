"""Issue 28, step 1: does the drafter's depth-1 slot use what a context-free head can read?

On every response position of the same references (training: shared-file records the shipped drafter was
trained on; development: the held-out prompts 400-431 of `scripts/diagnose_drafter.py`), teacher-forced
depth-1 top-1 of:

- the shipped drafter (`U_1 + W2(W1[x_t])`, what decoding uses);
- a context-free head (the SPEC's learnability floor: the target's features at `t - 1` and the embedding of
  `x_t`, one residual MLP, the target's LM head over the draft vocabulary), trained here on the extracted
  positions;
- the ablation: the same head given the drafter's own depth-1 hidden state as well, its output added to that
  state (zero-initialised, so it starts as the drafter): does handing the depth-1 slot the context-free inputs
  directly add to what the drafter already has?

The positions are those `treespark train-depth1` extracted (`OUTPUT_DIR/positions`, `OUTPUT_DIR/dev_positions`):
run it first; its own curve (`OUTPUT_DIR/metrics.jsonl`) is the ablation's. This script trains the context-free
head on the same training positions for `--seconds` and prints its curve. One heavy process; run it alone:

    .venv/bin/python scripts/depth1_probe.py --run runs/d1 --seconds 600
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from script_args import existing_dir, positive_number
from torch import nn


class Head(nn.Module):
    """The context-free head: `[norm(fc(features)) ; emb(x_t)] -> residual MLP -> H` (the drafter's `Depth1Head`
    without the anchor slot's state)."""

    def __init__(self, feature_width: int, hidden: int, width: int = 2048):
        super().__init__()
        self.fc = nn.Linear(feature_width, hidden, bias=False)
        self.norm_in = nn.RMSNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(2 * hidden, width), nn.SiLU(), nn.Linear(width, 2 * hidden))
        self.out = nn.Linear(2 * hidden, hidden)
        self.norm_out = nn.RMSNorm(hidden)

    def forward(self, features, embedding, hidden=None):
        x = torch.cat([self.norm_in(self.fc(features)), embedding], -1)
        return self.norm_out(self.out(x + self.mlp(x)))


def train_head(head, data, dev_sets, drafter, embed, seconds: float, batch: int = 256, lr: float = 1e-3):
    draft_head = drafter._target()[2]
    index = torch.full((drafter.config.target_vocab_size,), -100, dtype=torch.long)
    index[drafter.draft_vocab_ids] = torch.arange(drafter.draft_vocab_ids.numel())

    def logits(d, rows):
        h = head(d["features"][rows].float(), embed[d["token"][rows]], d["hidden"][rows].float())
        return draft_head(h) + drafter.markov_bias(d["token"][rows])

    def accuracy(d):
        with torch.no_grad():
            right = 0
            for i in range(0, len(d["label"]), 2048):
                rows = torch.arange(i, min(i + 2048, len(d["label"])))
                pred = drafter.to_target_ids(logits(d, rows).argmax(-1))
                right += (pred == d["label"][rows]).sum().item()
        return 100 * right / len(d["label"])

    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    labels = index[data["label"]]
    n, seen, start = len(labels), 0, time.time()
    curve = [{"positions_seen": 0, "seconds": 0, **{name: round(accuracy(d), 1) for name, d in dev_sets.items()}}]
    print("   ", curve[-1], flush=True)
    while time.time() - start < seconds:
        perm = torch.randperm(n)
        for i in range(0, n - batch + 1, batch):
            rows = perm[i:i + batch]
            loss = F.cross_entropy(logits(data, rows), labels[rows], ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += batch
            if time.time() - start >= seconds:
                break
        curve.append({"positions_seen": seen, "seconds": round(time.time() - start),
                      **{name: round(accuracy(d), 1) for name, d in dev_sets.items()}})
        print("   ", curve[-1], flush=True)
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=existing_dir, default="runs/d1", help="a `treespark train-depth1` output directory")
    p.add_argument("--seconds", type=positive_number, default=600, help="training time of the context-free head")
    args = p.parse_args()
    run = Path(args.run)
    for folder in ("positions", "dev_positions"):
        if not (run / folder / "progress.json").is_file():
            p.error(f"argument --run: {run / folder} holds no extracted positions: run `treespark train-depth1 "
                    f"--output-dir {run}` first")

    import hf_treespark
    from hf_treespark.training.depth1 import PositionShards, block_signature

    torch.manual_seed(0)
    target, _ = hf_treespark.load_default_target(dtype=torch.float32)
    drafter = hf_treespark.load_default_drafter(dtype=torch.float32).bind_target(target)
    signature = block_signature(drafter)
    try:
        train = PositionShards(run / "positions", signature).load()
        dev = PositionShards(run / "dev_positions", signature).load()
    except ValueError as err:  # positions of another drafter, or a damaged shard
        p.error(f"argument --run: {err}")
    first = {k: v[:5000] for k, v in train.items()}  # the first training references' positions
    embed = target.get_input_embeddings().weight.detach().float()
    for p_ in drafter.parameters():
        p_.requires_grad_(False)
    results = {"drafter": {}}
    for name, d in (("dev", dev), ("train_first_5000", first)):
        with torch.no_grad():
            right = 0
            for i in range(0, len(d["label"]), 2048):
                rows = torch.arange(i, min(i + 2048, len(d["label"])))
                logits = drafter.depth_logits(d["hidden"][rows].float()) + drafter.markov_bias(d["token"][rows])
                right += int((drafter.to_target_ids(logits.argmax(-1)) == d["label"][rows]).sum())
        results["drafter"][name] = round(100 * right / len(d["label"]), 1)
    print("drafter alone, depth-1 top-1:", results["drafter"], flush=True)
    print(f"context-free head on {len(train['label']):,} positions:", flush=True)
    head = Head(train["features"].shape[1], drafter.config.hidden_size)
    results["context_free"] = train_head(head, train, {"dev": dev, "train_first_5000": first}, drafter, embed,
                                         args.seconds)
    (run / "context_free_probe.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
