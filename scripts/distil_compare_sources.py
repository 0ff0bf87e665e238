"""Off-policy (ShareGPT assistant text) vs on-policy (the target's own responses) at equal positions and steps:
`distil_batch` positions (all anchors) from each source, then the same fresh depth-1 head trained by `Depth1Trainer`
(global shuffle) on each; development top-1 every 100 steps. A measurement script, not part of the package.

    python scripts/distil_compare_sources.py POSITIONS STEPS LR [OWN_RESPONSES_CHAT_JSONL] [DEV_POSITIONS_DIR]

OWN_RESPONSES_CHAT_JSONL: the target's own answers as chat records (`{"messages": [user, assistant]}`);
DEV_POSITIONS_DIR: the `dev_positions` of a `treespark distil` run (default: runs/distil_agree/...)."""
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from script_args import at_least

from hf_treespark import load_default_target
from hf_treespark.drafter.modeling import TreeSparkDrafter
from hf_treespark.hub.assets import DEFAULT_DRAFTER_DIR
from hf_treespark.training.depth1 import Depth1Trainer, PositionShards, block_signature, grow_depth1_head
from hf_treespark.training.distill_extract import _batched, distil_batch
from hf_treespark.training.distill_sources import text_sequences

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("positions", type=at_least(1), help="positions of each source")
parser.add_argument("steps", type=at_least(1), help="optimizer steps of 256 positions")
parser.add_argument("lr", type=float, help="peak learning rate")
parser.add_argument("own", nargs="?", default="runs/regen_chat.jsonl", help="the target's own answers, chat JSONL")
parser.add_argument("dev_dir", nargs="?", default="runs/distil_agree/dev_positions", help="development positions")
args = parser.parse_args()
for path in (args.own, args.dev_dir):
    if not Path(path).exists():
        parser.error(f"{path}: no such file or directory")
if not 0 < args.lr < 1:
    parser.error(f"lr must be between 0 and 1, got {args.lr}")
positions, steps, lr, own, dev_dir = args.positions, args.steps, args.lr, args.own, args.dev_dir
target, tok = load_default_target(dtype="auto")
base = TreeSparkDrafter.from_pretrained(DEFAULT_DRAFTER_DIR, dtype=torch.float32)
def fresh():
    torch.manual_seed(0)
    return grow_depth1_head(base, 2048, fresh=True).bind_target(target).eval()
d0 = fresh()
dev = PositionShards(dev_dir, block_signature(d0)).load()
results = {}
for name, source in (("own responses", own), ("sharegpt", "sharegpt")):
    t = time.time()
    parts, n = [], 0
    for batch in _batched(text_sequences([source], tok, "assistant", 512), 8):
        parts.append(distil_batch(target, d0, batch, anchors="all"))
        n += len(parts[-1]["label"])
        if n >= positions:
            break
    data = {k: torch.cat([p[k] for p in parts])[:positions] for k in parts[0]}
    print(name, len(data["label"]), "positions in", round(time.time() - t), "s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        curve = Depth1Trainer(fresh(), tmp, lr=lr, batch_size=256).train(data, steps, {"dev": dev}, eval_every=100,
                                                                          progress=False)
    results[name] = [(r["step"], r["dev_top1"]) for r in curve]
    print(name, results[name], flush=True)
print(json.dumps({"positions": positions, "steps": steps, "lr": lr, "curves": results}))
