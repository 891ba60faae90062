"""Checkpoints rollmatch can trust: what makes one complete, which one a run resumes, which ones rotate.

Owns the files rollmatch adds to HF's ``checkpoint-N`` folders — each rank's state
(:func:`save_rank_state`) and the completion marker (:func:`write_complete_marker`), written by rank 0
after every rank saved its part — and the rules built on them:

- :func:`~rollmatch.config.resume.resolve_resume` (re-exported here): ``training.resume_from_checkpoint``
  to a folder, and the refusal of a fresh start over complete checkpoints (``config.resume`` owns those
  file rules, so ``check-config`` applies them too).
- :func:`rotate_checkpoints`: ``training.save_total_limit``, applied only once the newest checkpoint is
  complete (HF rotates inside its own save, before rollmatch's part is written: a crash there would
  leave no complete checkpoint), counting complete checkpoints only.
- :class:`ConfiguredIntervals`: on resume HF restores the checkpoint's ``save_steps``,
  ``eval_steps`` and ``logging_steps`` over the run's own (with only a warning); the run's config wins.

Leaves out: writing HF's files (the ``Trainer``) and what a rank's state holds
(``RollmatchTrainer.stateful``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rollmatch.config.resume import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    Checkpoint,
    latest_complete_checkpoint,
    list_checkpoints,
    read_complete_marker,
    resolve_resume,
)

log = logging.getLogger(__name__)
__all__ = [  # the file rules live in config.resume; re-exported for the trainer's users
    "CHECKPOINT_PREFIX",
    "COMPLETE_MARKER",
    "Checkpoint",
    "ConfiguredIntervals",
    "clear_complete_marker",
    "latest_complete_checkpoint",
    "list_checkpoints",
    "rank_state_file",
    "read_complete_marker",
    "resolve_resume",
    "rotate_checkpoints",
    "save_rank_state",
    "write_complete_marker",
]


class ConfiguredIntervals(TrainerCallback):
    """Puts the run's save/eval/logging intervals back after HF loaded a checkpoint's.

    A run resumed with another ``training.save_steps`` (say, more often, because the job gets
    preempted) would otherwise keep saving at the interval the checkpoint was written with.
    ``on_train_begin`` runs after HF loaded the checkpoint's state and before the first step."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        state.compute_steps(args, state.max_steps)


def rank_state_file(checkpoint_dir: str, rank: int) -> str:
    """Where rank ``rank`` keeps its rollmatch state (carry buffers, record stream) in a checkpoint."""
    return os.path.join(checkpoint_dir, f"rollmatch_state_rank{rank}.pt")


def save_rank_state(checkpoint_dir: str, rank: int, state: dict[str, Any]) -> None:
    """Write rank ``rank``'s state into ``checkpoint_dir`` atomically (a crash leaves no partial file)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = rank_state_file(checkpoint_dir, rank)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def write_complete_marker(checkpoint_dir: str, global_step: int, world_size: int) -> None:
    """Mark ``checkpoint_dir`` complete: call once every rank's state is saved (after a barrier)."""
    path = os.path.join(checkpoint_dir, COMPLETE_MARKER)
    with open(path + ".tmp", "w") as fh:
        json.dump({"global_step": global_step, "world_size": world_size}, fh)
    os.replace(path + ".tmp", path)


def clear_complete_marker(checkpoint_dir: str) -> None:
    """Unmark ``checkpoint_dir`` before saving into it again: until the new save ends it is incomplete."""
    path = os.path.join(checkpoint_dir, COMPLETE_MARKER)
    if os.path.isfile(path):
        os.remove(path)


def rotate_checkpoints(
    output_dir: str, save_total_limit: int | None, *, keep: Iterable[str | None] = ()
) -> list[str]:
    """Delete what ``save_total_limit`` no longer keeps; call once the newest checkpoint is complete.

    The newest ``save_total_limit`` complete checkpoints stay, and so does every folder in ``keep``
    (the one just saved, HF's best checkpoint), as HF's own rotation keeps them. Incomplete folders are
    leftovers of crashed saves that nothing resumes from: they go too. ``None``: keep everything.
    Returns the deleted folders.
    """
    if save_total_limit is None:
        return []
    protected = {os.path.normpath(p) for p in keep if p is not None}
    checkpoints = list_checkpoints(output_dir)
    complete = [c for c in checkpoints if c.complete]
    num_to_keep = max(save_total_limit, sum(os.path.normpath(c.path) in protected for c in complete))
    doomed = [c for c in checkpoints if not c.complete and os.path.normpath(c.path) not in protected]
    remaining = len(complete)
    for checkpoint in complete:  # oldest first
        if remaining <= num_to_keep:
            break
        if os.path.normpath(checkpoint.path) not in protected:
            doomed.append(checkpoint)
            remaining -= 1
    for checkpoint in doomed:
        why = "save_total_limit" if checkpoint.complete else "incomplete (a save crashed)"
        log.info("deleting checkpoint %s: %s", checkpoint.path, why)
        shutil.rmtree(checkpoint.path, ignore_errors=True)
    return [c.path for c in doomed]
