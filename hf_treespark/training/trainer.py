"""The drafter trainer: accelerate (one process or many), checkpoints with exact resume.

Per optimizer step: the frozen target yields, for a batch of reference sequences, the hidden
states of `target_layer_ids` and its final hidden state (from which the reference distributions
`q_j` are rebuilt with the frozen LM head), either by a forward pass or from a feature cache;
anchors are sampled in each response; `TrainingObjective` computes the loss terms; their
denominators are summed over ranks before dividing.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..engine import feature_indices, select_features
from ..tree import TreePolicy
from .data import collate_references
from .losses import normalise
from .objective import LOSS_NAMES, LossConfig, TrainingObjective

# Preset -> (loss coefficients, drafter config fields). One switch each (SPEC section 4).
PRESETS: dict[str, tuple[dict, dict]] = {
    "dspark": ({"surv": 0.0, "cov": 0.0}, {"head_dim": 128, "tree_topk": 1, "tree_frontier": 1, "tree_budget": 7}),
    "dspark_tree": ({"surv": 0.0, "cov": 0.0}, {"head_dim": 192}),
    "treespark": ({}, {"head_dim": 192}),
    "no_survival": ({"surv": 0.0}, {"head_dim": 192}),
    "no_coverage": ({"cov": 0.0}, {"head_dim": 192}),
    "treespark_hd128": ({}, {"head_dim": 128}),
}


@dataclass
class TrainConfig:
    """Every knob of a training run."""

    output_dir: str = "runs/drafter"
    preset: str = "treespark"
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 4  # sequences per process per micro-step
    grad_accum: int = 1
    lr: float = 6e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    anchors_per_sequence: int = 64
    seed: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    tensorboard: bool = False
    feature_cache: str | None = None  # directory of cached target features (None: target forward per step)
    mixed_precision: str = "auto"  # "auto": bf16 on CUDA devices that support it, else fp32
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        for name, value in PRESETS[self.preset][0].items():
            setattr(self.loss, name, value)
        for name in ("batch_size", "grad_accum", "anchors_per_sequence", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.epochs <= 0 and not self.max_steps:
            raise ValueError("set epochs > 0 or max_steps")


def replay_policy(config) -> TreePolicy:
    """The tree policy that training replay runs: the drafter config's, with `tree_budget="auto"`
    (a per-device inference choice) replayed at the default budget `TreePolicy().budget`."""
    policy = TreePolicy.from_config(config)
    return policy.with_budget(min(TreePolicy().budget, policy.budget)) if policy.auto else policy


def sample_anchors(lengths: torch.Tensor, prompt_lens: torch.Tensor, indices: torch.Tensor, num_anchors: int,
                   seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[b, A]` anchor positions in each response and their validity.

    An anchor `a` is a response position with at least one token after it: `prompt_len <= a <= length - 2`.
    Anchors depend only on `(seed, epoch, sequence index)`, never on batch composition or process
    count, so one process and several draw the same anchors for the same sequence.
    """
    b = lengths.shape[0]
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool)
    for row in range(b):
        lo, hi = int(prompt_lens[row]), int(lengths[row]) - 2
        count = hi - lo + 1
        if count <= 0:
            continue
        gen = torch.Generator().manual_seed(hash((seed, epoch, int(indices[row]))) % (2**63))
        picked = lo + torch.randperm(count, generator=gen)[:num_anchors].sort().values
        anchors[row, : len(picked)] = picked
        valid[row, : len(picked)] = True
    return anchors, valid


