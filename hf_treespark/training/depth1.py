"""Training a drafter's depth-1 head (`config.depth1_head`, `modeling.Depth1Head`) apart from its block.

The head reads, per anchor `a`, the raw target features at `a - 1`, the anchor's embedding and the block's
anchor-slot state `h_1`, and adds its output to `h_1` (zero-initialised, so a grown drafter starts as it was).
With the block frozen those inputs are fixed per position, so they are computed once:

    extract   per reference: one target forward and one drafter pass with EVERY response position an anchor
              (the head off); the features at `a - 1`, `h_1`, `x_a` and the label `x_{a+1}` go to shards on disk
              (safetensors, bf16), resumably
    train     the head alone on shuffled positions: `CE(lm_head(head(...))[S] + W2(W1[x_a]), x_{a+1})`, the LM
              head and the Markov head frozen; AdamW, warm-up then cosine; checkpoints and a learning curve
              (teacher-forced depth-1 top-1 on development positions extracted the same way)

A position costs one small MLP and one LM-head product over the draft vocabulary, against a whole block of 7
slots and 7 depths for an anchor of `treespark train`: several hundred positions per second on a 2-core CPU.
Memory: the shards are read into memory whole, about 7 KB per position (SmolLM2-135M: 5 x 576 features and a
576-wide state in bf16).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..engine import target_features
from .data import ReferenceSequence, collate_references

SHARD_POSITIONS = 8192
FIELDS = ("features", "hidden", "token", "label")


@contextmanager
def head_off(drafter):
    """The drafter without its depth-1 head for the duration (its `h_1` as the head reads it)."""
    head = drafter.depth1_head
    drafter.depth1_head = None
    try:
        yield drafter
    finally:
        drafter.depth1_head = head


def block_signature(drafter) -> str:
    """A fingerprint of what `h_1` depends on (the drafter's weights outside the depth-1 head) and the feature
    layout: shards extracted for another drafter are refused."""
    digest = hashlib.sha256(json.dumps(drafter.config.target_layer_ids).encode())
    for name, tensor in sorted(drafter.state_dict().items()):
        if not name.startswith("depth1_head."):
            digest.update(name.encode())
            digest.update(tensor.detach().float().sum().item().hex().encode())
    return digest.hexdigest()[:16]


class PositionShards:
    """Extracted positions in `directory`: `shard_NNNNN.safetensors` plus `progress.json` (references done)."""

    def __init__(self, directory: str | Path, signature: str):
        self.directory = Path(directory)
        self.signature = signature
        self.directory.mkdir(parents=True, exist_ok=True)
        self.progress_path = self.directory / "progress.json"

    def progress(self) -> dict:
        if not self.progress_path.is_file():
            return {"signature": self.signature, "references_done": 0, "shards": 0, "positions": 0}
        state = json.loads(self.progress_path.read_text())
        if state.get("signature") != self.signature:
            raise ValueError(f"{self.directory} holds positions extracted for another drafter or target (signature "
                             f"{state.get('signature')}, this drafter's is {self.signature}): give another "
                             "directory or delete it")
        return state

    def write(self, columns: dict[str, list[torch.Tensor]], state: dict, references_done: int) -> dict:
        tensors = {k: torch.cat(v).contiguous() for k, v in columns.items()}
        name = self.directory / f"shard_{state['shards']:05d}.safetensors"
        save_file(tensors, str(name), metadata={"signature": self.signature})
        state = {**state, "references_done": references_done, "shards": state["shards"] + 1,
                 "positions": state["positions"] + len(tensors["label"])}
        tmp = self.progress_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.progress_path)  # the shard exists before progress names it
        return state

    def load(self, limit: int | None = None) -> dict[str, torch.Tensor]:
        """Every extracted position (the first `limit`), one tensor per field. The columns are allocated once and
        each shard copied in, so loading holds the positions and one shard, never two copies (1.9M positions of
        SmolLM2-135M are 13 GB)."""
        state = self.progress()
        counts = []
        for i in range(state["shards"]):
            with self._open(i) as f:
                counts.append(f.get_slice("label").get_shape()[0])
            if limit is not None and sum(counts) >= limit:
                break
        if not counts:
            raise ValueError(f"{self.directory} holds no extracted positions yet")
        total = sum(counts) if limit is None else min(sum(counts), limit)
        data, at = None, 0
        for i in range(len(counts)):
            with self._open(i) as f:
                shard = {k: f.get_tensor(k)[: total - at] for k in FIELDS}
            if data is None:
                data = {k: v.new_empty((total, *v.shape[1:])) for k, v in shard.items()}
            for k, v in shard.items():
                data[k][at:at + len(v)] = v
            at += len(shard["label"])
        return data

    @contextmanager
    def _open(self, i: int):
        """Shard `i`, opened and checked: refused by name when damaged or extracted for another drafter."""
        path = self.directory / f"shard_{i:05d}.safetensors"
        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("signature") != self.signature:
                    raise ValueError(f"{path} was extracted for another drafter or target: delete "
                                     f"{self.directory} and extract again")
                yield f
        except (OSError, RuntimeError, SafetensorError) as e:  # a truncated or damaged file
            raise ValueError(f"{path} is damaged ({e}): delete it and {self.progress_path}, then extract "
                             "again") from None


@torch.no_grad()
def extract(target, drafter, references: list[ReferenceSequence], shards: PositionShards, chunk: int = 96,
            shard_positions: int = SHARD_POSITIONS, progress: bool = True) -> dict:
    """Write every response position of `references` (in order, resuming after those done) to `shards`."""
    state = shards.progress()
    columns = {k: [] for k in FIELDS}
    pending = 0
    todo = range(state["references_done"], len(references))
    with head_off(drafter):
        for n in tqdm(todo, desc="extracting depth-1 positions", disable=not progress):
            ref = references[n]
            batch = collate_references([ref], pad_id=0)
            ids = batch["input_ids"][0]
            feats, _ = target_features(target, drafter.config.target_layer_ids, batch["input_ids"],
                                       batch["attention_mask"])
            anchors = torch.arange(max(ref.prompt_len, 1), len(ids) - 1)
            for start in range(0, len(anchors), chunk):
                a = anchors[start:start + chunk]
                out = drafter(anchor_ids=ids[a][None], anchor_positions=a[None], target_features=feats,
                              return_logits=False)
                columns["features"].append(feats[0, a - 1].to(torch.bfloat16))
                columns["hidden"].append(out.hidden_states.view(len(a), drafter.config.block_size, -1)[:, 0]
                                         .to(torch.bfloat16))
                columns["token"].append(ids[a])
                columns["label"].append(ids[a + 1])
                pending += len(a)
            if pending >= shard_positions or n == len(references) - 1:
                state = shards.write(columns, state, n + 1)
                columns, pending = {k: [] for k in FIELDS}, 0
    return state


class Depth1Trainer:
    """The head's optimisation on extracted positions (see the module docstring); resumable from `output_dir`."""

    def __init__(self, drafter, output_dir: str | Path, lr: float = 1e-3, batch_size: int = 256,
                 warmup: int = 200, weight_decay: float = 0.0, seed: int = 0):
        if drafter.depth1_head is None:
            raise ValueError("this drafter has no depth-1 head: grow it first (grow_depth1_head)")
        self.drafter = drafter
        self.out = Path(output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lr, self.batch_size, self.warmup, self.seed = lr, batch_size, warmup, seed
        for name, p in drafter.named_parameters():
            p.requires_grad_(name.startswith("depth1_head."))
        self.params = [p for p in drafter.depth1_head.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        index = torch.full((drafter.config.target_vocab_size,), -100, dtype=torch.long)
        ids = drafter.draft_vocab_ids if drafter.draft_vocab_ids is not None else torch.arange(len(index))
        index[ids] = torch.arange(ids.numel())
        self.draft_index = index
        self.step = 0
        self.embed = drafter._target()[0].weight.detach()

    def logits(self, data: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        drafter = self.drafter
        dtype = drafter.fc.weight.dtype
        token = data["token"][rows]
        hidden = drafter.depth1_head(drafter._standardised(data["features"][rows]), self.embed[token].to(dtype),
                                     data["hidden"][rows].to(dtype))
        return drafter.depth_logits(hidden) + drafter.markov_bias(token)

    @torch.no_grad()
    def top1(self, data: dict[str, torch.Tensor]) -> float:
        """Teacher-forced depth-1 top-1 (%) on `data`."""
        self.drafter.eval()
        right = 0
        for i in range(0, len(data["label"]), 2048):
            rows = torch.arange(i, min(i + 2048, len(data["label"])))
            pred = self.drafter.to_target_ids(self.logits(data, rows).argmax(-1))
            right += int((pred == data["label"][rows]).sum())
        return 100.0 * right / len(data["label"])

    def rate(self, total_steps: int) -> float:
        if self.step < self.warmup:
            return self.lr * (self.step + 1) / self.warmup
        progress = (self.step - self.warmup) / max(1, total_steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def batches(self, n: int, total_steps: int) -> Iterable[torch.Tensor]:
        """Row indices of each remaining step: epoch `e` is a permutation seeded by `(seed, e)`, so a resumed run
        continues the same order."""
        per_epoch = n // self.batch_size
        while self.step < total_steps:
            epoch, offset = divmod(self.step, per_epoch)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
            yield perm[offset * self.batch_size:(offset + 1) * self.batch_size]

    def save(self) -> None:
        state = {"step": self.step, "head": self.drafter.depth1_head.state_dict(),
                 "optimizer": self.optimizer.state_dict()}
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "checkpoint.pt")

    def resume(self) -> bool:
        path = self.out / "checkpoint.pt"
        if not path.is_file():
            return False
        try:
            state = torch.load(path, weights_only=True)
        except Exception as e:  # a file cut by a crash: refused, not half-loaded
            raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); delete it to start over") from None
        self.drafter.depth1_head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        return True

    def train(self, data: dict[str, torch.Tensor], total_steps: int, dev: dict[str, dict[str, torch.Tensor]],
              eval_every: int = 500, save_every: int = 500, progress: bool = True) -> list[dict]:
        """Run to `total_steps` optimizer steps; every `eval_every` steps (and at the start and the end) append
        `{"step", "positions_seen", "seconds", "<dev name>_top1"...}` to `OUTPUT_DIR/metrics.jsonl`."""
        metrics = self.out / "metrics.jsonl"
        labels = self.draft_index[data["label"]]
        curve, start, seconds = [], time.time(), 0.0

        def record():
            row = {"step": self.step, "positions_seen": self.step * self.batch_size,
                   "seconds": round(seconds + time.time() - start, 1),
                   **{f"{name}_top1": round(self.top1(d), 2) for name, d in dev.items()}}
            with open(metrics, "a") as f:
                f.write(json.dumps(row) + "\n")
            curve.append(row)
            return row

        if self.step == 0:
            record()
        bar = tqdm(total=total_steps, initial=self.step, desc="training the depth-1 head", disable=not progress)
        for rows in self.batches(len(labels), total_steps):
            self.drafter.train()
            for group in self.optimizer.param_groups:
                group["lr"] = self.rate(total_steps)
            loss = F.cross_entropy(self.logits(data, rows), labels[rows], ignore_index=-100)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if self.step % save_every == 0 or self.step == total_steps:
                self.save()
            if self.step % eval_every == 0 or self.step == total_steps:
                bar.write(json.dumps(record()))
        bar.close()
        self.drafter.eval()
        return curve


def grow_depth1_head(drafter, width: int):
    """A copy of `drafter` with a fresh depth-1 head of MLP width `width` (drafting exactly as before until it is
    trained); a drafter that has one is returned as it is."""
    if drafter.depth1_head is not None:
        return drafter
    from ..configuration import TreeSparkConfig

    config = TreeSparkConfig.from_dict({**drafter.config.to_dict(), "depth1_head": width})
    grown = type(drafter)(config).to(drafter.fc.weight.dtype)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any(not name.startswith("depth1_head.") for name in missing):
        raise ValueError(f"cannot grow this drafter: keys {unexpected or missing} do not match")
    grown.datastore = drafter.datastore
    return grown


def add_arguments(p) -> None:
    p.add_argument("--drafter", help="drafter directory to grow and train (default: the shipped drafter)")
    p.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a name/path")
    p.add_argument("--data", nargs="+", required=True, help="reference files (prompt_ids, response_ids; .jsonl[.gz])")
    p.add_argument("--max-length", type=int, default=384, help="tokens per reference sequence (longer are cut)")
    p.add_argument("--max-sequences", type=int, help="use at most this many reference sequences")
    p.add_argument("--dev-data", help="development references (default: held-out ShareGPT prompts 400-431 answered "
                                      "by the target into OUTPUT_DIR/dev_references.jsonl)")
    p.add_argument("--width", type=int, default=2048, help="the head's MLP width (a fresh head)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the extracted positions")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warm-up, cosine to a tenth)")
    p.add_argument("--batch-size", type=int, default=256, help="positions per optimizer step")
    p.add_argument("--eval-every", type=int, default=500, help="steps between development evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True,
                   help="positions, checkpoint, metrics.jsonl and the trained drafter (final/); rerun to resume")


def run(args) -> int:
    """`treespark train-depth1`: grow a drafter by a depth-1 head, extract positions, train the head, save."""
    from ..assets import DEFAULT_DRAFTER_DIR
    from ..modeling import TreeSparkDrafter
    from ..tree import TreePolicy
    from .cli import load_target
    from .data import load_references
    from .evaluate import build_dev_set, reference_acceptance

    torch.manual_seed(args.seed)
    out = Path(args.output_dir)
    target, tokenizer = load_target(args.target, with_tokenizer=True)
    source = args.drafter or DEFAULT_DRAFTER_DIR
    base = TreeSparkDrafter.from_pretrained(source, dtype=torch.float32)
    stored_dtype = base.config.dtype if isinstance(getattr(base.config, "dtype", None), str) else "bfloat16"
    drafter = grow_depth1_head(base, args.width).bind_target(target).eval()
    references = load_references(args.data, max_length=args.max_length, limit=args.max_sequences,
                                 vocab_size=target.config.vocab_size)
    dev_refs = (load_references(args.dev_data, max_length=args.max_length) if args.dev_data
                else build_dev_set(target, tokenizer, out / "dev_references.jsonl"))
    signature = block_signature(drafter)
    train_shards, dev_shards = PositionShards(out / "positions", signature), PositionShards(out / "dev_positions",
                                                                                            signature)
    extract(target, drafter, dev_refs, dev_shards)
    extract(target, drafter, references, train_shards)
    data, dev = train_shards.load(), {"dev": dev_shards.load()}
    trainer = Depth1Trainer(drafter, out, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
    if trainer.resume():
        print(f"[train-depth1] resumed at step {trainer.step}")
    total = int(args.epochs * len(data["label"]) // args.batch_size)
    print(f"[train-depth1] {len(data['label']):,} positions from {len(references)} references; {total} steps of "
          f"{args.batch_size}")
    trainer.train(data, total, dev, eval_every=args.eval_every)
    policy = TreePolicy.from_config(drafter.config, budget=8)
    if trainer.step:
        with head_off(drafter):
            before = reference_acceptance(target, drafter, dev_refs, policy)
        after = reference_acceptance(target, drafter, dev_refs, policy)
        print(f"[train-depth1] development acceptance at budget 8: {before['acceptance_length']:.3f} -> "
              f"{after['acceptance_length']:.3f}; depth 1 {100 * before['depth_rates'][0]:.1f}% -> "
              f"{100 * after['depth_rates'][0]:.1f}%")
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.step, "dev_acceptance_before": before,
                                "dev_acceptance_after": after}) + "\n")
    final = out / "final"
    drafter.save_pretrained(final, dtype=getattr(torch, stored_dtype))
    print(f"[train-depth1] saved {final}")
    return 0
