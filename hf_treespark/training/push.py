"""Pushing a trained drafter to the Hub: the checks before training, and one line when the upload fails.

`treespark train --push-to-hub ID` checks the repository id (and that the Hub can be asked at all) before it
trains; an upload that then fails on the network or at the Hub ends in one line that says what failed, that
the drafter is kept in OUTPUT_DIR/final, and the `treespark push` command that retries it.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

# Packages whose exceptions mean the network or the Hub failed an upload (huggingface_hub talks HTTP through
# httpx, or its fork httpx2; older releases through requests).
_HUB_PACKAGES = {"huggingface_hub", "httpx", "httpx2", "httpcore", "requests", "urllib3"}


def check_push_target(repo_id: str, option: str = "--push-to-hub") -> None:
    """Refuse, before any work, a push that cannot succeed: no repository id (None or empty), one the Hub would
    reject, or `HF_HUB_OFFLINE` set (the upload would fail once training is done). Raises `ValueError` naming
    `option`."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ValueError(f"{option} needs a Hub repository id (ORG/NAME, or NAME for one under your own account); "
                         f"got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{option} {repo_id!r} is not a Hub repository id (ORG/NAME or NAME): "
                         f"{' '.join(str(err).split())}") from None
    if constants.HF_HUB_OFFLINE:  # read at import from the environment, as the Hub client reads it
        raise ValueError(f"{option} {repo_id}: HF_HUB_OFFLINE is set, so the upload would fail after training; "
                         f"unset it, or train without {option} and run `treespark push` where the Hub can be reached")


def hub_failure(err: BaseException) -> str | None:
    """What failed, in one line, when `err` comes from the network or the Hub (no connection, a timeout, offline
    mode, a refusal such as 401 or 403); None for any other error."""
    packages = {cls.__module__.split(".")[0] for cls in type(err).__mro__}
    if not (packages & _HUB_PACKAGES or isinstance(err, (ConnectionError, TimeoutError))):
        return None
    text = f"{type(err).__name__}: {' '.join(str(err).split())}"
    return text if len(text) <= 300 else text[:297] + "..."


def push_command(drafter_dir: str | os.PathLike, repo_id: str, base_model: str | None = None) -> str:
    """The `treespark push` command that uploads `drafter_dir` to `repo_id` (with `--base-model` when given)."""
    command = f"treespark push --drafter {shlex.quote(str(drafter_dir))} --repo-id {shlex.quote(repo_id)}"
    return command if base_model is None else f"{command} --base-model {shlex.quote(base_model)}"


def push_trained_drafter(drafter, repo_id: str, final: Path):
    """`hub.push_drafter_to_hub(drafter, repo_id)` for the drafter just saved to `final`; a failed upload raises
    `RuntimeError` in one line naming what failed, `final` (kept) and the command that retries it. No `repo_id`
    (None or empty) raises `push_drafter_to_hub`'s `ValueError` naming it, as it is: there is no upload to retry."""
    from ..drafter.modeling_io import check_repo_id
    from ..hub.sharing import push_drafter_to_hub

    check_repo_id(repo_id, "push_drafter_to_hub")
    try:
        return push_drafter_to_hub(drafter, repo_id)
    except Exception as err:  # every failed upload: the trained drafter is safe in final/ either way
        what = hub_failure(err) or f"{type(err).__name__}: {' '.join(str(err).split())}"
        raise RuntimeError(f"pushing to the Hub repository {repo_id} failed ({what}). The trained drafter is kept "
                           f"in {final}; retry with: {push_command(final, repo_id)}") from err
