"""The drafter trainer: accelerate (one process or many), checkpoints with exact resume.

Per optimizer step: the frozen target yields, for a batch of reference sequences, the hidden
states of `target_layer_ids` and its final hidden state (from which the reference distributions
`q_j` are rebuilt with the frozen LM head), either by a forward pass or from a feature cache;
anchors are sampled in each response; `TrainingObjective` computes the loss terms; their
denominators are summed over ranks before dividing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core.tree import TreePolicy
from ..decoding.engine import target_features
from ..precision import auto_dtype
from .checkpoints import TrainerCheckpoints, _jsonable, publish_state
from .data import check_token_ids, collate_references
from .feature_cache import FeatureCache, FeatureCacheMismatch, cache_signature, fill_feature_cache
from .freeze import freeze_all_but, resolve_parts
from .losses import normalise
from .objective import LABELS, LOSS_NAMES, LossConfig, TrainingObjective

logger = logging.getLogger(__name__)

# Preset -> (loss coefficients, drafter config fields). One switch each (docs/method.md).
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
    anchors_per_sequence: int = 64  # anchors per sequence in one optimizer micro-step
    updates_per_batch: int = 1  # micro-steps drawn from one batch's target features, on disjoint anchors
    seed: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    tensorboard: bool = False
    feature_cache: str | None = None  # directory of cached target features (None: target forward per step)
    mixed_precision: str = "auto"  # "auto": bf16 autocast where the device computes it natively (`mixed_precision`)
    eval_every: int = 0  # optimizer steps between development-set evaluations (0: none)
    eval_budget: int = 8  # tree budget N of those evaluations
    loss: LossConfig = field(default_factory=LossConfig)
    labels: str = "text"  # L_ce's label: the sequence's next token, or the target's own argmax there (`objective`)
    train_only: str | list[str] | None = None  # drafter parts to train, the rest frozen (`freeze`); None: all

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        for name, value in PRESETS[self.preset][0].items():
            setattr(self.loss, name, value)
        if self.labels not in LABELS:
            raise ValueError(f"labels={self.labels!r}: use one of {', '.join(LABELS)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (got {self.eval_every}); 0 turns evaluation off")
        for name in ("batch_size", "grad_accum", "anchors_per_sequence", "updates_per_batch", "save_every",
                     "log_every", "eval_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1 (got {self.max_steps}); leave it unset (None) to train "
                             "for `epochs` epochs")
        if self.updates_per_batch > 1 and self.grad_accum > 1:
            raise ValueError(f"updates_per_batch ({self.updates_per_batch}) and grad_accum ({self.grad_accum}) "
                             "pull opposite ways (several updates from one batch, one update from several "
                             "batches); set one of them to 1")
        if self.max_steps is None and not self.epochs > 0:
            raise ValueError(f"epochs must be positive when max_steps is unset (got {self.epochs})")


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


def build_accelerator(config: TrainConfig):
    """The run's `Accelerator`: gradient accumulation, mixed precision and tracker from `config`.

    Build it before anything else touches accelerate's process state (a bare `PartialState()` first would fix
    the state without `ACCELERATE_USE_CPU`, and torchrun's CPU processes would then each train alone). Under
    torchrun on a machine without an accelerator device it asks for CPU processes itself, so
    `torchrun --nproc_per_node 2 ...` trains one run on a CPU machine with or without `ACCELERATE_USE_CPU=true`.
    """
    from accelerate import Accelerator

    return Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=mixed_precision(config),
                       log_with="tensorboard" if config.tensorboard else None, project_dir=config.output_dir,
                       cpu=_cpu_processes_under_torchrun())


def mixed_precision(config: TrainConfig) -> str:
    """Accelerate's `mixed_precision` for `config`: "auto" is "bf16" where inference's `dtype="auto"` is bf16
    on this machine's device (`precision.auto_dtype`: a CUDA device that supports it, or, with no CUDA device,
    a CPU with native bf16 instructions), else "no". Weights, optimizer state and the losses' reductions stay
    float32; autocast runs the matrix products in bf16.
    """
    if config.mixed_precision != "auto":
        return config.mixed_precision
    return "bf16" if auto_dtype("cuda" if torch.cuda.is_available() else "cpu") == torch.bfloat16 else "no"


def _cpu_processes_under_torchrun() -> bool:
    """True when torchrun started several processes (`WORLD_SIZE` > 1) on a machine without an accelerator."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    device_api = getattr(torch, "accelerator", None)
    return not (device_api.is_available() if device_api is not None else torch.cuda.is_available())


