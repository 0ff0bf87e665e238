"""The drafter trainer: accelerate (one process or many), checkpoints with exact resume.

Per optimizer step: the frozen target yields, for a batch of reference sequences, the hidden
states of `target_layer_ids` and its final hidden state (from which the reference distributions
`q_j` are rebuilt with the frozen LM head), either by a forward pass or from a feature cache;
anchors are sampled in each response; `TrainingObjective` computes the loss terms; their
denominators are summed over ranks before dividing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..engine import target_features
from ..precision import auto_dtype
from ..tree import TreePolicy
from .data import check_token_ids, collate_references
from .losses import normalise
from .objective import LOSS_NAMES, LossConfig, TrainingObjective

logger = logging.getLogger(__name__)

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

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        for name, value in PRESETS[self.preset][0].items():
            setattr(self.loss, name, value)
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


def _sequence_digest(input_ids: list[int]) -> str:
    """A short fingerprint of a sequence's token ids (the cache's key is only the sequence id)."""
    return hashlib.sha1(json.dumps(input_ids).encode()).hexdigest()[:16]


def cache_signature(target, layer_ids: list[int]) -> dict[str, str]:
    """What every cached file of one run shares: the target's shape, the feature layers and the stored dtype.

    Written into each file's safetensors metadata next to the sequence's own length and token fingerprint, so a
    cache directory shared by runs with other settings is caught instead of read as if it fitted.
    """
    cfg = target.config
    shape = f"{cfg.model_type} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size}"
    return {"target": shape, "target_layer_ids": ",".join(str(i) for i in layer_ids), "dtype": "bfloat16"}


# What a differing metadata field means for the user, and which setting to look at.
_CACHE_FIELD_HINTS = {
    "num_tokens": "sequence length in tokens (another --max-length or other --data)",
    "token_ids": "token ids (other --data under the same sequence ids, or another --max-length)",
    "target": "target model",
    "target_layer_ids": "target layers (the drafter's target_layer_ids)",
    "dtype": "stored dtype",
}


class FeatureCacheMismatch(ValueError):
    """A cached file was written for other settings than this run's (sequence length, data, target, layers)."""