@torch.no_grad()
def target_features(target, layer_ids: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """One frozen-target forward: `([b, T, n_layers * d], [b, T, d])` = selected layers, final normed state."""
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return select_features(out.hidden_states, feature_indices(layer_ids)), out.hidden_states[-1]


class FeatureCache:
    """Target features per reference sequence on disk (`<id>.safetensors`, bf16), written once, read each epoch."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, seq_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in seq_id)
        return self.directory / f"{safe}.safetensors"

    def has(self, seq_id: str) -> bool:
        return self.path(seq_id).is_file()

    def put(self, seq_id: str, features: torch.Tensor, reference_hidden: torch.Tensor) -> None:
        tmp = self.path(seq_id).with_suffix(".tmp")
        save_file({"features": features.to(torch.bfloat16).contiguous(),
                   "reference_hidden": reference_hidden.to(torch.bfloat16).contiguous()}, str(tmp))
        tmp.rename(self.path(seq_id))

    def get(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = load_file(str(self.path(seq_id)))
        return data["features"].float(), data["reference_hidden"].float()


def fill_feature_cache(cache: FeatureCache, target, layer_ids, references, batch_size: int = 8,
                       progress: bool = True) -> None:
    """Compute and store target features for every reference not yet cached (resumable)."""
    todo = [r for r in references if not cache.has(r.id)]
    device = next(target.parameters()).device
    for start in tqdm(range(0, len(todo), batch_size), desc="caching target features", disable=not progress):
        chunk = todo[start : start + batch_size]
        batch = collate_references(chunk, pad_id=0)
        feats, hidden = target_features(target, layer_ids, batch["input_ids"].to(device),
                                        batch["attention_mask"].to(device))
        for row, ref in enumerate(chunk):
            n = len(ref.input_ids)
            cache.put(ref.id, feats[row, :n].cpu(), hidden[row, :n].cpu())


def cosine_schedule(optimizer, warmup_steps: int, total_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _EpochDataset(torch.utils.data.Dataset):
    """References in a seeded per-epoch order; items carry their index for anchor seeding."""

    def __init__(self, references, order: list[int]):
        self.references, self.order = references, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int):
        return self.order[i], self.references[self.order[i]]


def _collate(batch, pad_id: int = 0) -> dict:
    """`collate_references` plus each sequence's index (anchor seeding) and id (feature cache key)."""
    collated = collate_references([ref for _, ref in batch], pad_id)
    collated["indices"] = torch.tensor([i for i, _ in batch])
    collated["ids"] = [ref.id for _, ref in batch]
    return collated


class Trainer:
    """Trains `drafter` against the frozen `target` on reference sequences."""

    def __init__(self, config: TrainConfig, target, drafter, references, accelerator=None):
        from accelerate import Accelerator

        self.config = config
        mixed = config.mixed_precision
        if mixed == "auto":
            mixed = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
        self.accelerator = accelerator or Accelerator(
            gradient_accumulation_steps=config.grad_accum, mixed_precision=mixed,
            log_with="tensorboard" if config.tensorboard else None, project_dir=config.output_dir,
        )
        if not references:
            raise ValueError("no reference sequences to train on")
        self.references = references
        self.output_dir = Path(config.output_dir)
        self.target = target.eval().requires_grad_(False).to(self.accelerator.device)
        self.drafter = drafter.train().to(self.accelerator.device)
        self.drafter.bind_target(self.target)
        cfg = drafter.config
        self.policy = replay_policy(cfg)
        self.objective = TrainingObjective(self.drafter, config.loss, self.policy)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                           betas=tuple(config.adam_betas), eps=config.adam_eps)
        world = self.accelerator.num_processes
        self.steps_per_epoch = math.ceil(len(references) / (config.batch_size * world * config.grad_accum))
        self.total_steps = config.max_steps or max(1, math.ceil(self.steps_per_epoch * config.epochs))
        self.scheduler = cosine_schedule(self.optimizer, int(config.warmup_ratio * self.total_steps),
                                         self.total_steps, config.min_lr_ratio)
        # The schedule is defined in optimizer steps of the global batch: keep it out of `prepare`
        # (accelerate would step it once per process) and step it with the optimizer ourselves.
        self.objective, self.optimizer = self.accelerator.prepare(self.objective, self.optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)
        self.feature_cache = FeatureCache(config.feature_cache) if config.feature_cache else None
        self.step = 0  # optimizer steps done
        self.pad_id = 0

    # ----- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Model, optimiser, scheduler, RNG states and data position, written atomically."""
        acc = self.accelerator
        final = self.checkpoint_dir / f"step-{self.step:08d}"
        tmp = self.checkpoint_dir / f".tmp-step-{self.step:08d}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        if acc.is_main_process:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": self.step, "config": _jsonable(self.config)}))
            tmp.rename(final)
            for old in sorted(self.checkpoint_dir.glob("step-*"))[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoint_dir.glob("step-*") if (p / "trainer_state.json").is_file())
        return done[-1] if done else None

    def resume(self) -> bool:
        """Load the latest complete checkpoint, if any. A damaged checkpoint is refused with its path."""
        path = self.latest_checkpoint()
        if path is None:
            return False
        try:
            self.accelerator.load_state(str(path))
            state = json.loads((path / "trainer_state.json").read_text())
        except Exception as err:
            raise RuntimeError(f"checkpoint {path} is damaged ({err}); delete it to resume from an earlier "
                               "one") from err
        self.step = int(state["step"])
        return True

    # ----- training -----------------------------------------------------------------------------
    def _epoch_loader(self, epoch: int, skip_batches: int):
        order = torch.randperm(len(self.references), generator=torch.Generator().manual_seed(self.config.seed + epoch))
        dataset = _EpochDataset(self.references, order.tolist())
        loader = torch.utils.data.DataLoader(dataset, batch_size=self.config.batch_size, shuffle=False,
                                             collate_fn=lambda b: _collate(b, self.pad_id))
        loader = self.accelerator.prepare_data_loader(loader, device_placement=False)
        if skip_batches:
            loader = self.accelerator.skip_first_batches(loader, skip_batches)
        return loader

    def _features(self, batch):
        device = self.accelerator.device
        if self.feature_cache is None:
            return target_features(self.target, self.drafter.config.target_layer_ids,
                                   batch["input_ids"].to(device), batch["attention_mask"].to(device))
        t_len = batch["input_ids"].shape[1]
        feats, hidden = [], []
        for seq_id in batch["ids"]:
            f, h = self.feature_cache.get(seq_id)
            feats.append(torch.nn.functional.pad(f, (0, 0, 0, t_len - f.shape[0])))
            hidden.append(torch.nn.functional.pad(h, (0, 0, 0, t_len - h.shape[0])))
        return torch.stack(feats).to(device), torch.stack(hidden).to(device)

    def train_step(self, batch, epoch: int) -> dict[str, float]:
        cfg, acc = self.config, self.accelerator
        device = acc.device
        feats, ref_hidden = self._features(batch)
        anchors, anchor_valid = sample_anchors(batch["lengths"], batch["prompt_lens"], batch["indices"],
                                               cfg.anchors_per_sequence, cfg.seed, epoch)
        with acc.accumulate(self.objective), acc.autocast():
            parts = self.objective(batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                   batch["lengths"].to(device), feats, ref_hidden, anchors.to(device),
                                   anchor_valid.to(device))
            reduce_fn = lambda x: acc.reduce(x, reduction="sum")  # noqa: E731
            total, logged = 0.0, {}
            for name, (num, den) in parts.items():
                term = normalise(num, den, reduce_fn, acc.num_processes)
                total = total + cfg.loss.coefficient(name) * term
                logged[name] = self._global_mean(term)
            acc.backward(total)
            if acc.sync_gradients and cfg.max_grad_norm > 0:
                acc.clip_grad_norm_(self.drafter.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            if acc.sync_gradients:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        logged["loss"] = self._global_mean(total)
        return logged

    def _global_mean(self, term: torch.Tensor) -> float:
        """The global value of a normalised term (each rank holds `world * local / global_den`)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return float(term.detach())
        return float(acc.reduce(term.detach(), reduction="sum")) / acc.num_processes

    def train(self, resume: bool = True, stop_after: int | None = None, progress: bool = True) -> dict:
        """Run to `total_steps` (or `stop_after` more optimizer steps), checkpointing every `save_every`."""
        acc, cfg = self.accelerator, self.config
        if resume:
            self.resume()
        if self.feature_cache is not None and acc.is_main_process:
            fill_feature_cache(self.feature_cache, self.target, self.drafter.config.target_layer_ids,
                               self.references, progress=progress)
        acc.wait_for_everyone()
        metrics_path = self.output_dir / "metrics.jsonl"
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard:
            acc.init_trackers("treespark", config={k: v for k, v in _jsonable(cfg).items() if not isinstance(v, dict)})
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"training ({cfg.preset})",
                   disable=not (progress and acc.is_main_process))
        start_time, start_step, done_now, last = time.perf_counter(), self.step, 0, {}
        micro_per_epoch = self.steps_per_epoch * cfg.grad_accum
        while self.step < self.total_steps and (stop_after is None or done_now < stop_after):
            epoch, micro_done = divmod(self.step * cfg.grad_accum, micro_per_epoch)
            for batch in self._epoch_loader(epoch, micro_done):
                last = self.train_step(batch, epoch)
                if not acc.sync_gradients:
                    continue
                self.step += 1
                done_now += 1
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in last.items()})
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    record = {"step": self.step, "epoch": epoch, "lr": self.scheduler.get_last_lr()[0], **last}
                    if acc.is_main_process:
                        with open(metrics_path, "a") as f:
                            f.write(json.dumps(record) + "\n")
                    if cfg.tensorboard:
                        acc.log(record, step=self.step)
                if self.step % cfg.save_every == 0 or self.step == self.total_steps:
                    self.save_checkpoint()
                if self.step >= self.total_steps or (stop_after is not None and done_now >= stop_after):
                    break
        bar.close()
        seconds = time.perf_counter() - start_time
        if cfg.tensorboard:
            acc.end_training()
        return {"steps": self.step - start_step, "seconds": seconds, "last": last}

    def unwrapped_drafter(self):
        return self.accelerator.unwrap_model(self.objective).drafter


def _jsonable(config) -> dict:
    return json.loads(json.dumps(asdict(config), default=str))


__all__ = ["LOSS_NAMES", "PRESETS", "FeatureCache", "TrainConfig", "Trainer", "sample_anchors", "target_features"]
