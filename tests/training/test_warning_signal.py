"""The scheduler's warning (SIGUSR1) from the first second of a run: during model load the run stops
before training with its newest complete checkpoint intact and the next start resumes from it; during
an async step's ``max_wait_s`` wait the step stops waiting within one wait slice.

Gates, never sleeps: the signal is sent from inside the phase under test (the model load, the wait),
by the test's own wrapper of that phase."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollmatch.training import entry, preemption
from rollmatch.training.checkpoints import COMPLETE_MARKER
from rollmatch.training.entry import run_training


@pytest.fixture
def usr1_guard() -> Iterator[None]:
    """SIGUSR1 never kills the test process (the run installs its own handler over this one); the
    handler and the process-wide flag are put back afterwards."""
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGUSR1, previous)
    preemption._RECEIVED.clear()


def sft_config(make_config: Any, out: Path, **training: Any) -> Any:
    return make_config(
        {
            "custom": {"trainer_variant": "sft"},
            "training": {"output_dir": str(out), "per_device_train_batch_size": 2, **training},
        }
    )


@pytest.mark.heavy
def test_a_warning_during_model_load_stops_before_training_and_the_next_start_resumes(
    make_config: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, usr1_guard: None
) -> None:
    out = tmp_path / "out"
    first = run_training(sft_config(make_config, out, max_steps=2, save_steps=2))
    assert first.global_step == 2 and (out / "checkpoint-2" / COMPLETE_MARKER).is_file()

    load = entry.load_model

    def load_with_warning(cfg: Any) -> Any:
        os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's warning, while the weights load
        return load(cfg)

    with monkeypatch.context() as patch:
        patch.setattr(entry, "load_model", load_with_warning)
        stopped = run_training(sft_config(make_config, out, max_steps=4, save_steps=2))
    assert stopped.stopped_before_training and stopped.final_model_dir is None
    assert stopped.global_step == 2  # resumed from checkpoint-2, stopped before training anything
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / "checkpoint-2" / COMPLETE_MARKER).is_file()
    assert not preemption.warning_received()  # acted on: the next start does not stop again

    resumed = run_training(sft_config(make_config, out, max_steps=4, save_steps=2))
    assert resumed.global_step == 4 and resumed.final_model_dir is not None
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [h["step"] for h in logged if "loss" in h]
    assert steps == [1, 2, 3, 4], steps  # steps 1-2 once (first run), then 3-4 (the resume)


def test_the_signal_budget_names_the_key_and_the_fix() -> None:
    assert preemption.warning_budget_problem(None, save_s=50, step_s=50, max_wait_s=50) is None
    assert preemption.warning_budget_problem(300, save_s=40, step_s=30, max_wait_s=60) is None
    problem = preemption.warning_budget_problem(120, save_s=40, step_s=30, max_wait_s=60)
    assert problem is not None
    assert "launch.slurm.signal_warning_s = 120s is less than one save (40.0s) + one step (30.0s)" in problem
    assert "max_wait_s (60s) = 130s" in problem and "at least 195" in problem


def test_the_first_save_checks_the_budget_once(caplog: pytest.LogCaptureFixture) -> None:
    from rollmatch.collectives import LocalCollectives

    callback = preemption.CheckpointOnWarning(LocalCollectives(), signal_warning_s=1, max_wait_s=5.0)
    state, control = type("State", (), {"global_step": 1})(), type("Control", (), {})()
    callback.on_step_begin(None, state, control)  # type: ignore[arg-type]
    callback.on_step_end(None, state, control)  # type: ignore[arg-type]
    callback.on_save(None, state, control)  # type: ignore[arg-type]
    assert callback.budget_problem is not None and "signal_warning_s = 1s" in callback.budget_problem
    assert "signal_warning_s = 1s" in caplog.text
    callback.on_save(None, state, control)  # type: ignore[arg-type]
    assert caplog.text.count("signal_warning_s = 1s") == 1  # said once
