"""Streamed distillation: the depth-1 head trained on positions as `distill.distil_batch` makes them, through a
shuffle buffer, nothing stored.

`PositionBuffer` is a ring of the last `buffer_positions` positions; `distil_stream` adds each forward's positions to
it and takes `passes` optimizer samples per new position on average (`DistilTrainer`, `Depth1Trainer`'s step).
A checkpoint holds the stream's place and which windows the ring holds, so a resumed run distils those windows again
into the same slots (not counting them twice) and trains exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import soft_targets as soft
from .depth1 import Depth1Trainer
from .distill_extract import _batched, distil_batch
from .distill_sources import TextSequence


@dataclass
class StreamConfig:
    """The knobs of a streamed run (`distil_stream`)."""

    batch_size: int = 8  # sequences per target forward
    buffer_positions: int = 65_536  # positions the shuffle buffer holds (about 7 KB each for SmolLM2-135M)
    passes: float = 1.0  # optimizer samples per distilled position, on average
    max_positions: int = 1_000_000  # positions to distil; the learning-rate schedule spans them
    eval_every: int = 500  # optimizer steps between development evaluations
    save_every: int = 500  # optimizer steps between checkpoints
    anchors: str = "agreeing"  # which labelled positions are anchors (`distil_batch`)
    soft_targets: int = 0  # the target's top-K recorded per position for the soft loss (`soft_targets.py`); 0: none

    def total_steps(self, train_batch: int) -> int:
        return math.ceil(self.passes * self.max_positions / train_batch)


class PositionBuffer:
    """A ring of the last `capacity` positions (the fields of `depth1.FIELDS`), from which training draws uniformly.
    With `n` new positions per forward a position stays `capacity / n` forwards, so `passes * n / batch` steps per
    forward sample it `passes` times on average (more while the ring fills)."""

    def __init__(self, capacity: int):
        self.capacity, self.size, self.cursor = capacity, 0, 0
        self.data: dict[str, torch.Tensor] | None = None

    def add(self, columns: dict[str, torch.Tensor]) -> None:
        columns = {k: v[-self.capacity:] for k, v in columns.items()}
        n = len(columns["label"])
        if self.data is None:
            self.data = {k: v.new_empty((self.capacity, *v.shape[1:])) for k, v in columns.items()}
        slots = (self.cursor + torch.arange(n, device=columns["label"].device)) % self.capacity
        for k, v in columns.items():
            self.data[k][slots] = v
        self.cursor, self.size = (self.cursor + n) % self.capacity, min(self.size + n, self.capacity)

    def sample(self, count: int, seed: int) -> torch.Tensor:
        rows = torch.randint(self.size, (count,), generator=torch.Generator().manual_seed(seed))
        return rows.to(self.data["label"].device)


class DistilTrainer(Depth1Trainer):
    """`Depth1Trainer` (its optimizer, logits and learning rate) fed by the stream. Its checkpoint, written whole
    and atomically, also holds the stream's place (`stream`: sequences done, positions seen, the steps owed, seconds)
    and `fingerprint` (the sources and the drafter), which a resumed run must match."""

    def __init__(self, drafter, output_dir: str | Path, fingerprint: str, **kwargs):
        super().__init__(drafter, output_dir, **kwargs)
        self.draft_index = self.draft_index.to(self.params[0].device)
        self.fingerprint = fingerprint
        self.stream = {"sequences_done": 0, "positions_seen": 0, "credit": 0.0, "seconds": 0.0}

    def train_step(self, data: dict[str, torch.Tensor], rows: torch.Tensor, total_steps: int) -> float:
        """One AdamW step on `rows` of `data` at `rate(total_steps)`: `soft.head_loss` (`CE(logits, label)` mixed with
        the soft targets' by `soft_weight`), as `Depth1Trainer.train`."""
        self.drafter.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.rate(total_steps)
        loss = soft.head_loss(self.logits(data, rows), self.draft_index[data["label"][rows]], data, rows,
                              self.soft_weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def save(self) -> None:
        state = {"step": self.step, "head": self.drafter.depth1_head.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "stream": dict(self.stream), "fingerprint": self.fingerprint}
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
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"{path} belongs to another run (other --sources, --positions, --max-length, --drafter or "
                             "--soft-targets, or not a distil run): give the same options to resume it, or another "
                             "--output-dir")
        self.drafter.depth1_head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.stream = state["step"], dict(state["stream"])
        return True


def distil_stream(target, drafter, sequences: Iterable[TextSequence], trainer: DistilTrainer,
                  dev: dict[str, dict[str, torch.Tensor]], config: StreamConfig, progress: bool = True) -> list[dict]:
    """Train `trainer`'s head on the positions distilled from `sequences` as they come, going on from
    `trainer.stream` (the sequences done are skipped; the buffer starts empty). At the start, every `eval_every`
    steps and at the end, append to `OUTPUT_DIR/metrics.jsonl` `{"step", "positions_seen" (distilled), "samples",
    "seconds", "positions_per_s" (distilled per second by this process, evaluation aside), "<phase>_s",
    "<dev name>_top1"...}`."""
    stream, total = trainer.stream, config.total_steps(trainer.batch_size)
    buffer, phases, curve = PositionBuffer(config.buffer_positions), {}, []
    since = {"start": time.perf_counter(), "eval": 0.0, "positions": stream["positions_seen"],
             "seconds": stream["seconds"]}

    def elapsed() -> float:
        return time.perf_counter() - since["start"] - since["eval"]

    def record() -> None:
        began = time.perf_counter()
        row = {"step": trainer.step, "positions_seen": stream["positions_seen"],
               "samples": trainer.step * trainer.batch_size, "seconds": round(since["seconds"] + elapsed(), 1),
               "positions_per_s": round((stream["positions_seen"] - since["positions"]) / max(elapsed(), 1e-9), 1),
               **{f"{phase}_s": round(s, 1) for phase, s in phases.items()},
               **{f"{name}_top1": round(trainer.top1(d), 2) for name, d in dev.items()}}
        with open(trainer.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        curve.append(row)
        since["eval"] += time.perf_counter() - began
        bar.write(json.dumps(row))

    def step() -> None:
        began = time.perf_counter()
        trainer.train_step(buffer.data, buffer.sample(trainer.batch_size, trainer.seed * 1_000_003 + trainer.step),
                           total)
        phases["train"] = phases.get("train", 0.0) + time.perf_counter() - began
        stream["credit"] -= 1
        if trainer.step % config.save_every == 0 or trainer.step == total:
            stream["seconds"] = since["seconds"] + elapsed()
            trainer.save()
        if trainer.step % config.eval_every == 0 or trainer.step == total:
            record()

    bar = tqdm(total=config.max_positions, initial=stream["positions_seen"], unit="position",
               desc="distilling the depth-1 head", disable=not progress)
    if trainer.step == 0 and stream["positions_seen"] == 0:
        record()
    began = time.perf_counter()
    source = _refill(buffer, iter(sequences), stream, target, drafter, config.anchors, config.soft_targets)
    since["eval"] += time.perf_counter() - began  # re-distilling what the checkpoint held is not throughput
    while buffer.size and stream["credit"] >= 1 and trainer.step < total:
        step()  # the steps owed to the forward the checkpoint was written in, as the interrupted run took them
    batches = _batched(source, config.batch_size)
    while stream["positions_seen"] < config.max_positions:
        batch = next(batches, None)
        if batch is None:
            break
        room = config.max_positions - stream["positions_seen"]
        columns = {k: v[:room] for k, v in distil_batch(target, drafter, batch, seconds=phases, anchors=config.anchors,
                                                        soft_k=config.soft_targets).items()}
        _remember(stream["buffer"], buffer, stream["sequences_done"], len(batch), len(columns["label"]))
        buffer.add(columns)
        n = len(columns["label"])
        stream["sequences_done"] += len(batch)
        stream["positions_seen"] += n
        stream["credit"] += config.passes * n / trainer.batch_size
        bar.update(n)
        while stream["credit"] >= 1 and trainer.step < total:
            step()
    while buffer.size and stream["positions_seen"] >= config.max_positions and trainer.step < total:
        step()  # the last fraction of a step
    if buffer.size and (not curve or curve[-1]["step"] != trainer.step):  # the sources ran out first
        stream["seconds"] = since["seconds"] + elapsed()
        trainer.save()
        record()
    bar.close()
    trainer.drafter.eval()
    return curve


def _remember(kept: dict, buffer: PositionBuffer, first: int, count: int, positions: int) -> None:
    """Note in `kept` (the checkpoint's `stream["buffer"]`) that windows `first .. first + count - 1` are about to
    add `positions` positions to `buffer`, and forget the oldest windows none of whose positions the ring holds
    after that: `kept["windows"]` lists `[first window, windows, positions]` per forward, oldest first, and
    `kept["cursor"]` is the ring slot where the oldest one's positions began."""
    if not kept["windows"]:
        kept["cursor"] = buffer.cursor
    kept["windows"].append([first, count, positions])
    while sum(n for _, _, n in kept["windows"][1:]) >= buffer.capacity:
        _, _, dropped = kept["windows"].pop(0)
        kept["cursor"] = (kept["cursor"] + min(dropped, buffer.capacity)) % buffer.capacity


def _refill(buffer: PositionBuffer, sequences: Iterator[TextSequence], stream: dict, target, drafter,
            anchors: str, soft_k: int = 0) -> Iterator[TextSequence]:
    """Put back into `buffer` the positions it held at the checkpoint `stream` comes from, by distilling again the
    windows `stream["buffer"]` lists, into the same ring slots; they are not counted again. Returns `sequences`
    advanced to the first window not yet distilled (`stream["sequences_done"]`). A checkpoint without the list
    (an earlier version) starts with an empty buffer."""
    kept = stream.setdefault("buffer", {"windows": [], "cursor": 0})
    if not kept["windows"]:
        return islice(sequences, stream["sequences_done"], None)
    first = kept["windows"][0][0]
    if first + sum(count for _, count, _ in kept["windows"]) != stream["sequences_done"]:
        raise ValueError(f"the checkpoint's shuffle buffer lists windows {first}.. that do not end at window "
                         f"{stream['sequences_done']:,}, where its stream stopped: the checkpoint is damaged")
    source = islice(sequences, first, None)
    buffer.cursor = kept["cursor"]
    for _, count, positions in kept["windows"]:
        batch = list(islice(source, count))
        buffer.add({k: v[:positions] for k, v in distil_batch(target, drafter, batch, anchors=anchors,
                                                              soft_k=soft_k).items()})
    return source
