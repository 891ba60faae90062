"""The thin HF ``Trainer`` subclass: the seam between HF's loop and rollmatch's components.

HF owns the loop (accumulation, clipping, optimizer/scheduler, DDP/DeepSpeed, logging, checkpoint
files). This class only:

- turns each accumulation window of raw records into model-ready micro-batches through a
  :class:`~rollmatch.training.window.WindowBuilder` (``get_batch_samples``), returning the step's
  global loss weight as HF's ``num_items_in_batch``;
- computes the weighted loss ``sum(w * ce) / W_step`` (``compute_loss``), scaled by the world size
  because DDP averages gradients, so packing, accumulation and world size leave gradients unchanged;
- merges rollmatch's metric sums into HF's logs, and marks checkpoints complete.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset
from transformers import Trainer

from rollmatch.collectives import Collectives
from rollmatch.packing.collate import model_inputs
from rollmatch.training.losses import weighted_ce_sum
from rollmatch.training.window import WindowFn

COMPLETE_MARKER = "rollmatch_complete.json"
# aggregated metric sums, number of optimizer steps -> metric values
SummaryFn = Callable[[Counter[str], int], dict[str, float]]


@runtime_checkable
class CustomMicroStep(Protocol):
    """A micro-step that runs its own forward/backward passes (e.g. Stage-2 step mode: zero passes
    on the first GAS-1 micro-steps, then one pass per packed row). Returns the detached loss to log."""

    def run(self, trainer: RollmatchTrainer, model: torch.nn.Module) -> torch.Tensor: ...


class RecordDataset(Dataset):
    """A list of records as a map-style dataset (the collator keeps them as Python objects)."""

    def __init__(self, records: list[Any]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Any:
        return self.records[index]


def keep_records(batch: list[Any]) -> list[Any]:
    """Collator: records stay records; encoding happens per window, after rollouts."""
    return batch


class RollmatchTrainer(Trainer):
    """HF Trainer whose micro-batches come from a window builder (rollouts, targets, packing)."""

    # compute_loss already divides by the step's total weight over all micro-steps.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        build_window: WindowFn,
        summarize: SummaryFn,
        collectives: Collectives,
        before_window: Callable[[int], None] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.build_window = build_window
        self.summarize = summarize
        self.collectives = collectives
        self.before_window = before_window
        self._pending_sums: Counter[str] = Counter()
        self._pending_steps = 0

    # ------------------------------------------------------------------ batches and loss
    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, torch.Tensor | None]:
        raw_batches = []
        for _ in range(num_batches):
            try:
                raw_batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not raw_batches:
            return [], None
        step = self.state.global_step
        if self.before_window is not None:
            self.before_window(step)
        window = self.build_window(raw_batches, step)
        self._pending_sums.update(window.sums)
        self._pending_steps += 1
        return window.micro_batches, torch.tensor(window.total_weight, dtype=torch.float64, device=device)

    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        if isinstance(inputs, CustomMicroStep):
            model.train()
            return inputs.run(self, model)
        return super().training_step(model, inputs, num_items_in_batch)

    def floating_point_ops(self, inputs: Any) -> int:
        return 0 if isinstance(inputs, CustomMicroStep) else super().floating_point_ops(inputs)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        if num_items_in_batch is None:
            raise RuntimeError("compute_loss needs the step's total loss weight (set by get_batch_samples)")
        outputs = model(**model_inputs(inputs))
        loss_sum = weighted_ce_sum(outputs.logits, inputs["input_ids"], inputs["weights"])
        loss = loss_sum * self.collectives.world_size / num_items_in_batch.to(loss_sum.dtype)
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ logging
    def add_metric_sums(self, sums: Mapping[str, float]) -> None:
        """Add metric sums known only while a micro-step runs (e.g. Stage-2 step mode)."""
        self._pending_sums.update(sums)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._pending_steps:
            logs.update(self.summarize(self._pending_sums, self._pending_steps))
            self._pending_sums = Counter()
            self._pending_steps = 0
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            # Written last: a checkpoint without it is incomplete and never resumed from.
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            marker = {"global_step": self.state.global_step, "weight_version": self.state.global_step}
            tmp = os.path.join(folder, COMPLETE_MARKER + ".tmp")
            with open(tmp, "w") as fh:
                json.dump(marker, fh)
            os.replace(tmp, os.path.join(folder, COMPLETE_MARKER))


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """Newest ``checkpoint-N`` under ``output_dir`` whose completion marker exists."""
    if not os.path.isdir(output_dir):
        return None
    steps = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name.startswith("checkpoint-") and os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            steps.append((int(name.split("-")[1]), path))
    return max(steps)[1] if steps else None
