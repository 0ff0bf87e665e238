"""Training a drafter's depth-1 head (`config.depth1_head`, `modeling.Depth1Head`) apart from its block.

The head reads, per anchor `a`, the raw target features at `a - 1`, the anchor's embedding and the block's
anchor-slot state `h_1`, and adds its output to `h_1` (zero-initialised, so a grown drafter starts as it was).
With the block frozen those inputs are fixed per position, so they are computed once:

    extract   per reference: one target forward and one drafter pass with EVERY response position an anchor
              (the head off); the features at `a - 1`, `h_1`, `x_a` and the label `x_{a+1}` go to shards on disk
              (safetensors, bf16), resumably
    train     the head alone on shuffled positions: `CE(lm_head(head(...))[S] + W2(W1[x_a]), x_{a+1})`, the LM
              head and the Markov head frozen; AdamW, warm-up then cosine; checkpoints and a learning curve
              (teacher-forced depth-1 top-1 on development positions extracted the same way); with `--soft-targets K`
              the target's top-K probabilities are stored too and mixed into the loss (`soft_targets.py`)

A position costs one small MLP and one LM-head product over the draft vocabulary, against a whole block of 7
slots and 7 depths for an anchor of `treespark train`: several hundred positions per second on a 2-core CPU.
Memory: the shards are read into memory whole, about 7 KB per position (SmolLM2-135M: 5 x 576 features and a
576-wide state in bf16).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from array import array
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..arg_types import at_least, positive_number
from ..decoding.engine import target_features
from . import soft_targets as soft
from .data import ReferenceSequence, collate_references

SHARD_POSITIONS = 8192  # positions per shard: a run killed during extraction extracts at most these again
SAVE_EVERY = 500  # optimizer steps between checkpoints of `train-depth1`
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
    """A fingerprint of what `h_1` depends on (the drafter's weights outside the depth heads) and the feature
    layout: shards extracted for another drafter are refused."""
    digest = hashlib.sha256(json.dumps(drafter.config.target_layer_ids).encode())
    for name, tensor in sorted(drafter.state_dict().items()):
        if not name.startswith(("depth1_head.", "depth2_head.")):
            digest.update(name.encode())
            digest.update(tensor.detach().float().sum().item().hex().encode())
    return digest.hexdigest()[:16]


def data_fingerprint(references: list[ReferenceSequence], files: list[str], max_length: int) -> dict:
    """What positions are extracted from: `fingerprint`, a hash over every reference's prompt length and token ids
    in order (so other files, another order, another cut or --max-sequences differ), and, for messages, the
    `files`, the number of `references` and `max_length`."""
    digest = hashlib.sha256()
    for ref in references:
        digest.update(array("q", [ref.prompt_len, len(ref.input_ids), *ref.input_ids]).tobytes())
    return {"fingerprint": digest.hexdigest()[:16], "files": [str(f) for f in files], "references": len(references),
            "max_length": max_length}


def describe_data(data: dict) -> str:
    """`data` (a `data_fingerprint`) in words."""
    return (f"{', '.join(data.get('files', ['?']))}: {data.get('references', '?')} references at --max-length "
            f"{data.get('max_length', '?')}, hash {data.get('fingerprint')}")


def read_progress(path: Path) -> dict:
    """`progress.json` of a positions directory; a damaged one is refused naming it and what to do."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not all(isinstance(state.get(k), int) and state[k] >= 0
                                                  for k in ("references_done", "shards", "positions")):
            raise ValueError("not the record of an extraction")
    except (UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is damaged ({e}): delete {path.parent} to extract its positions again") from None
    return state


class PositionShards:
    """Extracted positions in `directory`: `shard_NNNNN.safetensors` plus `progress.json` (references done, and
    given `data`, a `data_fingerprint` of the references they come from: positions of other data are refused)."""

    def __init__(self, directory: str | Path, signature: str, data: dict | None = None):
        self.directory = Path(directory)
        self.signature = signature
        self.data = data
        self.directory.mkdir(parents=True, exist_ok=True)
        self.progress_path = self.directory / "progress.json"

    def progress(self) -> dict:
        if not self.progress_path.is_file():
            fresh = {"signature": self.signature, "references_done": 0, "shards": 0, "positions": 0}
            return fresh if self.data is None else {**fresh, "data": self.data}
        state = read_progress(self.progress_path)
        if state.get("signature") != self.signature:
            soft.check_soft_targets(state.get("signature"), soft.signature_soft_targets(self.signature), self.directory)
            raise ValueError(f"{self.directory} holds positions extracted for another drafter or target (signature "
                             f"{state.get('signature')}, this drafter's is {self.signature}): give another "
                             "directory or delete it")
        held = state.get("data")  # None: extracted by an earlier version, which did not record it
        if self.data is not None and held is not None and held.get("fingerprint") != self.data["fingerprint"]:
            raise ValueError(f"{self.directory} holds positions extracted from other data ({describe_data(held)}), "
                             f"not from {describe_data(self.data)}: give another output directory, or delete "
                             f"{self.directory} to extract this data")
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
                shard = {k: f.get_tensor(k)[: total - at] for k in f.keys()}  # FIELDS, and SOFT_FIELDS if held
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
def reference_positions(target, drafter, ref: ReferenceSequence, chunk: int = 96,
                        soft_k: int = 0) -> dict[str, torch.Tensor]:
    """Every response position of `ref`, one tensor per field of `FIELDS` (the drafter's head off): `features`
    `[P, n_layers * d]` (bf16, the target's at `a - 1`), `hidden` `[P, d]` (bf16, `h_1`), `token` and `label` `[P]`;
    with `soft_k`, also `soft.SOFT_FIELDS` `[P, soft_k]`: the target's top-K at `a` from the same forward."""
    device = next(target.parameters()).device
    batch = {k: v.to(device) for k, v in collate_references([ref], pad_id=0).items()}
    ids = batch["input_ids"][0]
    feats, final = target_features(target, drafter.config.target_layer_ids, batch["input_ids"], batch["attention_mask"])
    anchors = torch.arange(max(ref.prompt_len, 1), len(ids) - 1, device=device)
    columns = {k: [] for k in FIELDS + (soft.SOFT_FIELDS if soft_k else ())}
    for start in range(0, len(anchors), chunk):
        a = anchors[start:start + chunk]
        out = drafter(anchor_ids=ids[a][None], anchor_positions=a[None], target_features=feats, return_logits=False)
        columns["features"].append(feats[0, a - 1].to(torch.bfloat16))
        columns["hidden"].append(out.hidden_states.view(len(a), drafter.config.block_size, -1)[:, 0]
                                 .to(torch.bfloat16))
        columns["token"].append(ids[a])
        columns["label"].append(ids[a + 1])
        if soft_k:  # the target's logits at `a` from its final states: no second forward
            for k, v in soft.top_k_targets(target.get_output_embeddings()(final[0, a]), soft_k,
                                           drafter.draft_vocab_ids).items():
                columns[k].append(v)
    return {k: torch.cat(v).cpu() for k, v in columns.items()}  # shards are written from the CPU


@torch.no_grad()
def extract(target, drafter, references: list[ReferenceSequence], shards: PositionShards, chunk: int = 96,
            shard_positions: int = SHARD_POSITIONS, progress: bool = True, soft_k: int = 0) -> dict:
    """Write every response position of `references` (in order, resuming after those done) to `shards` (with the
    target's top-`soft_k` soft targets when `soft_k > 0`: `reference_positions`).

    A shard holds whole references and `progress.json` names it only once it is written: a run killed anywhere
    extracts again at most the references after the last shard, and never twice. On an interrupt
    (`KeyboardInterrupt`) the references finished since then are written first."""
    state = shards.progress()
    pending: list[tuple[int, dict[str, torch.Tensor]]] = []  # (index, positions) of references not yet written
    count = 0
    try:
        with head_off(drafter):
            for n in tqdm(range(state["references_done"], len(references)), desc="extracting depth-1 positions",
                          disable=not progress):
                pending.append((n, reference_positions(target, drafter, references[n], chunk, soft_k)))
                count += len(pending[-1][1]["label"])
                if count >= shard_positions or n == len(references) - 1:
                    state = _write_references(shards, pending, state)
                    pending, count = [], 0
    except KeyboardInterrupt:
        state = shards.progress()  # what is on disk decides what is left to write
        unwritten = [(n, p) for n, p in pending if n >= state["references_done"]]
        if unwritten and unwritten[0][0] == state["references_done"]:
            _write_references(shards, unwritten, state)
        raise
    return state


def _write_references(shards: PositionShards, pending: list[tuple[int, dict]], state: dict) -> dict:
    """One shard of the consecutive references `pending`; the progress after them."""
    return shards.write({k: [p[k] for _, p in pending] for k in pending[0][1]}, state, pending[-1][0] + 1)


def load_checkpoint(path: Path) -> dict:
    """A `Depth1Trainer` checkpoint; one cut by a crash or otherwise unreadable is refused, not half-loaded."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); delete it to start over") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{path} is damaged (not a depth-1 head checkpoint); delete it to start over")
    return state


class Depth1Trainer:
    """The head's optimisation on extracted positions (see the module docstring); resumable from `output_dir`."""

    def __init__(self, drafter, output_dir: str | Path, lr: float = 1e-3, batch_size: int = 256,
                 warmup: int = 200, weight_decay: float = 0.0, seed: int = 0, data: dict | None = None,
                 soft_weight: float = 0.0):
        """`data`: the `data_fingerprint` of the positions trained on, kept in the checkpoint; a checkpoint of
        other data is refused on resume. `soft_weight`: the soft targets' share of the loss (`soft.head_loss`)."""
        if drafter.depth1_head is None:
            raise ValueError("this drafter has no depth-1 head: grow it first (grow_depth1_head)")
        self.drafter = drafter
        self.out = Path(output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lr, self.batch_size, self.warmup, self.seed, self.data = lr, batch_size, warmup, seed, data
        self.soft_weight = soft_weight
        for name, p in drafter.named_parameters():
            p.requires_grad_(name.startswith("depth1_head."))
        self.params = [p for p in drafter.depth1_head.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        device = drafter.fc.weight.device
        index = torch.full((drafter.config.target_vocab_size,), -100, dtype=torch.long, device=device)
        ids = drafter.draft_vocab_ids
        ids = ids if ids is not None else torch.arange(len(index), device=device)
        index[ids] = torch.arange(ids.numel(), device=device)
        self.draft_index = index
        self.step = 0
        self.embed = drafter._target()[0].weight.detach()

    def logits(self, data: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        drafter = self.drafter
        dtype, device = drafter.fc.weight.dtype, drafter.fc.weight.device  # stored positions may lie on the CPU
        token = data["token"][rows].to(device)
        hidden = drafter.depth1_head(drafter._standardised(data["features"][rows].to(device)),
                                     self.embed[token].to(dtype), data["hidden"][rows].to(device, dtype))
        return drafter.depth_logits(hidden) + drafter.markov_bias(token)

    @torch.no_grad()
    def top1(self, data: dict[str, torch.Tensor]) -> float:
        """Teacher-forced depth-1 top-1 (%) on `data`."""
        self.drafter.eval()
        right = 0
        for i in range(0, len(data["label"]), 2048):
            rows = torch.arange(i, min(i + 2048, len(data["label"])), device=data["label"].device)
            pred = self.drafter.to_target_ids(self.logits(data, rows).argmax(-1))
            right += int((pred == data["label"][rows].to(pred.device)).sum())
        return 100.0 * right / len(data["label"])

    def rate(self, total_steps: int) -> float:
        if self.step < self.warmup:
            return self.lr * (self.step + 1) / self.warmup
        progress = (self.step - self.warmup) / max(1, total_steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def batches(self, n: int, total_steps: int) -> Iterable[torch.Tensor]:
        """Row indices of each remaining step: epoch `e` is a permutation seeded by `(seed, e)`, so a resumed run
        continues the same order. Fewer than `batch_size` positions: every step takes all `n`."""
        if n < 1:
            raise ValueError("no positions to train on: extract some first")
        per_epoch = max(1, n // self.batch_size)
        while self.step < total_steps:
            epoch, offset = divmod(self.step, per_epoch)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
            yield perm[offset * self.batch_size:(offset + 1) * self.batch_size]

    def save(self) -> None:
        state = {"step": self.step, "head": self.drafter.depth1_head.state_dict(),
                 "optimizer": self.optimizer.state_dict()}
        if self.data is not None:
            state["data"] = self.data
        if self.soft_weight:
            state["soft_weight"] = self.soft_weight
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "checkpoint.pt")

    def resume(self) -> bool:
        path = self.out / "checkpoint.pt"
        if not path.is_file():
            return False
        state = load_checkpoint(path)
        held = state.get("data")  # None: saved by an earlier version, which did not record it
        if self.data is not None and held is not None and held.get("fingerprint") != self.data["fingerprint"]:
            raise ValueError(f"{path} holds a head trained on other data ({describe_data(held)}), not on "
                             f"{describe_data(self.data)}: give another output directory, or delete it to train "
                             "from the start")
        soft.check_soft_weight(state.get("soft_weight", 0.0), self.soft_weight, path)
        try:
            self.drafter.depth1_head.load_state_dict(state["head"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, RuntimeError, ValueError) as e:
            why = " ".join(str(e).split())[:200]
            raise ValueError(f"{path} holds another head (another --width or drafter?): {why}; give the options "
                             "it was trained with, another output directory, or delete it to train from the "
                             "start") from None
        self.step = state["step"]
        return True

    def train(self, data: dict[str, torch.Tensor], total_steps: int, dev: dict[str, dict[str, torch.Tensor]],
              eval_every: int = 500, save_every: int = 500, progress: bool = True) -> list[dict]:
        """Run to `total_steps` optimizer steps; every `eval_every` steps (and at the start and the end) append
        `{"step", "positions_seen", "seconds", "<dev name>_top1"...}` to `OUTPUT_DIR/metrics.jsonl`."""
        metrics = self.out / "metrics.jsonl"
        labels = self.draft_index[data["label"].to(self.draft_index.device)]
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
        stepping, first_step = False, self.step  # stepping: between the optimizer's update and its step count
        try:
            for rows in self.batches(len(labels), total_steps):
                self.drafter.train()
                for group in self.optimizer.param_groups:
                    group["lr"] = self.rate(total_steps)
                loss = soft.head_loss(self.logits(data, rows), labels[rows], data, rows, self.soft_weight)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                stepping = True
                self.optimizer.step()
                self.step += 1
                stepping = False
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
                if self.step % save_every == 0 or self.step == total_steps:
                    self.save()
                if self.step % eval_every == 0 or self.step == total_steps:
                    bar.write(json.dumps(record()))
        except KeyboardInterrupt:  # keep the steps done (not a half-made one: the last checkpoint stands)
            if not stepping and self.step > first_step:
                self.save()
            raise
        finally:
            bar.close()
        self.drafter.eval()
        return curve


def grow_depth1_head(drafter, width: int, fresh: bool = False):
    """A copy of `drafter` with a fresh depth-1 head of MLP width `width` (drafting exactly as before until it is
    trained); a drafter that has one is returned as it is, unless `fresh` (its head is replaced by a fresh one)."""
    return grow_head(drafter, "depth1_head", width, fresh)


def grow_head(drafter, head: str, width: int, fresh: bool = False):
    """`grow_depth1_head` for the head `head` (`"depth1_head"` or `"depth2_head"`, the config field and module)."""
    if getattr(drafter, head) is not None and not fresh:
        return drafter
    from ..drafter.configuration import TreeSparkConfig

    config = TreeSparkConfig.from_dict({**drafter.config.to_dict(), head: width})
    grown = type(drafter)(config).to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    kept = {k: v for k, v in drafter.state_dict().items() if not k.startswith(head + ".")}
    missing, unexpected = grown.load_state_dict(kept, strict=False)
    if unexpected or any(not name.startswith(head + ".") for name in missing):
        raise ValueError(f"cannot grow this drafter: keys {unexpected or missing} do not match")
    grown.datastore = drafter.datastore
    return grown


def add_arguments(p) -> None:
    if p.description is None:
        p.description = ("Grow a drafter by a depth-1 head and train the head alone on positions extracted from "
                         "regenerated answers. Labels: the next token of each response, that is the target's own "
                         "greedy choice there. For any text (chats, .txt, ShareGPT), `treespark distil` labels each "
                         "position with the target's own argmax, teacher-forced.")
    p.add_argument("--drafter", help="drafter directory to grow and train (default: the shipped drafter)")
    p.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a name/path")
    p.add_argument("--data", nargs="+", required=True,
                   help="regeneration files (prompt_ids, response_ids; .jsonl[.gz]): the target's own answers")
    p.add_argument("--max-length", type=at_least(2), default=384,
                   help="tokens per reference sequence (longer are cut)")
    p.add_argument("--max-sequences", type=at_least(1), help="use at most this many reference sequences")
    p.add_argument("--dev-data", help="development references, read whole whatever --max-length (default: the "
                                      "committed development set, 207 held-out prompts of five kinds answered by the "
                                      "default target, training_data/dev/dev_set.jsonl.gz; another --target answers "
                                      "the same prompts once into OUTPUT_DIR/dev_set.jsonl.gz)")
    p.add_argument("--width", type=at_least(1), default=2048, help="the head's MLP width (a fresh head)")
    p.add_argument("--fresh-head", action="store_true", help="replace the drafter's depth-1 head, if it has one, by "
                   "a fresh one of --width (to compare losses or data from the same start); default: train its head")
    p.add_argument("--epochs", type=positive_number, default=2.0, help="passes over the extracted positions")
    p.add_argument("--lr", type=positive_number, default=1e-3, help="peak learning rate (warm-up, cosine to a tenth)")
    p.add_argument("--batch-size", type=at_least(1), default=256,
                   help="positions per optimizer step (all of them when there are fewer)")
    p.add_argument("--eval-every", type=at_least(1), default=500, help="steps between development evaluations")
    soft.add_soft_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True,
                   help="positions, checkpoint, metrics.jsonl and the trained drafter (final/); rerun the same "
                        "command to resume (positions and checkpoint are kept for their --data only)")


def check_arguments(args) -> None:
    """Refuse, before anything loads, empty values, missing files and an output directory that is a file."""
    for name in ("target", "drafter", "dev_data", "output_dir"):
        if isinstance(getattr(args, name), str) and not getattr(args, name).strip():
            raise ValueError(f"--{name.replace('_', '-')} is empty: give a value")
    for flag, path in [*(("--data", p) for p in args.data), ("--dev-data", args.dev_data)]:
        if path is None or Path(path).is_file():
            continue
        if not str(path).strip():
            raise ValueError(f"{flag} is empty: give a file")
        what = "a directory, not a file" if Path(path).is_dir() else "no such file"
        raise FileNotFoundError(f"{flag} {path}: {what}")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise NotADirectoryError(f"--output-dir {args.output_dir} is a file: give a directory")
    soft.check_soft_arguments(args)


def refuse_other_data(out: Path, data: dict, soft_k: int = 0, soft_weight: float = 0.0) -> None:
    """Before anything loads: refuse an `out` whose positions or head come from other data than `data` (a
    `data_fingerprint`), or with soft targets of another K than `soft_k` or another weight than `soft_weight`, naming
    both and what to do; warn that those of an earlier version cannot be checked."""
    held = {}
    if (out / "positions" / "progress.json").is_file():
        state = read_progress(out / "positions" / "progress.json")
        soft.check_soft_targets(state.get("signature"), soft_k, out / "positions")
        held[out / "positions"] = state.get("data")
    if (out / "checkpoint.pt").is_file():
        state = load_checkpoint(out / "checkpoint.pt")
        soft.check_soft_weight(state.get("soft_weight", 0.0), soft_weight, out / "checkpoint.pt")
        held[out / "checkpoint.pt"] = state.get("data")
    other = [d for d in held.values() if d is not None and d.get("fingerprint") != data["fingerprint"]]
    if other:
        raise ValueError(f"{out} holds a run on other data ({describe_data(other[0])}), not on this --data "
                         f"({describe_data(data)}): give another --output-dir, or delete "
                         f"{' and '.join(map(str, held))} to extract and train on this data there")
    unchecked = [str(path) for path, d in held.items() if d is None]
    if unchecked:
        print(f"[train-depth1] warning: {' and '.join(unchecked)} come from an earlier version that did not record "
              "its data: resuming, but whether it is this --data cannot be checked", file=sys.stderr)


def run(args) -> int:
    """`treespark train-depth1`: grow a drafter by a depth-1 head, extract positions, train the head, save. An
    interrupt (Ctrl-C) keeps what is done and says how to resume."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("treespark train-depth1: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def _run(args) -> int:
    from ..drafter.modeling import TreeSparkDrafter
    from ..hub.assets import DEFAULT_DRAFTER_DIR
    from .cli import load_target, load_target_config
    from .data import load_references
    from .dev_set import DEV_MAX_LENGTH, default_dev_set, ensure_dev_set, load_dev_set

    check_arguments(args)
    torch.manual_seed(args.seed)
    out = Path(args.output_dir)
    vocab_size = load_target_config(args.target).vocab_size
    references = load_references(args.data, max_length=args.max_length, limit=args.max_sequences,
                                 vocab_size=vocab_size)
    if not references:
        raise ValueError(f"{', '.join(map(str, args.data))} holds no usable reference sequences (prompt_ids and "
                         f"response_ids with at least 2 response tokens within --max-length {args.max_length}): give "
                         "the target's responses")
    dev_path = Path(args.dev_data) if args.dev_data else default_dev_set(args.target, out)
    dev_refs = load_dev_set(dev_path, vocab_size=vocab_size) if dev_path.is_file() else None
    if dev_refs == []:
        raise ValueError(f"--dev-data {args.dev_data} holds no usable reference sequences")
    data = data_fingerprint(references, args.data, args.max_length)
    refuse_other_data(out, data, args.soft_targets, args.soft_weight)
    target, tokenizer = load_target(args.target, with_tokenizer=dev_refs is None)
    base = TreeSparkDrafter.from_pretrained(args.drafter or DEFAULT_DRAFTER_DIR, dtype=torch.float32)
    stored_dtype = base.config.dtype if isinstance(getattr(base.config, "dtype", None), str) else "bfloat16"
    drafter = grow_depth1_head(base, args.width, fresh=args.fresh_head).bind_target(target).eval()
    if dev_refs is None:  # another target: the development prompts answered by it, once
        dev_refs = load_dev_set(ensure_dev_set(dev_path, target, tokenizer), vocab_size=vocab_size)
    signature = block_signature(drafter)
    dev_data = data_fingerprint(dev_refs, [dev_path], DEV_MAX_LENGTH)
    dev_shards = PositionShards(out / "dev_positions", signature, dev_data)
    train_shards = PositionShards(out / "positions", soft.soft_signature(signature, args.soft_targets), data)
    extract(target, drafter, dev_refs, dev_shards, shard_positions=SHARD_POSITIONS)
    done = train_shards.progress()["references_done"]
    if 0 < done < len(references):
        print(f"[train-depth1] resuming extraction at reference {done + 1} of {len(references)} (the positions of "
              f"the first {done} are in {train_shards.directory})")
    extract(target, drafter, references, train_shards, shard_positions=SHARD_POSITIONS, soft_k=args.soft_targets)
    trainer = _train(args, drafter, train_shards.load(), {"dev": dev_shards.load()}, len(references), data)
    _compare_and_save(target, drafter, dev_refs, trainer, out, stored_dtype)
    return 0


def _train(args, drafter, positions: dict, dev: dict, references: int, data: dict) -> Depth1Trainer:
    """Train the head on `positions` as the options say (resuming `OUTPUT_DIR/checkpoint.pt`)."""
    n = len(positions["label"])
    batch_size = args.batch_size
    if n < batch_size:
        print(f"[train-depth1] {n:,} positions, fewer than --batch-size {batch_size}: each step takes all {n:,}")
        batch_size = n
    trainer = Depth1Trainer(drafter, args.output_dir, lr=args.lr, batch_size=batch_size, seed=args.seed, data=data,
                            soft_weight=args.soft_weight)
    total = max(1, int(args.epochs * n // batch_size))
    if trainer.resume():
        print(f"[train-depth1] resumed at step {trainer.step} of {total}")
    soft_loss = f"; soft targets: top {args.soft_targets} at weight {args.soft_weight:g}" if args.soft_targets else ""
    print(f"[train-depth1] {n:,} positions from {references} references; {total} steps of {batch_size}{soft_loss}")
    trainer.train(positions, total, dev, eval_every=args.eval_every, save_every=SAVE_EVERY)
    return trainer


def _compare_and_save(target, drafter, dev_refs, trainer: Depth1Trainer, out: Path, stored_dtype: str) -> None:
    """Development acceptance without and with the trained head (to metrics.jsonl), then `OUTPUT_DIR/final`."""
    from ..core.tree import TreePolicy
    from .evaluate import reference_acceptance

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
