"""Issue 43, the depth-2 pathway: does a depth-2 head, given the parent the tree put at depth 1, predict depth 2
better than the shipped drafter's `U_2 + W2(W1[y])`?

    extract OUT --start S --stop E [--data FILE ...]
                                     positions of the references S..E-1 of the shared own-response data (or of the
                                     regenerated `.jsonl`/`.jsonl.gz` files given), resumable
                                     (OUT/progress.json): per anchor a, the target features at a - 1, the block states
                                     h_1 (depth-1 head on) and h_2, x0 = ids[a], the parent y = ids[a + 1] and the
                                     label ids[a + 2]; bf16 shards of 20k positions
    train TRAIN DEV --variant B --steps N [--lr --width --weight-decay]
                                     a head on TRAIN's positions (one directory, or several joined by commas);
                                     teacher-forced depth-2 top-1 on DEV every 500 steps (step 0: the shipped
                                     drafter's U_2 + Markov). Variants: B = the package's
                                     `Depth2Head` ([norm(fc(f)), e(x0), e(y), h_2]); A = [fc(f), e(y), h_2];
                                     C = A + e(x0) + h_1. Saves the head beside TRAIN as head_<variant>_<width>.pt
    ship HEAD --width W --output DIR the shipped drafter grown with a trained variant-B head, saved to DIR

Data: `load_references(max_length=512)` over SHARED/data/*.jsonl (environment SHARED, default ../shared), or the
files given to `--data` (for example the repository's `training_data/*.jsonl.gz`): the target's own greedy answers.
One heavy process; run it alone. Measured runs: docs/training.md (The depth-2 head).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from script_args import (
    at_least,
    check_range,
    existing_dir,
    existing_file,
    non_negative_number,
    output_dir,
    positive_number,
)
from torch import nn

import hf_treespark
from hf_treespark import TreeSparkConfig
from hf_treespark.decoding.engine import target_features
from hf_treespark.drafter.modeling_block import TreeSparkRMSNorm
from hf_treespark.drafter.modeling_heads import Depth2Head
from hf_treespark.training.data import collate_references, load_references

SHARED = Path(os.environ.get("SHARED", Path(__file__).resolve().parents[2] / "shared"))


def ship(head_path: str, width: int, out: str):
    """The shipped drafter grown with the trained depth-2 head, saved to `out` (bf16, its datastore kept)."""
    from hf_treespark.training.depth1 import grow_head

    drafter = hf_treespark.load_default_drafter(dtype=torch.bfloat16)
    grown = grow_head(drafter, "depth2_head", width)
    state = torch.load(head_path, weights_only=True)
    grown.depth2_head.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})
    grown.save_pretrained(out)


def models():
    target, _ = hf_treespark.load_default_target()
    drafter = hf_treespark.load_default_drafter()
    drafter.bind_target(target)
    return target.eval(), drafter.eval()


@torch.no_grad()
def extract(out: str, start: int, stop: int, data: list[str] | None = None, shard: int = 20000):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prog = out / "progress.json"
    state = json.loads(prog.read_text()) if prog.exists() else {"next": start, "shards": 0, "positions": 0}
    data = data or sorted(str(p) for p in (SHARED / "data").glob("*.jsonl"))
    refs = load_references(data, max_length=512)
    target, drafter = models()
    B = drafter.config.block_size
    cols = {k: [] for k in ("f", "h1", "h2", "x0", "y", "label")}
    began, count = time.time(), 0
    for n in range(state["next"], min(stop, len(refs))):
        ref = refs[n]
        batch = collate_references([ref], pad_id=0)
        ids = batch["input_ids"][0]
        feats, _ = target_features(target, drafter.config.target_layer_ids, batch["input_ids"],
                                   batch["attention_mask"])
        anchors = torch.arange(max(ref.prompt_len, 1), len(ids) - 2)
        for s in range(0, len(anchors), 96):
            a = anchors[s:s + 96]
            o = drafter(anchor_ids=ids[a][None], anchor_positions=a[None], target_features=feats, return_logits=False)
            h = o.hidden_states.view(len(a), B, -1)
            cols["f"].append(feats[0, a - 1].to(torch.bfloat16))
            cols["h1"].append(h[:, 0].to(torch.bfloat16))
            cols["h2"].append(h[:, 1].to(torch.bfloat16))
            cols["x0"].append(ids[a])
            cols["y"].append(ids[a + 1])
            cols["label"].append(ids[a + 2])
        count += len(anchors)
        if sum(len(t) for t in cols["label"]) >= shard or n == min(stop, len(refs)) - 1:
            tensors = {k: torch.cat(v).contiguous() for k, v in cols.items()}
            save_file(tensors, str(out / f"shard_{state['shards']:05d}.safetensors"))
            state = {"next": n + 1, "shards": state["shards"] + 1, "positions": state["positions"] + len(tensors["y"])}
            prog.write_text(json.dumps(state))
            cols = {k: [] for k in cols}
            print(json.dumps({**state, "pos_per_s": round(count / (time.time() - began), 1)}), flush=True)


def count_positions(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice("y").get_shape()[0]


def load(directories: str, limit: int | None = None, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every shard's positions (the first `limit`) of the comma-separated `directories`, in order, one tensor per
    field but `skip`, allocated once."""
    shards = [path for d in directories.split(",") for path in sorted(Path(d).glob("shard_*.safetensors"))]
    data, at = None, 0
    for path in shards:
        part = {k: v for k, v in load_file(str(path)).items() if k not in skip}
        if data is None:
            total = sum(count_positions(p) for p in shards)
            total = total if limit is None else min(total, limit)
            data = {k: v.new_empty((total, *v.shape[1:])) for k, v in part.items()}
        count = min(len(part["y"]), len(data["y"]) - at)
        for k, v in part.items():
            data[k][at:at + count] = v[:count]
        at += count
        if at == len(data["y"]):
            break
    return {k: v[:at] for k, v in data.items()}