class Trainer(TrainerCheckpoints):
    """Trains `drafter` against the frozen `target` on reference sequences."""

    def __init__(self, config: TrainConfig, target, drafter, references, accelerator=None):
        self.config = config
        self.accelerator = accelerator or build_accelerator(config)
        if not references:
            raise ValueError("no reference sequences to train on")
        check_token_ids(references, target.config.vocab_size)
        self.references = references
        self.output_dir = Path(config.output_dir)
        self.target = target.eval().requires_grad_(False).to(self.accelerator.device)
        self.drafter = drafter.train().to(self.accelerator.device)
        self.drafter.bind_target(self.target)
        cfg = drafter.config
        self.policy = replay_policy(cfg)
        self.objective = TrainingObjective(self.drafter, config.loss, self.policy, labels=config.labels)
        # `train_only`: the frozen parts get no gradient and no AdamW state (None: the whole drafter trains)
        self.trained_parts = resolve_parts(config.train_only, cfg)
        trained = self.drafter.parameters() if self.trained_parts is None else freeze_all_but(self.drafter,
                                                                                               self.trained_parts)
        # The fused kernel: one pass per tensor instead of several (measured 58 vs 249 ms per step for the
        # drafter's 27M parameters on a 2-core CPU, most of them the Markov head's W1 rows).
        fused = {"fused": True} if self.accelerator.device.type in ("cpu", "cuda") else {}
        self.optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay,
                                           betas=tuple(config.adam_betas), eps=config.adam_eps, **fused)
        world = self.accelerator.num_processes
        batches_per_epoch = math.ceil(len(references) / (config.batch_size * world))
        self.steps_per_epoch = math.ceil(batches_per_epoch * config.updates_per_batch / config.grad_accum)
        self.total_steps = config.max_steps or max(1, math.ceil(self.steps_per_epoch * config.epochs))
        self.scheduler = cosine_schedule(self.optimizer, int(config.warmup_ratio * self.total_steps),
                                         self.total_steps, config.min_lr_ratio)
        # The schedule is defined in optimizer steps of the global batch: keep it out of `prepare`
        # (accelerate would step it once per process) and step it with the optimizer ourselves.
        # Its state is saved as JSON in `trainer_state.json` (`TrainerCheckpoints`), never as a pickle: not
        # registered with accelerate, whose custom-object checkpoints are unpickled without `weights_only`.
        self.objective, self.optimizer = self.accelerator.prepare(self.objective, self.optimizer)
        self.feature_cache = None
        if config.feature_cache:
            signature = cache_signature(self.target, drafter.config.target_layer_ids)
            self.feature_cache = FeatureCache(config.feature_cache, signature)
        self.step = 0  # optimizer steps done
        self.anchors_seen = 0  # training anchors in those steps, over all processes
        self.pad_id = 0
        self.dev_references = None  # `set_dev_set`: references of the learning curve
        self.best = None  # the best development evaluation so far, `{"step", "score"}` (`best_checkpoint`)

    def _set_peak_lr(self, lr: float) -> None:
        """Rescale the schedule to the peak `lr` (a resumed scheduler would keep the checkpoint's)."""
        scheduler = self.scheduler
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * factor
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    @torch.no_grad()
    def set_feature_statistics(self, num_sequences: int = 64, batch_size: int = 8) -> None:
        """Standardisation statistics of a fresh `normalize_features` drafter: the response positions of the
        first `num_sequences` references (the same on every process)."""
        rows, device = [], self.accelerator.device
        layer_ids = self.unwrapped_drafter().config.target_layer_ids
        for start in range(0, min(num_sequences, len(self.references)), batch_size):
            chunk = self.references[start: min(start + batch_size, num_sequences)]
            batch = _collate(list(enumerate(chunk)), self.pad_id)
            features, _ = target_features(self.target, layer_ids,
                                          batch["input_ids"].to(device), batch["attention_mask"].to(device))
            for row, ref in enumerate(chunk):
                rows.append(features[row, ref.prompt_len: len(ref.input_ids)].float().cpu())
        self.unwrapped_drafter().set_feature_statistics(torch.cat(rows).to(self.accelerator.device))

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
        if self.feature_cache is None:  # under the step's autocast: bf16 features where inference runs bf16
            with self.accelerator.autocast():
                feats, hidden = target_features(self.target, self.drafter.config.target_layer_ids,
                                                batch["input_ids"].to(device), batch["attention_mask"].to(device))
            return feats.float(), hidden.float()
        t_len = batch["input_ids"].shape[1]
        feats, hidden = [], []
        for seq_id in batch["ids"]:
            f, h = self.feature_cache.get(seq_id)
            feats.append(torch.nn.functional.pad(f, (0, 0, 0, t_len - f.shape[0])))
            hidden.append(torch.nn.functional.pad(h, (0, 0, 0, t_len - h.shape[0])))
        return torch.stack(feats).to(device), torch.stack(hidden).to(device)

    def _micro_steps(self, epoch: int, micro_done: int):
        """`(batch, features, anchors, anchor_valid)` for each micro-step of `epoch` after the first `micro_done`.

        With `updates_per_batch = K` one batch's target features serve `K` micro-steps: the batch draws
        `K * anchors_per_sequence` distinct anchors per sequence and micro-step `j` takes every `K`-th of
        them from the `j`-th on, so each update sees anchors spread over the whole response. The target
        forward (about half of a step without a feature cache) is paid once per `K` updates.
        """
        cfg = self.config
        k = cfg.updates_per_batch
        skip_batches, first = divmod(micro_done, k)
        for batch in self._epoch_loader(epoch, skip_batches):
            features = self._features(batch)
            anchors, valid = sample_anchors(batch["lengths"], batch["prompt_lens"], batch["indices"],
                                            cfg.anchors_per_sequence * k, cfg.seed, epoch)
            for j in range(first, k):
                yield batch, features, anchors[:, j::k], valid[:, j::k]
            first = 0

    def train_step(self, batch, epoch: int, features=None, anchors=None, anchor_valid=None) -> dict[str, float]:
        """One micro-step on `batch` (target features and anchors computed here unless given)."""
        cfg, acc = self.config, self.accelerator
        device = acc.device
        feats, ref_hidden = self._features(batch) if features is None else features
        if anchors is None:
            anchors, anchor_valid = sample_anchors(batch["lengths"], batch["prompt_lens"], batch["indices"],
                                                   cfg.anchors_per_sequence, cfg.seed, epoch)
        self.anchors_seen += int(anchor_valid.sum()) * acc.num_processes  # ranks draw alike-sized batches
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
        if cfg.eval_every and self.step == 0:
            self.evaluate(metrics_path)  # the curve starts at the untrained (or --init-from) drafter
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"training ({cfg.preset})",
                   disable=not (progress and acc.is_main_process))
        start_time, start_step, done_now, last = time.perf_counter(), self.step, 0, {}
        micro_per_epoch = self.steps_per_epoch * cfg.grad_accum
        while self.step < self.total_steps and (stop_after is None or done_now < stop_after):
            epoch, micro_done = divmod(self.step * cfg.grad_accum, micro_per_epoch)
            for batch, features, anchors, anchor_valid in self._micro_steps(epoch, micro_done):
                last = self.train_step(batch, epoch, features, anchors, anchor_valid)
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
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == self.total_steps):
                    self.evaluate(metrics_path)
                if self.step % cfg.save_every == 0 or self.step == self.total_steps:
                    self.save_checkpoint()
                if self.step >= self.total_steps or (stop_after is not None and done_now >= stop_after):
                    break
        bar.close()
        seconds = time.perf_counter() - start_time
        return {"steps": self.step - start_step, "seconds": seconds, "last": last}

    def set_dev_set(self, references) -> None:
        """The development references (`training.evaluate.build_dev_set`) that `eval_every` measures on."""
        if not references:
            raise ValueError("the development set is empty")
        self.dev_references = references

    def evaluate(self, metrics_path: Path) -> dict:
        """Acceptance on the development set (`training.evaluate.reference_acceptance`), appended to metrics; a
        drafter that scores above every earlier evaluation is written to OUTPUT_DIR/best (`best_checkpoint`)."""
        from .best_checkpoint import best_state, improves, publish_best
        from .evaluate import reference_acceptance

        if self.dev_references is None:
            raise ValueError("eval_every needs a development set: call set_dev_set(references) (treespark train "
                             "builds one from held-out ShareGPT prompts, or reads --dev-data)")
        record = {"step": self.step, "anchors_seen": self.anchors_seen}
        if self.accelerator.is_main_process:
            drafter = self.unwrapped_drafter()
            result = reference_acceptance(self.target, drafter, self.dev_references,
                                          self.policy.with_budget(self.config.eval_budget))
            record.update(dev_acceptance_length=result["acceptance_length"], dev_depth_rates=result["depth_rates"],
                          dev_anchors=result["anchors"], dev_budget=self.config.eval_budget)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if improves(record, self.best):
                publish_best(drafter, self.output_dir, record)
                self.best = best_state(record)
        self.accelerator.wait_for_everyone()
        return record

    def unwrapped_drafter(self):
        return self.accelerator.unwrap_model(self.objective).drafter


__all__ = ["LOSS_NAMES", "PRESETS", "FeatureCache", "FeatureCacheMismatch", "TrainConfig", "Trainer",
           "build_accelerator", "cache_signature", "fill_feature_cache", "publish_state", "sample_anchors",
           "target_features"]
