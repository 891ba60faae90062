"""The training console: one short metrics line per log interval instead of HF's dict of every metric.

Owns :func:`metrics_line` (a log dict -> ``step 120/1000 | loss 0.823 | lr 1e-05 | ...``) and the
callbacks that print it in place of HF's :class:`ProgressCallback` / :class:`PrinterCallback` (which
print all ~50 logged names every ``training.logging_steps``). Every metric still reaches
``<output_dir>/metrics.jsonl`` and TensorBoard (docs/metrics.md); the console shows the few a person
watches. Leaves out: what is logged (``training.metric_summary``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

# (logged name, console label), in console order; names absent from a log line are left out.
CONSOLE_METRICS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("learning_rate", "lr"),
    ("grad_norm", "grad_norm"),
    ("match/f1", "f1"),
    ("rollout/truncated_frac", "truncated"),
    ("grpo/reward_mean", "reward"),
    ("stage2_ab/step_kind_b", "B_frac"),
    ("step/seconds", "s/step"),
    ("eval/f1", "eval_f1"),
    ("eval/map", "eval_map"),
)


def metrics_line(step: int, max_steps: int, logs: Mapping[str, Any]) -> str:
    """``step S/N | name value | ...`` for the :data:`CONSOLE_METRICS` present in ``logs``; HF's summary at
    the end of training becomes ``end of training at step S | train_loss ... | runtime ...s``."""
    if "train_runtime" in logs:
        loss = logs.get("train_loss")
        shown = f" | train_loss {loss:.4g}" if isinstance(loss, int | float) else ""
        return f"end of training at step {step}{shown} | runtime {float(logs['train_runtime']):.1f}s"
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    for name, label in CONSOLE_METRICS:
        value = logs.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{label} {value:.4g}")
    return " | ".join(parts)


class ConsoleProgress(ProgressCallback):
    """HF's progress bar, with :func:`metrics_line` written under it at each log."""

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(metrics_line(state.global_step, state.max_steps, logs))


class ConsolePrinter(TrainerCallback):
    """:func:`metrics_line` printed at each log (``hf_args: {disable_tqdm: true}``: no progress bar)."""

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if state.is_world_process_zero and logs:
            print(metrics_line(state.global_step, state.max_steps, logs), flush=True)


def use_console_line(trainer: Any) -> None:
    """Replace the trainer's HF progress/printer callback by its one-line counterpart."""
    for hf_callback, ours in ((ProgressCallback, ConsoleProgress), (PrinterCallback, ConsolePrinter)):
        if any(type(cb) is hf_callback for cb in trainer.callback_handler.callbacks):
            trainer.remove_callback(hf_callback)
            trainer.add_callback(ours)
