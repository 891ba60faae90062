"""Which checkpoint a run resumes, decided from the config and the files under ``training.output_dir``.

Owns the pure file rules (no torch): a ``checkpoint-N`` folder is *complete* once its completion
marker exists (:data:`COMPLETE_MARKER`, written by rank 0 after every rank saved its part), and
:func:`resolve_resume` turns ``training.resume_from_checkpoint`` into a folder or None:

- ``auto`` (the default, so ``rollmatch train``, ``rollmatch launch`` and its Slurm script resume a
  resubmitted or rerun job) and ``latest``: the newest complete checkpoint, or step 0 when the folder
  holds none. Newer incomplete ones are named in a warning; checkpoints that exist but none complete
  are refused rather than silently restarting from step 0. ``auto`` under
  ``training.overwrite_output_dir: true`` starts at step 0 instead (``latest`` still resumes: the
  Slurm script's requeue asks for it).
- a path: that checkpoint, which must be complete.
- null: step 0, refused when ``output_dir`` already holds complete checkpoints (training from step 0
  there would overwrite them and ``save_total_limit`` would delete them) unless
  ``training.overwrite_output_dir`` is true.

Any resumed checkpoint saved by another world size is refused (each rank's record stream and carry
buffers belong to its shard ``records[rank::world_size]``). ``rollmatch check-config`` and the trainer
apply the same rules. Leaves out: writing checkpoints and rotation (``training.checkpoints``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from rollmatch.errors import ConfigError, ConfigProblem

log = logging.getLogger(__name__)
COMPLETE_MARKER = "rollmatch_complete.json"
CHECKPOINT_PREFIX = "checkpoint-"
RESUME_KEY = "training.resume_from_checkpoint"
OVERWRITE_KEY = "training.overwrite_output_dir"
RESUME_NEWEST = ("auto", "latest")  # the specs that mean "the newest complete checkpoint, if any"


@dataclass(frozen=True)
class Checkpoint:
    """One ``checkpoint-N`` folder; ``marker`` is its completion marker's content (None: incomplete)."""

    step: int
    path: str
    marker: dict[str, Any] | None

    @property
    def complete(self) -> bool:
        return self.marker is not None


def resolve_resume(
    spec: str | None, output_dir: str, world_size: int | None, *, overwrite: bool = False
) -> str | None:
    """The checkpoint folder to resume from (None: start at step 0); refuses what would resume wrongly
    or start over a run's own work (see the module docstring). ``world_size`` None (``check-config``,
    which does not know it): the saved world size is not checked."""
    if spec is None or (spec == "auto" and overwrite):
        _check_fresh_start(output_dir, overwrite)
        return None
    if spec in RESUME_NEWEST:
        return _latest(spec, output_dir, world_size)
    if not os.path.isdir(spec):
        raise ConfigError(
            [ConfigProblem(RESUME_KEY, spec, "no such checkpoint directory; use `auto` or `latest`")]
        )
    marker = read_complete_marker(spec)
    if marker is None:
        raise ConfigError(
            [
                ConfigProblem(
                    RESUME_KEY,
                    spec,
                    f"incomplete checkpoint: it has no {COMPLETE_MARKER} (written last, after every rank "
                    "saved its state), so the run crashed while saving it; use `latest` or `auto` (the "
                    "newest complete checkpoint) or name a complete one",
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


def read_complete_marker(checkpoint_dir: str) -> dict[str, Any] | None:
    """The completion marker's content; None when the checkpoint is incomplete (no marker)."""
    path = os.path.join(checkpoint_dir, COMPLETE_MARKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return dict(json.load(fh))  # written atomically: a marker that exists is whole


# ------------------------------------------------------------------------------------ private helpers
def _check_fresh_start(output_dir: str, overwrite: bool) -> None:
    complete = [c for c in list_checkpoints(output_dir) if c.complete]
    if not complete:
        return
    names = ", ".join(os.path.basename(c.path) for c in complete)
    if overwrite:
        log.warning(
            "%s: true: starting at step 0 in %s over its complete checkpoint(s) %s (save_total_limit "
            "will delete them as new ones are saved)",
            OVERWRITE_KEY,
            output_dir,
            names,
        )
        return
    raise ConfigError(
        [
            ConfigProblem(
                RESUME_KEY,
                None,
                f"{output_dir} holds complete checkpoint(s) of an earlier run ({names}): starting at step 0 "
                "would train over them and save_total_limit would delete them. To go on from the newest, "
                f"set {RESUME_KEY}: auto; to start over on purpose, set {OVERWRITE_KEY}: true (or use "
                "another training.output_dir)",
            )
        ]
    )


def _latest(spec: str, output_dir: str, world_size: int | None) -> str | None:
    checkpoints = list_checkpoints(output_dir)
    complete = [c for c in checkpoints if c.complete]
    if not complete:
        if checkpoints:
            names = ", ".join(os.path.basename(c.path) for c in checkpoints)
            raise ConfigError(
                [
                    ConfigProblem(
                        RESUME_KEY,
                        spec,
                        f"{output_dir} has checkpoints but none is complete ({names}: no {COMPLETE_MARKER}, "
                        "the run crashed while saving); resuming would silently restart from step 0. To "
                        f"start over deliberately, delete them or set {RESUME_KEY}: null",
                    )
                ]
            )
        log.info(
            "resume_from_checkpoint: %s: no checkpoint under %s yet, starting at step 0", spec, output_dir
        )
        return None
    chosen = complete[-1]
    skipped = [os.path.basename(c.path) for c in checkpoints if c.step > chosen.step]
    if skipped:
        log.warning(
            "resume_from_checkpoint: %s: skipping incomplete checkpoint(s) %s (no %s: a save crashed); "
            "resuming from %s",
            spec,
            ", ".join(skipped),
            COMPLETE_MARKER,
            chosen.path,
        )
    _check_world_size(spec, chosen.path, chosen.marker or {}, world_size)
    return chosen.path


def _check_world_size(spec: str, path: str, marker: dict[str, Any], world_size: int | None) -> None:
    saved = marker.get("world_size")
    if saved is None or world_size is None or int(saved) == world_size:
        return
    raise ConfigError(
        [
            ConfigProblem(
                RESUME_KEY,
                spec,
                f"{path} was saved by {saved} learner process(es), this run has {world_size}: each rank's "
                f"record stream and carry buffers belong to its shard of the records, so resuming with "
                f"another world size would skip or repeat records. Relaunch with {saved} learner "
                "process(es) (torchrun --nproc_per_node / the launch layout that saved it), or start a new "
                f"run (another training.output_dir, {RESUME_KEY}: null)",
            )
        ]
    )