class FeatureCache:
    """Target features per reference sequence on disk (`<id>.safetensors`, bf16), written once, read each epoch.

    Each file records in its metadata what it holds (`num_tokens`, a `token_ids` fingerprint, and the run-wide
    `signature`: target shape, target layers, dtype). `status` compares that with what a run needs; a file
    written for other settings raises `FeatureCacheMismatch` naming the directory and the setting that differs.
    """

    def __init__(self, directory: str | Path, signature: dict[str, str] | None = None):
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"feature cache {self.directory} is a file, not a directory: give --feature-cache "
                                     "a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.signature = dict(signature or {})

    def path(self, seq_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in seq_id)
        return self.directory / f"{safe}.safetensors"

    def has(self, seq_id: str) -> bool:
        return self.path(seq_id).is_file()

    def metadata(self, ref) -> dict[str, str]:
        """The metadata a file for reference `ref` must carry under this cache's signature."""
        return {**self.signature, "num_tokens": str(len(ref.input_ids)), "token_ids": _sequence_digest(ref.input_ids)}

    def status(self, ref) -> str:
        """`"ok"`, `"missing"` or `"damaged"` (unreadable: recompute it) for reference `ref`'s file.

        Raises `FeatureCacheMismatch` when the file is readable but was written for other settings. Files from
        before metadata was recorded are checked by their row count only.
        """
        path = self.path(ref.id)
        if not path.is_file():
            return "missing"
        try:
            with safe_open(str(path), "pt") as f:
                stored = f.metadata() or {}
                rows = f.get_slice("features").get_shape()[0]
        except Exception:  # safetensors raises its own error type for a cut-off or garbled file
            return "damaged"
        if not stored:
            stored = {"num_tokens": str(rows)}
        wanted = self.metadata(ref)
        for key in wanted:  # a fixed order: the run-wide settings first, then the sequence's length
            value = stored.get(key, wanted[key])
            if value != wanted[key]:
                raise FeatureCacheMismatch(
                    f"feature cache {self.directory} was filled with other settings: {path.name} holds "
                    f"{_CACHE_FIELD_HINTS.get(key, key)} {value!r}, this run needs {wanted[key]!r}. Give this run "
                    "its own --feature-cache directory (one per --max-length, data and target), or delete "
                    f"{self.directory} to recompute it.")
        return "ok"

    def put(self, ref, features: torch.Tensor, reference_hidden: torch.Tensor) -> None:
        """Store `features` `[T, n_layers * d]` and `reference_hidden` `[T, d]` of `ref` (atomically: tmp + rename)."""
        tmp = self.path(ref.id).with_suffix(".tmp")
        save_file({"features": features.to(torch.bfloat16).contiguous(),
                   "reference_hidden": reference_hidden.to(torch.bfloat16).contiguous()}, str(tmp),
                  metadata=self.metadata(ref))
        tmp.replace(self.path(ref.id))

    def get(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.path(seq_id)
        try:
            data = load_file(str(path))
        except Exception as err:
            raise RuntimeError(f"feature cache file {path} cannot be read ({err}): delete it and start the run "
                               "again; it is recomputed and training resumes from the last checkpoint") from err
        return data["features"].float(), data["reference_hidden"].float()


def fill_feature_cache(cache: FeatureCache, target, layer_ids, references, batch_size: int = 8,
                       progress: bool = True) -> None:
    """Compute and store target features for every reference not yet cached (resumable).

    Unreadable files (a crash or a full disk mid-write) are recomputed with a warning naming them; files written
    for other settings raise `FeatureCacheMismatch` before any training step.
    """
    todo = []
    for ref in references:
        status = cache.status(ref)
        if status == "damaged":
            logger.warning("feature cache file %s is damaged (unreadable); recomputing it", cache.path(ref.id))
        if status != "ok":
            todo.append(ref)
    device = next(target.parameters()).device
    for start in tqdm(range(0, len(todo), batch_size), desc="caching target features", disable=not progress):
        chunk = todo[start : start + batch_size]
        batch = collate_references(chunk, pad_id=0)
        feats, hidden = target_features(target, layer_ids, batch["input_ids"].to(device),
                                        batch["attention_mask"].to(device))
        for row, ref in enumerate(chunk):
            n = len(ref.input_ids)
            cache.put(ref, feats[row, :n].cpu(), hidden[row, :n].cpu())


def publish_state(accelerator, final: Path, write_run_state) -> None:
    """Every rank's `accelerator.save_state` into `.tmp-<final name>`, then `write_run_state(tmp)` and one rename
    to `final` on the main rank.

    Each rank writes its own files (the main rank the weights, optimizer and scheduler; every rank its RNG state,
    `random_states_<rank>.pkl`). The rename waits until all ranks are done and their files are there: a slower
    rank would otherwise write into a `.tmp` directory recreated after the rename, and the published checkpoint
    would lack its state.
    """
    tmp = final.with_name(f".tmp-{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's files are written before the main rank publishes them
    if accelerator.is_main_process:
        missing = [name for name in (f"random_states_{rank}.pkl" for rank in range(accelerator.num_processes))
                   if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"checkpoint {tmp} lacks {', '.join(missing)} after every process saved its state: "
                               "--output-dir must be on a filesystem that all processes share")
        write_run_state(tmp)
        if final.exists():  # the same step written by an earlier run of this output dir
            shutil.rmtree(final)
        tmp.rename(final)
    accelerator.wait_for_everyone()


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


class Trainer:
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
        self.objective = TrainingObjective(self.drafter, config.loss, self.policy)
        # The fused kernel: one pass per tensor instead of several (measured 58 vs 249 ms per step for the
        # drafter's 27M parameters on a 2-core CPU, most of them the Markov head's W1 rows).
        fused = {"fused": True} if self.accelerator.device.type in ("cpu", "cuda") else {}
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                           betas=tuple(config.adam_betas), eps=config.adam_eps, **fused)
        world = self.accelerator.num_processes
        batches_per_epoch = math.ceil(len(references) / (config.batch_size * world))
        self.steps_per_epoch = math.ceil(batches_per_epoch * config.updates_per_batch / config.grad_accum)
        self.total_steps = config.max_steps or max(1, math.ceil(self.steps_per_epoch * config.epochs))
        self.scheduler = cosine_schedule(self.optimizer, int(config.warmup_ratio * self.total_steps),
                                         self.total_steps, config.min_lr_ratio)
        # The schedule is defined in optimizer steps of the global batch: keep it out of `prepare`
        # (accelerate would step it once per process) and step it with the optimizer ourselves.
        self.objective, self.optimizer = self.accelerator.prepare(self.objective, self.optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)
        self.feature_cache = None
        if config.feature_cache:
            signature = cache_signature(self.target, drafter.config.target_layer_ids)
            self.feature_cache = FeatureCache(config.feature_cache, signature)
        self.step = 0  # optimizer steps done
        self.anchors_seen = 0  # training anchors in those steps, over all processes
        self.pad_id = 0
        self.dev_references = None  # `set_dev_set`: references of the learning curve

    # ----- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Model, optimiser, scheduler, RNG states and data position, written atomically.

        Everything goes into `.tmp-step-N` first, `trainer_state.json` last; one rename publishes it. A crash at
        any point leaves the previous `step-*` checkpoints untouched, and `latest_checkpoint` ignores the rest.
        """
        final = self.checkpoint_dir / f"step-{self.step:08d}"

        def write_run_state(tmp: Path) -> None:
            state = {"step": self.step, "anchors_seen": self.anchors_seen, "config": _jsonable(self.config),
                     "drafter_config": self._drafter_fields()}
            # the whole drafter config, for `treespark export` (training.export)
            self.unwrapped_drafter().config.to_json_file(str(tmp / "drafter_config.json"))
            (tmp / "trainer_state.json").write_text(json.dumps(state))

        publish_state(self.accelerator, final, write_run_state)
        if self.accelerator.is_main_process:
            for old in sorted(self.checkpoint_dir.glob("step-*"))[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoint_dir.glob("step-*") if (p / "trainer_state.json").is_file())
        return done[-1] if done else None

    def _drafter_fields(self) -> dict:
        """The drafter config fields a checkpoint's weights depend on (architecture and tree policy)."""
        from transformers import PretrainedConfig

        generic = set(PretrainedConfig().to_dict())
        fields = {k: v for k, v in self.drafter.config.to_dict().items()
                  if k not in generic and k not in _RESUME_IGNORED_FIELDS}
        return json.loads(json.dumps(fields, default=str))

    def _resume_conflicts(self, state: dict) -> list[str]:
        """How the run saved in `state` (a `trainer_state.json`) differs from this one; empty if it may resume."""
        conflicts = []
        saved_preset = state.get("config", {}).get("preset")
        if saved_preset is not None and saved_preset != self.config.preset:
            conflicts.append(f"preset {saved_preset!r} there, {self.config.preset!r} here")
        saved_config = state.get("config", {})
        for key in _RESUME_POSITION_FIELDS:  # a step number means another place in the data under other values
            if key in saved_config and saved_config[key] != getattr(self.config, key):
                conflicts.append(f"{key} {saved_config[key]!r} there, {getattr(self.config, key)!r} here")
        saved, now = state.get("drafter_config") or {}, self._drafter_fields()
        for key in sorted(set(saved) & set(now)):
            if saved[key] != now[key]:
                conflicts.append(f"drafter {key} {saved[key]!r} there, {now[key]!r} here")
        return conflicts

    def resume(self) -> bool:
        """Load the latest complete checkpoint, if any.

        A checkpoint of another configuration (preset, drafter architecture) is refused before loading, naming
        what differs; one that cannot be loaded is refused with its path.
        """
        path = self.latest_checkpoint()
        if path is None:
            return False
        try:
            state = _checked_trainer_state(json.loads((path / "trainer_state.json").read_bytes().decode("utf-8")))
        except (OSError, ValueError) as err:
            raise RuntimeError(f"checkpoint {path} cannot be read (trainer_state.json: {err}). If it is damaged (an "
                               f"interrupted write, a full disk), move it out of {self.checkpoint_dir} and start "
                               "again: training resumes from the checkpoint before it.") from err
        conflicts = self._resume_conflicts(state)
        if conflicts:
            saved_preset = state.get("config", {}).get("preset")
            own = f" (preset {saved_preset!r})" if saved_preset else ""
            raise ValueError(f"{self.output_dir} holds a training run with other settings (checkpoint {path.name}: "
                             f"{'; '.join(conflicts)}). That checkpoint is intact. To train these settings, use "
                             "another output directory (--output-dir); to resume that run, start it again with its "
                             f"own settings{own}.")
        try:
            self.accelerator.load_state(str(path))
        except Exception as err:
            raise RuntimeError(f"checkpoint {path} cannot be loaded ({err}). If it is damaged (an interrupted write, "
                               f"a full disk), move it out of {self.checkpoint_dir} and start again: training "
                               "resumes from the checkpoint before it.") from err
        self.step = int(state["step"])
        self.anchors_seen = int(state.get("anchors_seen", 0))
        saved_precision = state.get("config", {}).get("mixed_precision")
        if saved_precision is not None and saved_precision != self.config.mixed_precision \
                and self.accelerator.is_main_process:
            print(f"[resume] mixed precision {self.config.mixed_precision!r} from step {self.step} on "
                  f"(the checkpoint's run used {saved_precision!r})")
        saved_lr = state.get("config", {}).get("lr")
        if saved_lr is not None and saved_lr != self.config.lr:
            self._set_peak_lr(self.config.lr)
            if self.accelerator.is_main_process:
                print(f"[resume] peak learning rate {self.config.lr:g} from step {self.step} on (the checkpoint's run "
                      f"used {saved_lr:g}); the schedule's shape is unchanged")
        return True

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
        if cfg.tensorboard:
            acc.end_training()
        return {"steps": self.step - start_step, "seconds": seconds, "last": last}

    def set_dev_set(self, references) -> None:
        """The development references (`training.evaluate.build_dev_set`) that `eval_every` measures on."""
        if not references:
            raise ValueError("the development set is empty")
        self.dev_references = references

    def evaluate(self, metrics_path: Path) -> dict:
        """Acceptance on the development set (`training.evaluate.reference_acceptance`), appended to metrics."""
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
        self.accelerator.wait_for_everyone()
        return record

    def unwrapped_drafter(self):
        return self.accelerator.unwrap_model(self.objective).drafter


# Training settings that map a step to a place in the data (order, batches, micro-steps): a resumed run must keep them.
_RESUME_POSITION_FIELDS = ("batch_size", "grad_accum", "updates_per_batch", "seed")
# Drafter config fields that may change between a checkpoint and its resumption.
_RESUME_IGNORED_FIELDS = {"acceptance_profile", "target_name_or_path", "transformers_version", "initializer_range"}


def _checked_trainer_state(state) -> dict:
    """`state`, a checkpoint's `trainer_state.json`, if it has what `Trainer.resume` reads: an object with a step
    number (and an anchor count, a `config` and a `drafter_config` object where present); else `ValueError`."""
    if not isinstance(state, dict):
        raise ValueError(f"a JSON {type(state).__name__}, not an object")
    for key in ("step", "anchors_seen"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key!r} is {value!r}, not a count")
    if "step" not in state:
        raise ValueError("no 'step'")
    for key in ("config", "drafter_config"):
        if key in state and not isinstance(state[key], dict):
            raise ValueError(f"{key!r} is a JSON {type(state[key]).__name__}, not an object")
    return state


def _jsonable(config) -> dict:
    return json.loads(json.dumps(asdict(config), default=str))


__all__ = ["LOSS_NAMES", "PRESETS", "FeatureCache", "FeatureCacheMismatch", "TrainConfig", "Trainer",
           "build_accelerator", "cache_signature", "sample_anchors", "target_features"]
