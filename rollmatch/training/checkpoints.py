"""Checkpoints rollmatch can trust: what makes one complete, which one a run resumes, which ones rotate.

Owns the files rollmatch adds to HF's ``checkpoint-N`` folders — each rank's state
(:func:`save_rank_state`) and the completion marker (:func:`write_complete_marker`), written by rank 0
after every rank saved its part — and the rules built on them:

- :func:`resolve_resume`: ``training.resume_from_checkpoint`` to a folder. ``latest`` is the newest
  complete checkpoint (newer incomplete ones are named in a warning); an explicit path must be complete;
  either is refused when it was saved by another world size (each rank's record stream and carry
  buffers belong to its shard ``records[rank::world_size]``, so another world size would skip or repeat
  records). ``latest`` where checkpoints exist but none is complete is refused too, rather than silently
  restarting from step 0.
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
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rollmatch.errors import ConfigError, ConfigProblem

log = logging.getLogger(__name__)
COMPLETE_MARKER = "rollmatch_complete.json"
CHECKPOINT_PREFIX = "checkpoint-"
_RESUME_KEY = "training.resume_from_checkpoint"


class ConfiguredIntervals(TrainerCallback):
    """Puts the run's save/eval/logging intervals back after HF loaded a checkpoint's.

    A run resumed with another ``training.save_steps`` (say, more often, because the job gets
    preempted) would otherwise keep saving at the interval the checkpoint was written with.
    ``on_train_begin`` runs after HF loaded the checkpoint's state and before the first step."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        state.compute_steps(args, state.max_steps)


@dataclass(frozen=True)
class Checkpoint:
    """One ``checkpoint-N`` folder; ``marker`` is its completion marker's content (None: incomplete)."""

    step: int
    path: str
    marker: dict[str, Any] | None

    @property
    def complete(self) -> bool:
        return self.marker is not None


def resolve_resume(spec: str | None, output_dir: str, world_size: int) -> str | None:
    """The checkpoint folder to resume from (None: start at step 0); refuses what would resume wrongly."""
    if spec is None:
        return None
    if spec == "latest":
        return _latest(output_dir, world_size)
    if not os.path.isdir(spec):
        raise ConfigError([ConfigProblem(_RESUME_KEY, spec, "no such checkpoint directory; use `latest`")])
    marker = read_complete_marker(spec)
    if marker is None:
        raise ConfigError(
            [
                ConfigProblem(
                    _RESUME_KEY,
                    spec,
                    f"incomplete checkpoint: it has no {COMPLETE_MARKER} (written last, after every rank "
                    "saved its state), so the run crashed while saving it; use `latest` (the newest "
                    "complete checkpoint) or name a complete one",
                )
            ]
        )
    _check_world_size(spec, spec, marker, world_size)
    return spec


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """Newest ``checkpoint-N`` under ``output_dir`` whose completion marker exists."""
    complete = [c for c in list_checkpoints(output_dir) if c.complete]
    return complete[-1].path if complete else None


def list_checkpoints(output_dir: str) -> list[Checkpoint]:
    """Every ``checkpoint-N`` folder under ``output_dir``, complete or not, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        step = name.removeprefix(CHECKPOINT_PREFIX)
        if name.startswith(CHECKPOINT_PREFIX) and step.isdigit() and os.path.isdir(path):
            found.append(Checkpoint(int(step), path, read_complete_marker(path)))
    return sorted(found, key=lambda c: c.step)


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


def read_complete_marker(checkpoint_dir: str) -> dict[str, Any] | None:
    """The completion marker's content; None when the checkpoint is incomplete (no marker)."""
    path = os.path.join(checkpoint_dir, COMPLETE_MARKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return dict(json.load(fh))  # written atomically: a marker that exists is whole


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


def _latest(output_dir: str, world_size: int) -> str | None:
    checkpoints = list_checkpoints(output_dir)
    complete = [c for c in checkpoints if c.complete]
    if not complete:
        if checkpoints:
            names = ", ".join(os.path.basename(c.path) for c in checkpoints)
            raise ConfigError(
                [
                    ConfigProblem(
                        _RESUME_KEY,
                        "latest",
                        f"{output_dir} has checkpoints but none is complete ({names}: no {COMPLETE_MARKER}, "
                        "the run crashed while saving); resuming would silently restart from step 0. To "
                        "start over deliberately, delete them or set training.resume_from_checkpoint: null",
                    )
                ]
            )
        log.info("resume_from_checkpoint: latest: no checkpoint under %s yet, starting at step 0", output_dir)
        return None
    chosen = complete[-1]
    skipped = [os.path.basename(c.path) for c in checkpoints if c.step > chosen.step]
    if skipped:
        log.warning(
            "resume_from_checkpoint: latest: skipping incomplete checkpoint(s) %s (no %s: a save crashed); "
            "resuming from %s",
            ", ".join(skipped),
            COMPLETE_MARKER,
            chosen.path,
        )
    _check_world_size("latest", chosen.path, chosen.marker or {}, world_size)
    return chosen.path


def _check_world_size(spec: str, path: str, marker: dict[str, Any], world_size: int) -> None:
    saved = marker.get("world_size")
    if saved is None or int(saved) == world_size:
        return
    raise ConfigError(
        [
            ConfigProblem(
                _RESUME_KEY,
                spec,
                f"{path} was saved by {saved} learner process(es), this run has {world_size}: each rank's "
                f"record stream and carry buffers belong to its shard of the records, so resuming with "
                f"another world size would skip or repeat records. Relaunch with {saved} learner "
                "process(es) (torchrun --nproc_per_node / the launch layout that saved it), or start a new "
                "run (another training.output_dir, training.resume_from_checkpoint: null)",
            )
        ]
    )
