"""The scheduler's warning signal: stop with a complete checkpoint, from the first second of a run.

SIGUSR1 is what ``rollmatch launch`` forwards to every learner rank when Slurm's
``--signal=USR1@<s>`` warning reaches it (and keeps forwarding until the learner exits, so a rank that
was still starting gets it too). Owns:

- :func:`install_warning_handler`: handle SIGUSR1 from process start (``rollmatch train`` calls it before
  loading anything): the handler only records it in one process-wide flag (:func:`warning_received`).
  Until then the signal is ignored, never fatal: the launcher starts the learner with SIGUSR1 ignored.
- :class:`CheckpointOnWarning`, an HF ``TrainerCallback``. :meth:`~CheckpointOnWarning.stop_before_training`
  is one vote right before training starts: a warning during model load or server connect stops the run
  there (nothing trained since the checkpoint it resumed from, which stays the newest complete one). At
  every optimizer step's end the ranks agree on it (one scalar all-reduce, so a rank the signal reached a
  moment later still stops at the same step); once any rank has it, every rank asks the Trainer to save
  a checkpoint (``RollmatchTrainer._save_checkpoint``: HF's files, each rank's state, then the completion
  marker) and to stop. A step waiting for async Channel-B packs stops waiting within one wait slice of
  the flag (``channel_b.async_mode``), so ``max_wait_s`` does not delay the checkpoint.
- :func:`warning_budget_problem`: ``launch.slurm.signal_warning_s`` against the measured save and step
  time plus ``max_wait_s``: a warning that comes too late is named once, with the fix.

``training.resume_from_checkpoint: auto`` (the default) resumes from the checkpoint, async runs included
(the record-stream ledger is part of each rank's state). Leaves out: what a checkpoint holds
(``training.checkpoints``, ``training.trainer``) and what the launcher does meanwhile
(``launch.supervisor`` keeps the servers up until the learner exits).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rollmatch.collectives import Collectives

log = logging.getLogger(__name__)
WARNING_SIGNAL = signal.SIGUSR1
_RECEIVED = threading.Event()  # process-wide: set by the handler, cleared once a run acted on it
SIGNAL_WARNING_KEY = "launch.slurm.signal_warning_s"


def install_warning_handler() -> None:
    """Record SIGUSR1 from now on (main thread only: Python's rule for signal handlers; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(WARNING_SIGNAL, _record)


def ignore_warning_signal() -> None:
    """From now on SIGUSR1 is ignored: call when the process is about to exit. The launcher keeps
    forwarding it until the learner exits, and Python restores the default (fatal) action of every signal
    it handles while shutting down; an ignored one stays ignored."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(WARNING_SIGNAL, signal.SIG_IGN)


def warning_received() -> bool:
    """SIGUSR1 reached this process since the last run that acted on it."""
    return _RECEIVED.is_set()


def _record(signum: int, frame: FrameType | None) -> None:
    _RECEIVED.set()


def warning_budget_problem(
    signal_warning_s: float | None, *, save_s: float, step_s: float, max_wait_s: float
) -> str | None:
    """Why ``signal_warning_s`` is too short for a save after the current step (None when it suffices):
    the warning may come while a step runs (``step_s``) and waits for packs (``max_wait_s``; the stop
    ends that wait within one slice, but a signal between the wait and the step end does not), then
    the checkpoint takes ``save_s``."""
    if signal_warning_s is None:
        return None
    needed = save_s + step_s + max_wait_s
    if signal_warning_s >= needed:
        return None
    return (
        f"{SIGNAL_WARNING_KEY} = {signal_warning_s:.0f}s is less than one save ({save_s:.1f}s) + one step "
        f"({step_s:.1f}s) + stage2_ab.channel_b.async.max_wait_s ({max_wait_s:.0f}s) = {needed:.0f}s: a warning "
        f"can come too late to write a complete checkpoint before the time limit (the job then ends as "
        f"TIMEOUT, not requeued). Raise {SIGNAL_WARNING_KEY} to at least {1.5 * needed:.0f}"
    )


class CheckpointOnWarning(TrainerCallback):
    """SIGUSR1 -> a complete checkpoint at the end of the current step, then the run stops."""

    def __init__(
        self, collectives: Collectives, *, signal_warning_s: float | None = None, max_wait_s: float = 0.0
    ):
        self.collectives = collectives
        self.received = _RECEIVED
        self.stopped_at_step: int | None = None  # the step whose checkpoint the warning saved
        self.stopped_before_training = False
        self.signal_warning_s = signal_warning_s
        self.max_wait_s = max_wait_s
        self.budget_problem: str | None = None  # said once, after the first measured save
        self._step_started = 0.0
        self._step_ended = 0.0
        self._longest_step_s = 0.0

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._step_started = time.monotonic()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The first save measured: is ``signal_warning_s`` enough for a step and a save?"""
        if self.signal_warning_s is None or self.budget_problem is not None or not self._step_ended:
            return
        self.budget_problem = warning_budget_problem(
            self.signal_warning_s,
            save_s=time.monotonic() - self._step_ended,
            step_s=self._longest_step_s,
            max_wait_s=self.max_wait_s,
        )
        if self.budget_problem is not None:
            log.warning("%s", self.budget_problem)
        else:
            self.budget_problem = ""  # checked: enough

    def install(self) -> None:
        """Handle SIGUSR1 from now on (already done at process start by ``rollmatch train``)."""
        install_warning_handler()

    def uninstall(self) -> None:
        """The run ended: a warning it acted on is spent (the handler stays: the process may still get
        one while it tears down, which must not kill it)."""
        if self.stopped_at_step is not None or self.stopped_before_training:
            _RECEIVED.clear()

    def stop_before_training(self, resume_step: int) -> bool:
        """One vote before the first step: True (on every rank) when any rank got the warning while the run
        was starting; nothing was trained, so the newest complete checkpoint stays the one to resume."""
        here = 1.0 if self.received.is_set() else 0.0
        if self.collectives.world_size > 1:
            (here,) = self.collectives.all_reduce_sum([here], "warning signal vote before training")
        if here > 0:
            self.stopped_before_training = True
            log.warning(
                "warning signal (SIGUSR1) while the run was starting: stopping before training (step %d); "
                "the next start resumes from the newest complete checkpoint",
                resume_step,
            )
        return here > 0

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self._step_ended = time.monotonic()
        if self._step_started:
            self._longest_step_s = max(self._longest_step_s, self._step_ended - self._step_started)
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
