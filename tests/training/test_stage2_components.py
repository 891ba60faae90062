"""Stage-2 AB parts on a tiny real model, without HF's loop: step plans, decode batching, the step-mode
B channel (sequential and pipelined) and its whole-step loss normalisation."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from resolved_runs import cpu_run, producer

from rollmatch.collectives import LocalCollectives
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.object_formats import build_codec
from rollmatch.errors import BackendError
from rollmatch.packing.collate import model_inputs, pad_batch
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout, RolloutRequest, SyncReport
from rollmatch.training import variants
from rollmatch.training.channel_b.step_mode import StepRecordStream, StepRollouts
from rollmatch.training.losses import weighted_ce_sum
from rollmatch.training.rows import RowPlanner
from rollmatch.training.step import ABSchedule, MicroStep, StepPlanner
from rollmatch.training.variants import BuildContext, build_stage2


class RecordingBackend:
    """A real backend, plus a log of each generate call (size and wall-clock interval)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[int, float, float]] = []
        self.lock = threading.Lock()

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        start = time.perf_counter()
        out = self.inner.generate(requests, decoding, seed)
        with self.lock:
            self.calls.append((len(requests), start, time.perf_counter()))
        return out

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        return self.inner.sync_weights(model, version)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def parts(loaded_tiny, tiny_model_dir, make_config):
    model, _ = loaded_tiny
    cfg = make_config(
        {
            "custom": {
                "trainer_variant": "stage2_ab_training",
                "extra": {"rollout_matching": {"max_new_tokens": 8}},
            },
            "stage2_ab": {"schedule": {"b_ratio": 0.5}},
            "training": {"per_device_train_batch_size": 1},
        }
    )
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    model.zero_grad(set_to_none=True)
    yield SimpleNamespace(
        model=model, cfg=cfg, encoder=encoder, codec=codec, records=load_records(cfg.data.train_jsonl)
    )
    model.zero_grad(set_to_none=True)  # the session model is shared: leave no gradients behind


def hf_backend(model: Any, encoder: PromptEncoder, batch_size: int = 64) -> HFBackend:
    return HFBackend(
        model,
        encoder.tokenizer,
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
        batch_size=batch_size,
    )


@pytest.mark.parametrize(("decode_batch", "calls"), [(2, [2, 2]), (3, [3, 1])])
def test_b_step_rolls_out_in_decode_batches_and_an_a_step_never(parts, monkeypatch, decode_batch, calls):
    parts.cfg.rollout.decode_batch_size = decode_batch  # resolved into the run below
    # The backend itself batches everything in one generate: the chunking must come from the channel.
    backend = RecordingBackend(hf_backend(parts.model, parts.encoder))
    monkeypatch.setattr(variants, "backend_for", lambda ctx: backend)
    ctx = BuildContext(
        run=cpu_run(parts.cfg, gradient_accumulation_steps=4),
        model=parts.model,
        encoder=parts.encoder,
        codec=parts.codec,
        collectives=LocalCollectives(),
    )
    planner = build_stage2(ctx).planner
    windows = [[r] for r in parts.records[:4]]  # learner micro-batch 1, GAS 4

    plan_a = planner.plan(windows, 0)  # b_ratio 0.5: step 0 is A, step 1 is B
    assert backend.calls == []
    plan_b = planner.plan(windows, 1)
    assert [size for size, _, _ in backend.calls] == calls

    for plan, kind in ((plan_a, "A"), (plan_b, "B")):
        assert plan.kind == kind
        assert len(plan.micro_steps) == 4
        assert all(isinstance(m, MicroStep) and m.kind == kind for m in plan.micro_steps)
        assert [m.index for m in plan.micro_steps] == [1, 2, 3, 4]
        assert len(plan.micro_steps[-1].rows) >= 1  # the micro-step that syncs gradients trains a row
        assert plan.sums["stage2_ab/step_kind_b"] == (kind == "B")
    assert plan_b.sums["stage2_ab/rollouts"] == 4
    assert plan_b.sums["stage2_ab/b_ratio_realized"] == 0.5


