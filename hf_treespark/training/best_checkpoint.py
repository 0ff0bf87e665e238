"""`OUTPUT_DIR/best/`: the drafter of a training run with the highest development score its evaluations saw.

With `--eval-every N` the trainer measures the drafter on the development set every N optimizer steps (and at
step 0 and the last step; `Trainer.evaluate`). The score is the first number of that evaluation,
`dev_acceptance_length` (`BEST_SCORE`): the mean nodes a greedy round accepts plus the bonus token, on the
development references at the evaluation's tree budget (`evaluate.reference_acceptance`). Whenever an evaluation
beats every earlier one of the run (strictly: a tie keeps the earlier, shorter-trained drafter), the drafter is
written to `best/` in `save_pretrained` layout (loadable as `final/` is: `AutoModel.from_pretrained`), with
`best.json` beside its weights: `{"step", "score", "score_name", "evaluation"}`.

The write is atomic: the drafter goes to `.tmp-best` first, then `best/` is moved aside to `.old-best` and the new
one renamed into place; a crash leaves either the previous best or the new one (or, between the two renames,
`.old-best`, which `publish_best` puts back before anything else). The best score so far is part of the checkpoint
state (`trainer_state.json`, key `best`), so a resumed run compares with what the checkpoint's run had seen;
evaluations after the last checkpoint are run again when the steps are.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

BEST_SCORE = "dev_acceptance_length"  # the evaluation's number that best/ maximises
BEST_DIR = "best"
BEST_FILE = "best.json"


def improves(record: dict, best: dict | None) -> bool:
    """True if the evaluation `record` (a `metrics.jsonl` line with `BEST_SCORE`) scores above `best` (a
    `best_state`, or None: nothing seen yet). A score that is not a finite number never improves."""
    score = record.get(BEST_SCORE)
    if not isinstance(score, (int, float)) or not math.isfinite(score):
        return False
    return best is None or score > best["score"]


def best_state(record: dict) -> dict:
    """What the checkpoint state keeps of the best evaluation `record`: `{"step", "score"}`."""
    return {"step": int(record["step"]), "score": float(record[BEST_SCORE])}


def checked_best_state(value) -> dict | None:
    """`value`, a checkpoint's saved `best`, if it is None or `{"step": count, "score": number}`; else `ValueError`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"'best' is a JSON {type(value).__name__}, not an object")
    step, score = value.get("step"), value.get("score")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"'best' has step {step!r}, not a count")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise ValueError(f"'best' has score {score!r}, not a number")
    return {"step": step, "score": float(score)}


def publish_best(drafter, output_dir: str | Path, record: dict) -> Path:
    """Write `drafter` to `output_dir/best` atomically (see the module docstring) with `best.json`: `step`, `score`
    (the evaluation `record`'s `BEST_SCORE`), `score_name` and the whole `evaluation` (anchors seen, depth rates,
    budget). Returns the directory."""
    from ..hub.sharing import save_drafter

    out = Path(output_dir)
    final, tmp, old = out / BEST_DIR, out / f".tmp-{BEST_DIR}", out / f".old-{BEST_DIR}"
    if old.is_dir() and not final.exists():  # a crash between the two renames: the previous best is there
        old.rename(final)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    save_drafter(drafter, tmp)
    summary = {**best_state(record), "score_name": BEST_SCORE, "evaluation": record}
    (tmp / BEST_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_best(output_dir: str | Path) -> dict | None:
    """`output_dir/best/best.json`, or None if there is none (or it cannot be read)."""
    try:
        return json.loads((Path(output_dir) / BEST_DIR / BEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def final_and_best(output_dir: str | Path, step: int, best: dict | None) -> str:
    """One line for the end of a run evaluated on a development set: `final/`'s score (the evaluation at `step`,
    read from `metrics.jsonl`, if the run evaluated there) and `best/`'s (`best`, a `best_state`)."""
    from .evaluate import read_curve

    out = Path(output_dir)
    metrics = out / "metrics.jsonl"
    at_step = [r for r in read_curve(metrics) if r.get("step") == step] if metrics.is_file() else []
    final = (f"{out / 'final'} (step {step}) scores {BEST_SCORE} {at_step[-1][BEST_SCORE]:.4f}" if at_step
             else f"{out / 'final'} (step {step}) was not evaluated")
    if best is None:
        return f"[best] {final}; no evaluation scored, so no {out / BEST_DIR}"
    same = " (the same drafter)" if best["step"] == step else ""
    return f"[best] {final}; {out / BEST_DIR} (step {best['step']}) scores {best['score']:.4f}{same}"
