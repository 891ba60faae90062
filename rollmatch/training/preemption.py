"""The scheduler's warning signal: save a complete checkpoint at the end of the current step, then stop.

Owns :class:`CheckpointOnWarning`, an HF ``TrainerCallback``. While installed, SIGUSR1 (what
``rollmatch launch`` forwards when Slurm's ``--signal=USR1@<s>`` warning reaches it) only records that
it came. At every optimizer step's end the ranks agree on it (one scalar all-reduce over the
collectives' group, so a rank the signal reached a moment later still stops at the same step); once any
rank has it, every rank asks the Trainer to save a checkpoint (``RollmatchTrainer._save_checkpoint``:
HF's files, each rank's state, then the completion marker) and to stop. ``training.resume_from_checkpoint:
latest`` resumes from it, async runs included (the record-stream ledger is part of each rank's state).
Leaves out: what a checkpoint holds (``training.checkpoints``, ``training.trainer``) and what the launcher
does meanwhile (``launch.supervisor`` keeps the servers up until the learner exits).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rollmatch.collectives import Collectives

log = logging.getLogger(__name__)
WARNING_SIGNAL = signal.SIGUSR1


class CheckpointOnWarning(TrainerCallback):
    """SIGUSR1 -> a complete checkpoint at the end of the current step, then the run stops."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives
        self.received = threading.Event()
        self.stopped_at_step: int | None = None  # the step whose checkpoint the warning saved
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Handle SIGUSR1 from now on (main thread only: Python's rule for signal handlers)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(WARNING_SIGNAL, self._record)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(WARNING_SIGNAL, self._previous)
            self._installed = False

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        here = 1.0 if self.received.is_set() else 0.0
        if self.collectives.world_size > 1:
            (here,) = self.collectives.all_reduce_sum(
                [here], f"step {state.global_step}: warning signal vote"
            )
        if here > 0 and self.stopped_at_step is None:
            self.stopped_at_step = state.global_step
            log.warning(
                "warning signal (SIGUSR1): saving checkpoint-%d, then stopping; the next start resumes "
                "from it (training.resume_from_checkpoint: auto, the default)",
                state.global_step,
            )
            control.should_save = True
            control.should_training_stop = True
        return control

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received.set()