class Depth2Probe(nn.Module):
    def __init__(self, variant: str, hidden: int, feat: int, width: int):
        super().__init__()
        self.variant = variant
        n = {"A": 3, "B": 4, "C": 5}[variant]
        self.fc = nn.Linear(feat, hidden, bias=False)
        self.norm = TreeSparkRMSNorm(hidden, 1e-5)
        self.up = nn.Linear(n * hidden, width)
        self.down = nn.Linear(width, n * hidden)
        self.out = nn.Linear(n * hidden, hidden)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        for m in (self.fc, self.up, self.down):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, f, e_y, h2, e_x0, h1):
        parts = [self.norm(self.fc(f)), e_y, h2]
        if self.variant in "BC":
            parts.append(e_x0)
        if self.variant == "C":
            parts.append(h1)
        x = torch.cat(parts, -1)
        x = x + self.down(F.silu(self.up(x)))
        return h2 + self.out(x)


def train(train_dir: str, dev_dir: str, variant: str, steps: int, lr: float = 1e-3, width: int = 2048,
          batch: int = 256, limit: int | None = None, weight_decay: float = 0.0):
    torch.manual_seed(0)
    target, drafter = models()
    embed, _, draft_head = drafter._target()
    E = embed.weight.detach().float()
    W = draft_head.weight.detach().float()
    index = torch.full((drafter.config.target_vocab_size,), -100, dtype=torch.long)
    index[drafter.draft_vocab_ids] = torch.arange(drafter.draft_vocab_ids.numel())
    markov = drafter.markov_head.float()
    for p in markov.parameters():
        p.requires_grad_(False)
    skip = () if variant == "C" else ("h1",)
    tr, dev = load(train_dir, limit, skip), load(dev_dir, None, skip)
    if variant != "C":
        tr["h1"] = dev["h1"] = torch.empty(0)
    if variant == "B":  # the package's own head: its weights load into a grown drafter as they are
        head = Depth2Head(TreeSparkConfig.from_dict({**drafter.config.to_dict(), "depth2_head": width}))
        for m in (head.fc, head.up, head.down):
            nn.init.normal_(m.weight, std=0.02)
        for m in (head.up, head.down, head.out):
            nn.init.zeros_(m.bias)
        nn.init.zeros_(head.out.weight)
        head.norm.weight.data.fill_(1.0)
    else:
        head = Depth2Probe(variant, drafter.config.hidden_size, tr["f"].shape[1], width)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)

    def logits(d, rows, with_head=True):
        h2 = d["h2"][rows].float()
        if with_head:
            h1 = d["h1"][rows].float() if len(d["h1"]) else None
            if variant == "B":
                h2 = head(d["f"][rows].float(), E[d["x0"][rows]], E[d["y"][rows]], h2)
            else:
                h2 = head(d["f"][rows].float(), E[d["y"][rows]], h2, E[d["x0"][rows]], h1)
        return h2 @ W.T + markov(d["y"][rows])

    @torch.no_grad()
    def top1(with_head=True):
        head.eval()
        right = n = 0
        for i in range(0, len(dev["y"]), 4096):
            rows = torch.arange(i, min(i + 4096, len(dev["y"])))
            pred = drafter.draft_vocab_ids[logits(dev, rows, with_head).argmax(-1)]
            right += int((pred == dev["label"][rows]).sum())
            n += len(rows)
        head.train()
        return 100.0 * right / n

    print(json.dumps({"variant": variant, "train_positions": len(tr["y"]), "dev_positions": len(dev["y"]),
                      "step": 0, "baseline_top1": round(top1(False), 2)}), flush=True)
    n = len(tr["y"])
    began = time.time()
    for step in range(1, steps + 1):
        rate = lr * min(1.0, step / 200) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))
        for g in opt.param_groups:
            g["lr"] = rate
        rows = torch.randint(0, n, (batch,))
        labels = index[tr["label"][rows]]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = logits(tr, rows)
        loss = F.cross_entropy(z.float(), labels, ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 500 == 0 or step == steps:
            print(json.dumps({"variant": variant, "step": step, "loss": round(loss.item(), 3),
                              "dev_top1": round(top1(), 2), "s": round(time.time() - began)}), flush=True)
    torch.save(head.state_dict(), Path(train_dir.split(",")[0]).parent / f"head_{variant}_{width}.pt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("extract")
    e.add_argument("output", type=output_dir)
    e.add_argument("--start", type=at_least(0), required=True)
    e.add_argument("--stop", type=at_least(1), required=True)
    e.add_argument("--data", type=existing_file, nargs="+", help="regenerated references (default: the shared "
                   "own-response data)")
    t = sub.add_parser("train")
    t.add_argument("train_dir", type=lambda v: ",".join(existing_dir(d) for d in v.split(",")),
                   help="a directory of extracted shards, or several joined by commas")
    t.add_argument("dev_dir", type=existing_dir)
    t.add_argument("--variant", choices=("A", "B", "C"), default="B")
    t.add_argument("--steps", type=at_least(1), default=4800)
    t.add_argument("--lr", type=positive_number, default=1e-3)
    t.add_argument("--width", type=at_least(1), default=1024)
    t.add_argument("--weight-decay", type=non_negative_number, default=0.0)
    s = sub.add_parser("ship")
    s.add_argument("head", type=existing_file)
    s.add_argument("--width", type=at_least(1), required=True)
    s.add_argument("--output", type=output_dir, required=True)
    args = p.parse_args()
    if args.command == "extract":
        check_range(e, args.start, args.stop)
        extract(args.output, args.start, args.stop, args.data)
    elif args.command == "train":
        train(args.train_dir, args.dev_dir, args.variant, args.steps, args.lr, args.width,
              weight_decay=args.weight_decay)
    else:
        ship(args.head, args.width, args.output)


if __name__ == "__main__":
    main()