def gradient(model: torch.nn.Module) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad(set_to_none=True)
    return grads


def step_planner(
    rollouts: Any, records: list[Any], *, packing_length: int, pipeline: bool, packing: bool = True
) -> StepPlanner:
    """A B-only planner whose Channel-B is step mode over ``records`` (budget = all of them)."""
    channel = StepRollouts(
        rollouts=rollouts,
        rows=RowPlanner(packing=packing, packing_length=packing_length, carry_limit=64, pad_token_id=0),
        records=StepRecordStream(records, share=len(records), seed=0, rank=0),
        batch_size=3,
        pipeline=pipeline,
        wait_timeout_s=120.0,
    )
    return StepPlanner(
        schedule=ABSchedule(1.0),
        channel_a=None,
        channel_b=channel,
        sync=None,
        collectives=LocalCollectives(),
        report_ab=True,
    )


def all_sums(plan: Any) -> Counter[str]:
    sums = Counter(plan.sums)
    for micro in plan.micro_steps:
        sums.update(micro.local_sums())
    return sums


@pytest.mark.heavy
def test_step_mode_learns_every_segment_with_whole_step_normalisation(parts, tiny_model_dir, train_plan):
    model, records = parts.model, parts.records[:4]
    rollouts = producer(parts, model, hf_backend(model, parts.encoder), 2)
    windows = [[r] for r in records]
    # Reference: every segment in one padded batch, sum(w * ce) / sum(w).
    segments = rollouts.produce(records, 3).segments
    total_weight = sum(s.weight_sum for s in segments)
    batch = pad_batch(segments, parts.encoder.pad_token_id)
    logits = model(**model_inputs(batch)).logits
    reference_loss = weighted_ce_sum(logits, batch["input_ids"], batch["weights"]) / total_weight
    reference_loss.backward()
    reference_loss = reference_loss.detach()
    reference = gradient(model)

    longest = max(s.length for s in segments)
    packing_length = 2 * longest + 8  # several segments per row, a variable number of rows
    plan = step_planner(rollouts, records, packing_length=packing_length, pipeline=False).plan(windows, 3)
    loss = train_plan(model, plan)
    assert torch.allclose(gradient(model), reference, rtol=1e-4, atol=1e-7)
    assert float(loss) == pytest.approx(float(reference_loss), rel=1e-5)
    sums = all_sums(plan)
    assert sums["rollout/count"] == 4 and sums["stage2_ab/rollouts"] == 4
    assert sums["packing/segments"] == 4
    assert 1 < sums["packing/rows"] < 4
    assert sums["loss/weight"] == pytest.approx(total_weight)
    # Packing off: padded batches of per_device_train_batch_size (3 here) segments, same gradient.
    plan = step_planner(rollouts, records, packing_length=packing_length, pipeline=False, packing=False).plan(
        windows, 3
    )
    train_plan(model, plan)
    assert torch.allclose(gradient(model), reference, rtol=1e-4, atol=1e-7)
    sums = all_sums(plan)
    assert sums["stage2_ab/step/forward_passes"] == 2 and "packing/rows" not in sums

    # Pipelined: rollouts from a separate copy of the weights (as on a rollout server) in a thread.
    from transformers import AutoModelForImageTextToText

    server_model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    backend = RecordingBackend(hf_backend(server_model, parts.encoder))
    piped = producer(parts, model, backend, 2)
    plan = step_planner(piped, records, packing_length=longest + 8, pipeline=True).plan(windows, 3)
    assert [len(m.rows) for m in plan.micro_steps[:-1]] == [0, 0, 0]  # rows arrive in the last one
    train_log: list[tuple[float, float]] = []
    original_passes = plan.micro_steps[-1].passes

    def logged_passes(step_weight: float) -> Any:
        for item in original_passes(step_weight):
            start = time.perf_counter()
            yield item
            train_log.append((start, time.perf_counter()))

    plan.micro_steps[-1].passes = logged_passes  # type: ignore[method-assign]
    loss = train_plan(model, plan)
    # Rows were formed while rollouts streamed in, yet the step gradient is the same.
    assert torch.allclose(gradient(model), reference, rtol=1e-4, atol=1e-7)
    assert float(loss) == pytest.approx(float(reference_loss), rel=1e-5)
    assert [size for size, _, _ in backend.calls] == [2, 2]
    later_rollouts = [(start, end) for _, start, end in backend.calls[1:]]
    assert any(g0 < t1 and t0 < g1 for g0, g1 in later_rollouts for t0, t1 in train_log), (
        "no rollout overlapped learning"
    )
    sums = all_sums(plan)
    assert sums["rollout/count"] == 4 and sums["loss/weight"] == pytest.approx(total_weight)
    assert sums["stage2_ab/step/learner_wait_s"] > 0


