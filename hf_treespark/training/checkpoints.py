"""Checkpoints of `treespark train`: written atomically on every rank, resumed exactly, refused when foreign.

`publish_state` writes every rank's accelerate state into `.tmp-step-N`, then the run state, then renames once, so
a crash anywhere leaves the previous checkpoints untouched. `TrainerCheckpoints` (a mixin of `Trainer`) saves,
finds the latest complete checkpoint and resumes from it, refusing one of another configuration (preset, data
position fields, drafter architecture, the parts `--train-only` trains) before loading, naming what differs. The
run state keeps the best development evaluation so far (`best_checkpoint`).

Nothing in a checkpoint is unpickled: a checkpoint directory may come from someone else, and a pickle runs code.
The weights are safetensors, the run state and the learning-rate schedule JSON (`trainer_state.json`), and the
files accelerate writes with `torch.save` (optimizer, RNG states, a gradient scaler) are read with
`weights_only=True` forced for every load (`TORCH_FORCE_WEIGHTS_ONLY_LOAD`); one that needs more is refused by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from .best_checkpoint import checked_best_state
from .freeze import all_parts, describe


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


class TrainerCheckpoints:
    """Saving and resuming a `Trainer` (its `accelerator`, `config`, `step`, `anchors_seen`, `output_dir`)."""

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
                     "drafter_config": self._drafter_fields(), "scheduler": _scheduler_state(self.scheduler),
                     "trained_parts": self.trained_parts, "best": self.best}
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
        for key in _RESUME_POSITION_FIELDS:  # under other values a step number means another place in the data
            if key in saved_config and saved_config[key] != getattr(self.config, key):
                conflicts.append(f"{key} {saved_config[key]!r} there, {getattr(self.config, key)!r} here")
        saved, now = state.get("drafter_config") or {}, self._drafter_fields()
        for key in sorted(set(saved) & set(now)):
            if saved[key] != now[key]:
                conflicts.append(f"drafter {key} {saved[key]!r} there, {now[key]!r} here")
        everything = all_parts(self.drafter.config)  # no --train-only (a checkpoint of before it: the same)
        saved_parts, parts = state.get("trained_parts") or everything, self.trained_parts or everything
        if tuple(saved_parts) != tuple(parts):
            conflicts.append(f"--train-only {describe(_or_none(saved_parts, everything))} there, "
                             f"{describe(_or_none(parts, everything))} here")
        return conflicts

    def resume(self) -> bool:
        """Load the latest complete checkpoint, if any.

        A checkpoint of another configuration (preset, drafter architecture, trained parts) is refused before
        loading, naming what differs; one that cannot be loaded is refused with its path.
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
        scheduler_state = state.get("scheduler")
        custom = sorted(path.glob("custom_checkpoint_*"))
        if scheduler_state is not None and custom:
            raise RuntimeError(f"checkpoint file {custom[0]} was refused: this version writes no such file (the "
                               "schedule is in trainer_state.json), so something else put it there. hf_treespark "
                               f"never unpickles checkpoint state; move {path} out of {self.checkpoint_dir} to resume "
                               "from the checkpoint before it.")
        if scheduler_state is None:  # a checkpoint of an earlier version: the schedule in accelerate's pickle
            scheduler_state = _load_weights_only(path / "custom_checkpoint_0.pkl")
            custom_objects = getattr(self.accelerator, "_custom_objects", None)
            if custom_objects is not None:  # accelerate loads only as many custom checkpoints as are registered
                custom_objects.append(self.scheduler)
        try:
            with _weights_only_loads():
                self.accelerator.load_state(str(path), load_kwargs={"weights_only": True})
            self.scheduler.load_state_dict(scheduler_state)
        except Exception as err:
            refused = _refused_pickle(path) if "weights only" in str(err).lower() else None
            if refused is not None:
                raise RuntimeError(f"checkpoint file {refused} was refused: it holds a pickle of more than tensors "
                                   "and plain values, which loading would have to execute. hf_treespark never "
                                   "unpickles checkpoint state; if you did not write this file, do not trust the "
                                   f"checkpoint. Move {path} out of {self.checkpoint_dir} to resume from the "
                                   "checkpoint before it.") from err
            raise RuntimeError(f"checkpoint {path} cannot be loaded ({err}). If it is damaged (an interrupted write, "
                               f"a full disk), move it out of {self.checkpoint_dir} and start again: training "
                               "resumes from the checkpoint before it.") from err
        finally:
            custom_objects = getattr(self.accelerator, "_custom_objects", [])
            if self.scheduler in custom_objects:
                custom_objects.remove(self.scheduler)
        self.step = int(state["step"])
        self.anchors_seen = int(state.get("anchors_seen", 0))
        self.best = state.get("best")
        if self.accelerator.is_main_process:
            print(f"[train] resumed from {path} at step {self.step} of {self.total_steps}")
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


# Training settings that map a step to a place in the data (order, batches, micro-steps), and the labels the steps
# were trained on: a resumed run must keep them.
_RESUME_POSITION_FIELDS = ("batch_size", "grad_accum", "updates_per_batch", "seed", "labels")
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
    for key in ("config", "drafter_config", "scheduler"):
        if key in state and not isinstance(state[key], dict):
            raise ValueError(f"{key!r} is a JSON {type(state[key]).__name__}, not an object")
    parts = state.get("trained_parts")
    if parts is not None and not (isinstance(parts, list) and all(isinstance(part, str) for part in parts)):
        raise ValueError(f"'trained_parts' is {parts!r}, not a list of part names")
    return {**state, "best": checked_best_state(state.get("best"))}


def _or_none(parts, everything: tuple[str, ...]) -> tuple[str, ...] | None:
    """`parts`, or None where they are the whole drafter (`everything`): for `freeze.describe`."""
    return None if tuple(parts) == tuple(everything) else tuple(parts)


def _scheduler_state(scheduler) -> dict:
    """The schedule's `state_dict` as JSON values (step counts, learning rates); raises `TypeError` if it holds
    anything else, rather than saving what could not be restored."""
    return json.loads(json.dumps(scheduler.state_dict()))


@contextlib.contextmanager
def _weights_only_loads():
    """Every `torch.load` inside loads with `weights_only=True`, whatever its caller passes: tensors, containers
    and plain values only, no code run."""
    saved = {name: os.environ.pop(name, None)
             for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def _load_weights_only(path: Path):
    """`path` loaded with `weights_only=True` (numpy arrays allowed, as accelerate saves RNG states);
    `RuntimeError` naming the file if it is missing or holds more than tensors and plain values."""
    from accelerate.utils import load

    try:
        with _weights_only_loads():
            return load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise RuntimeError(f"checkpoint file {path} is missing: the checkpoint is incomplete. Move "
                           f"{path.parent} aside to resume from the checkpoint before it.") from err
    except Exception as err:
        raise RuntimeError(f"checkpoint file {path} was refused: it cannot be loaded as tensors and plain values "
                           f"({str(err).splitlines()[0]}); hf_treespark never unpickles checkpoint state. Move "
                           f"{path.parent} aside to resume from the checkpoint before it.") from err


def _refused_pickle(checkpoint: Path) -> Path | None:
    """The first file of `checkpoint` saved by `torch.save` that `weights_only=True` refuses, if any."""
    for path in sorted(checkpoint.iterdir()):
        if path.suffix in (".bin", ".pkl", ".pt", ".pth"):
            try:
                _load_weights_only(path)
            except RuntimeError:
                return path
    return None


def _jsonable(config) -> dict:
    return json.loads(json.dumps(asdict(config), default=str))
