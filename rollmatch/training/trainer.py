"""The thin HF ``Trainer`` subclass: the seam between HF's loop and rollmatch's step planner.

HF owns the loop (accumulation, clipping, optimizer/scheduler, DDP/DeepSpeed, logging, checkpoint
files). This class only:

- hands each optimizer step's raw record batches to the :class:`~rollmatch.training.step.StepPlanner`
  (``get_batch_samples``) and returns its micro-steps, with the step's global loss weight as HF's
  ``num_items_in_batch``;
- trains a micro-step (``training_step``): one forward/backward per row, gradient synchronisation only on
  the last pass of the optimizer step, loss ``sum(w * ce) / W_step`` (``compute_loss``) scaled by the world
  size because DDP averages gradients — so packing, accumulation and world size leave gradients unchanged;
- merges the planner's metric sums into HF's logs (per-rank sums known only after training are reduced
  across ranks at log time), and saves each rank's carry buffers / record-stream position with every
  checkpoint, marked complete only after every rank wrote its part; ``save_total_limit`` rotates only
  after that (``training.checkpoints`` owns the layout and the rules);
- evaluates with rollmatch's detection eval (``evaluate``: ``training.periodic_eval``) when HF's eval
  strategy says so, logging ``eval/*`` and returning HF-style ``eval_*`` keys so ``metric_for_best_model``,
  best-checkpoint retention and ``load_best_model_at_end`` work as HF's own (the best model is reloaded the
  way resume loads weights).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch.utils.data import Dataset
from transformers import Trainer

from rollmatch.collectives import Collectives
from rollmatch.config.run_file import write_run_file
from rollmatch.packing.collate import model_inputs
from rollmatch.training import checkpoints
from rollmatch.training.console import use_console_line
from rollmatch.training.coord_loss import CoordLoss
from rollmatch.training.grpo_loss import GrpoSettings, frozen_copy, grpo_loss_sum, token_logprobs
from rollmatch.training.losses import weighted_ce_sum
from rollmatch.training.param_groups import optimizer_param_groups
from rollmatch.training.periodic_eval import DetectionEval, hf_metrics
from rollmatch.training.step import MicroStep, StepPlan, StepPlanner

log = logging.getLogger(__name__)
# aggregated metric sums, number of optimizer steps -> metric values
SummaryFn = Callable[[Counter[str], int], dict[str, float]]


class RecordDataset(Dataset):
    """A list of records as a map-style dataset (the collator keeps them as Python objects)."""

    def __init__(self, records: list[Any]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Any:
        return self.records[index]


def keep_records(batch: list[Any]) -> list[Any]:
    """Collator: records stay records; encoding happens per step, after rollouts."""
    return batch


class RollmatchTrainer(Trainer):
    """HF Trainer whose micro-batches come from a step planner (rollouts, targets, packing)."""

    # compute_loss already divides by the step's total weight over all micro-steps.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        planner: StepPlanner,
        summarize: SummaryFn,
        collectives: Collectives,
        stateful: Mapping[str, Any] | None = None,
        detection_eval: DetectionEval | None = None,
        coord_loss: CoordLoss | None = None,
        grpo: GrpoSettings | None = None,
        lr_multipliers: Mapping[str, float] | None = None,
        run_settings: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        use_console_line(self)  # one short line per log; every metric still goes to metrics.jsonl
        # rollmatch_run.json of every checkpoint (config.run_file): the settings travel with the weights
        self.run_settings = dict(run_settings) if run_settings is not None else None
        self.lr_multipliers = dict(lr_multipliers or {})  # training.lr_multipliers, per module group
        self.planner = planner
        self.coord_loss = coord_loss  # coordinate positions' loss (object_format: coord_tokens)
        self.grpo = grpo  # loss.objective: grpo (rows carrying advantages train the policy-gradient loss)
        # loss.grpo.kl_coef > 0: a frozen copy of the starting weights (one more copy of the parameters)
        self.reference_model = frozen_copy(self.model) if grpo is not None and grpo.kl_coef > 0 else None
        self.detection_eval = detection_eval
        self.summarize = summarize
        self.collectives = collectives
        self.stateful = dict(stateful or {})
        self._plan: StepPlan | None = None
        self._pending_sums: Counter[str] = Counter()  # summed over ranks already
        self._local_sums: Counter[str] = Counter()  # this rank's, reduced at log time
        self._gauges: dict[str, float] = {}
        self._pending_steps = 0

    # ------------------------------------------------------------------ batches and loss
    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, torch.Tensor | None]:
        windows = []
        for _ in range(num_batches):
            try:
                windows.append(next(epoch_iterator))
            except StopIteration:
                break
        if not windows:
            return [], None
        step = self.state.global_step
        plan = self.planner.plan(windows, step, final=step + 1 >= self.state.max_steps > 0)
        self._plan = plan
        self._pending_sums.update(plan.sums)
        self._gauges.update(plan.gauges)
        self._pending_steps += 1
        return plan.micro_steps, torch.tensor(plan.total_weight, dtype=torch.float64, device=device)

    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        if not isinstance(inputs, MicroStep):
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        loss = torch.zeros((), device=self.args.device)
        passes = inputs.passes(float(num_items_in_batch) if num_items_in_batch is not None else 0.0)
        try:
            for batch, normaliser, accumulate_only in self._sync_points(passes, inputs.index == inputs.count):
                weight = torch.tensor(normaliser, dtype=torch.float64, device=self.args.device)
                with self._accumulate_only(model) if accumulate_only else contextlib.nullcontext():
                    loss = loss + super().training_step(model, batch, weight)
        finally:
            close = getattr(passes, "close", None)
            if close is not None:  # a generator (pipelined rows): stop its rollout thread on failure
                close()
        loss = inputs.finish(model, loss)
        self._record(inputs, loss)
        return loss

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
        if "advantages" in inputs:
            loss_sum = self._grpo_loss_sum(outputs.logits, inputs)
        else:
            loss_sum = weighted_ce_sum(
                outputs.logits,
                inputs["input_ids"],
                inputs["weights"],
                self.coord_loss,
                inputs.get("unlikelihood_weights"),
            )
        loss = loss_sum * self.collectives.world_size / num_items_in_batch.to(loss_sum.dtype)
        return (loss, outputs) if return_outputs else loss

    def _grpo_loss_sum(self, logits: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """A policy-gradient row's loss sum (``training.grpo_loss``); its stats join this rank's sums."""
        if self.grpo is None:
            raise RuntimeError("a row carries advantages but loss.objective is not grpo")
        trained = inputs["weights"] != 0
        temperature = self.grpo.temperature  # the sampling distribution's log-probs, as the engines record
        logprobs = token_logprobs(logits, inputs["input_ids"], trained, temperature)
        reference = None
        if self.reference_model is not None:
            with torch.no_grad():
                reference_logits = self.reference_model(**model_inputs(inputs)).logits
                reference = token_logprobs(reference_logits, inputs["input_ids"], trained, temperature)
        # Weights trained now are version global_step (every sync pushes the step count); a token sampled by
        # an older version (packing carry, async packs) or of unknown version (-1) is stale.
        versions = inputs["behaviour_versions"].to(logprobs.device)
        lag = torch.where(versions < 0, 1.0, float(self.state.global_step) - versions)
        loss_sum, stats = grpo_loss_sum(
            logprobs,
            inputs["behaviour_logprobs"],
            inputs["advantages"],
            inputs["weights"],
            self.grpo,
            reference_logprobs=reference,
            lag=lag,
            sequence_ids=inputs["sequence_ids"],
        )
        self._local_sums.update(stats)
        return loss_sum

    def floating_point_ops(self, inputs: Any) -> int:
        return 0 if isinstance(inputs, MicroStep) else super().floating_point_ops(inputs)

    def _sync_points(
        self, passes: Iterator[tuple[Any, float]], last_micro_step: bool
    ) -> Iterator[tuple[Any, float, bool]]:
        """``(batch, normaliser, accumulate_only)``: only the step's very last pass may sync gradients.

        Under DDP or DeepSpeed every backward outside ``accumulate_only`` all-reduces (DeepSpeed also
        steps), so in the last micro-step all passes but the last accumulate only. A single plain process
        needs no look-ahead (which would delay a pipelined row until the next one is ready).
        """
        if not last_micro_step or self.accelerator.distributed_type == DistributedType.NO:
            for batch, normaliser in passes:
                yield batch, normaliser, False
            return
        previous: tuple[Any, float] | None = None
        for item in passes:
            if previous is not None:
                yield previous[0], previous[1], True
            previous = item
        if previous is not None:
            yield previous[0], previous[1], False

    @contextlib.contextmanager
    def _accumulate_only(self, model: torch.nn.Module) -> Iterator[None]:
        """Accumulate this pass's gradients locally: no all-reduce, no DeepSpeed step yet."""
        state = self.accelerator.gradient_state
        was = state.sync_gradients
        state._set_sync_gradients(False)
        try:
            with self.accelerator.no_sync(model):
                yield
        finally:
            state._set_sync_gradients(was)

    def _record(self, micro: MicroStep, loss: torch.Tensor) -> None:
        log.debug(
            "stage2_ab step %d micro-step %d/%d ran Channel-%s on rank %d",
            micro.step,
            micro.index,
            micro.count,
            micro.kind,
            self.collectives.rank,
        )
        local = self._local_sums
        local.update(micro.local_sums())
        local[f"stage2_ab/loss_{micro.kind.lower()}_sum"] += float(loss) / self.collectives.world_size
        if micro.index == micro.count and self._plan is not None:
            elapsed = time.perf_counter() - self._plan.started_at
            local["step/seconds"] += elapsed / self.collectives.world_size  # mean over ranks once summed
            if self._plan.timing_key:
                local[self._plan.timing_key] += elapsed / self.collectives.world_size

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """HF's optimizer, with one parameter group per module group when ``training.lr_multipliers`` is set."""
        if not self.lr_multipliers or self.optimizer is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        decay = set(self.get_decay_parameter_names(opt_model))
        groups = optimizer_param_groups(
            opt_model,
            learning_rate=self.args.learning_rate,
            weight_decay=self.args.weight_decay,
            multipliers=self.lr_multipliers,
            no_decay=[name for name, _ in opt_model.named_parameters() if name not in decay],
        )
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """HF's hook, called on every rank; a line with the training loss also gathers every rank's
        metric sums (:meth:`_gather_pending_sums`, a collective)."""
        if "loss" in logs and self.lr_multipliers and self.optimizer is not None:
            for group in self.optimizer.param_groups:  # lr/<group>: what each module group trains with
                if "name" in group and not group["name"].endswith("/no_decay"):
                    logs[f"lr/{group['name']}"] = float(group["lr"])
        if "loss" in logs and self._pending_steps:
            logs.update(self.summarize(self._gather_pending_sums(), self._pending_steps))
            logs.update(self._gauges)
            self._pending_sums, self._local_sums, self._pending_steps = Counter(), Counter(), 0
        super().log(logs, start_time)

    def _gather_pending_sums(self) -> Counter[str]:
        """The sums of every rank since the last log line: a collective (one all-gather), so every rank
        calls it at the same log lines (HF's loop logs the training loss at the same steps everywhere)."""
        sums = self._pending_sums
        for rank_sums in self.collectives.all_gather_object(dict(self._local_sums), "metrics at log time"):
            sums.update(rank_sums)
        return sums

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Detection eval of the current weights on every rank (rank 0 rolls out); logs ``eval/*``."""
        if self.detection_eval is None:
            raise RuntimeError(
                "evaluation was requested but no detection eval is configured: set training.eval_steps "
                "(or training.eval_strategy) and data.val_jsonl"
            )
        round_ = self.detection_eval.run(self.state.global_step)
        if round_.sync is not None:  # the push counts towards the next log line's sync/* metrics
            self._pending_sums.update(
                {"sync/seconds": round_.sync.seconds, "sync/bytes": round_.sync.num_bytes, "sync/pushes": 1}
            )
            self._gauges["sync/version"] = float(round_.sync.version)
        self.log(dict(round_.metrics))
        metrics = hf_metrics(round_.metrics, metric_key_prefix)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights, loaded the way resume loads them."""
        best = self.state.best_model_checkpoint
        if (
            best is None
            or self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or hasattr(self.model, "peft_config")
        ):
            super()._load_best_model()
            return
        log.info(
            "loading the best model (%s = %s) from %s",
            self.args.metric_for_best_model,
            self.state.best_metric,
            best,
        )
        self._load_from_checkpoint(best)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """HF's checkpoint, then each rank's state, then (rank 0) the completion marker, then rotation.

        HF would rotate (``save_total_limit``) inside its own save, before the new checkpoint is complete:
        a crash before the marker could then leave no complete checkpoint at all. Here rotation waits
        until the marker is written, and counts complete checkpoints only.
        """
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{checkpoints.CHECKPOINT_PREFIX}{self.state.global_step}")
        if self.args.should_save:
            checkpoints.clear_complete_marker(folder)  # saving into it again: incomplete until done
        with self._hf_rotation_off():
            super()._save_checkpoint(model, trial)
        state = {name: part.state_dict() for name, part in self.stateful.items()}
        checkpoints.save_rank_state(folder, self.collectives.rank, state)
        self.collectives.barrier(f"checkpoint {self.state.global_step}: every rank saved its state")
        if self.args.should_save:
            if self.run_settings is not None:
                write_run_file(folder, self.run_settings)
            checkpoints.write_complete_marker(folder, self.state.global_step, self.collectives.world_size)
            checkpoints.rotate_checkpoints(
                run_dir, self.args.save_total_limit, keep=(folder, self.state.best_model_checkpoint)
            )

    @contextlib.contextmanager
    def _hf_rotation_off(self) -> Iterator[None]:
        """No ``save_total_limit`` during HF's save (it rotates at its end); restored afterwards."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            yield
        finally:
            self.args.save_total_limit = limit

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        """Model weights of a checkpoint, loaded the way ``from_pretrained`` loads them.

        HF's default loads ``model.safetensors`` with a non-strict ``load_state_dict``; Qwen-VL checkpoints
        are saved under the legacy key names (``model.layers.*``, ``visual.*``) that ``from_pretrained``
        converts, so that path silently restores nothing and a resumed run trains from the initial weights.
        Adapters (PEFT) and sharded engines keep HF's own path.
        """
        target = model if model is not None else self.model
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or hasattr(target, "peft_config"):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        from transformers import AutoModelForImageTextToText

        first = next(target.parameters())
        saved = AutoModelForImageTextToText.from_pretrained(resume_from_checkpoint, dtype=first.dtype)
        result = target.load_state_dict(saved.state_dict(), strict=False)
        problems = [*result.missing_keys, *result.unexpected_keys]
        if problems:
            raise RuntimeError(
                f"checkpoint {resume_from_checkpoint} does not match the model ({len(problems)} keys differ, e.g. "
                f"{problems[:3]}); resume with the model.path and LoRA settings the checkpoint was trained with"
            )
        log.info("model weights restored from %s", resume_from_checkpoint)

    def load_rank_state(self, checkpoint_dir: str) -> None:
        """Restore this rank's carry buffers / record stream from ``checkpoint_dir`` (before ``train``)."""
        path = checkpoints.rank_state_file(checkpoint_dir, self.collectives.rank)
        if not os.path.isfile(path):
            log.warning(
                "%s has no rollmatch state for rank %d: carry buffers start empty",
                checkpoint_dir,
                self.collectives.rank,
            )
            return
        state = torch.load(path, weights_only=True)
        for name, part in self.stateful.items():
            part.load_state_dict(state.get(name))