def test_step_mode_rolls_out_only_on_the_final_micro_step(parts) -> None:
    """The spec's scenario (bs 1, GAS 8): seven micro-steps buffer, the eighth rolls out and learns to
    completion: no rollout starts before the seventh micro-step's passes are done."""
    model, records = parts.model, parts.records[:8]
    backend = RecordingBackend(hf_backend(model, parts.encoder))
    rollouts = producer(parts, model, backend, 4)
    plan = step_planner(rollouts, records, packing_length=4096, pipeline=False).plan(
        [[r] for r in records], 3
    )
    assert len(plan.micro_steps) == 8 and backend.calls == []  # planning rolled nothing out
    ends = []
    for micro in plan.micro_steps[:-1]:
        assert list(micro.passes(1.0)) == []  # buffering micro-steps: no pass
        ends.append(time.perf_counter())
    assert backend.calls == []
    rows = list(plan.micro_steps[-1].passes(1.0))
    assert rows and [size for size, _, _ in backend.calls] == [4, 4]
    assert min(start for _, start, _ in backend.calls) > ends[-1]  # after the seventh micro-step ended
    sums = all_sums(plan)
    assert sums["rollout/count"] == 8 and sums["stage2_ab/step/forward_passes"] == len(rows)


class ScriptedRollouts:
    """Fault injection: a rollout channel whose chunks fail or never arrive."""

    def __init__(self, produce_chunk: Any):
        self.decode_batch_size = 2
        self.rollouts_per_record = 1
        self.produce_chunk = produce_chunk


def test_pipeline_reraises_a_rollout_failure_in_the_learner(parts, train_plan):
    class FailingChunk(RuntimeError):
        pass

    def produce_chunk(records: Any, global_step: int, start: int) -> Any:
        raise FailingChunk(f"backend died on chunk starting at {start}")

    records = parts.records[:4]
    planner = step_planner(ScriptedRollouts(produce_chunk), records, packing_length=512, pipeline=True)
    plan = planner.plan([[r] for r in records], 0)
    with pytest.raises(FailingChunk, match="chunk starting at 0"):
        train_plan(parts.model, plan)


def test_pipeline_wait_is_bounded_and_names_the_phase(parts, train_plan):
    release = threading.Event()

    def stalled_chunk(records: Any, global_step: int, start: int) -> Any:
        release.wait(10.0)  # a backend that never answers within the learner's bound
        raise RuntimeError("released")

    records = parts.records[:4]
    planner = step_planner(ScriptedRollouts(stalled_chunk), records, packing_length=512, pipeline=True)
    planner.channel_b.wait_timeout_s = 0.5  # type: ignore[union-attr]
    plan = planner.plan([[r] for r in records], 7)
    try:
        with pytest.raises(BackendError, match=r"optimizer step 7.*decode batch 1/2"):
            train_plan(parts.model, plan)
    finally:
        release.set()
