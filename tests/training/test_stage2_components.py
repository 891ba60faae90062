"""Stage-2 AB parts on a tiny real model, without HF's loop: windows, decode batching, the step-mode
B loop (sequential and pipelined) and its whole-step loss normalisation."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollmatch.collectives import LocalCollectives
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.codec import build_codec
from rollmatch.packing.collate import model_inputs, pad_batch
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout, RolloutRequest, SyncReport
from rollmatch.training import stage2
from rollmatch.training.channels import RolloutChannel
from rollmatch.training.losses import weighted_ce_sum
from rollmatch.training.stage2 import ChannelMicroStep, DecodeBatchedRollouts, build_stage2
from rollmatch.training.step_mode import StepLearner
from rollmatch.training.variants import BuildContext


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
def test_b_window_rolls_out_in_decode_batches_and_a_window_never(parts, monkeypatch, decode_batch, calls):
    parts.cfg.stage2_ab.channel_b.rollout_decode_batch_size = decode_batch
    # The backend itself batches everything in one generate: the chunking must come from the variant.
    backend = RecordingBackend(hf_backend(parts.model, parts.encoder))
    monkeypatch.setattr(stage2, "backend_for", lambda ctx: backend)
    ctx = BuildContext(
        cfg=parts.cfg,
        model=parts.model,
        encoder=parts.encoder,
        codec=parts.codec,
        collectives=LocalCollectives(),
        gradient_accumulation_steps=4,
    )
    variant = build_stage2(ctx)
    raw_batches = [[r] for r in parts.records[:4]]  # learner micro-batch 1, GAS 4

    window_a = variant.build_window(raw_batches, 0)  # b_ratio 0.5: step 0 is A, step 1 is B
    assert backend.calls == []
    window_b = variant.build_window(raw_batches, 1)
    assert [size for size, _, _ in backend.calls] == calls

    for window, kind in ((window_a, "A"), (window_b, "B")):
        assert len(window.micro_batches) == 4
        assert all(isinstance(m, ChannelMicroStep) for m in window.micro_batches)
        assert {m.tally.kind for m in window.micro_batches} == {kind}
        assert len({id(m.tally) for m in window.micro_batches}) == 1  # one window, one decision
        assert window.sums["stage2_ab/step_kind_b"] == (kind == "B")
    assert window_b.sums["stage2_ab/rollouts"] == 4
    assert window_b.sums["stage2_ab/b_ratio_realized"] == 0.5


def row_trainer(model: torch.nn.Module, log: list[tuple[float, float]] | None = None):
    """Forward/backward of one row divided by the normaliser, as RollmatchTrainer.compute_loss does."""

    def train_row(batch: dict[str, Any], normaliser: float) -> torch.Tensor:
        start = time.perf_counter()
        logits = model(**model_inputs(batch)).logits
        loss = weighted_ce_sum(logits, batch["input_ids"], batch["weights"]) / normaliser
        loss.backward()
        if log is not None:
            log.append((start, time.perf_counter()))
        return loss.detach()

    return train_row


def gradient(model: torch.nn.Module) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad(set_to_none=True)
    return grads


def learner(
    rollouts: DecodeBatchedRollouts, *, packing_length: int, pipeline: bool, packing: bool = True
) -> StepLearner:
    return StepLearner(
        produce_chunk=rollouts.chunk,
        decode_batch_size=rollouts.decode_batch_size,
        packing=packing,
        packing_length=packing_length,
        batch_size=3,
        pad_token_id=0,
        pipeline=pipeline,
        wait_timeout_s=120.0,
    )


@pytest.mark.heavy
def test_step_mode_learns_every_segment_with_whole_step_normalisation(parts, tiny_model_dir):
    model, records = parts.model, parts.records[:4]
    rollouts = DecodeBatchedRollouts(
        RolloutChannel(model, parts.encoder, parts.codec, parts.cfg, hf_backend(model, parts.encoder)),
        decode_batch_size=2,
        training_seed=0,
    )
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
    outcome = learner(rollouts, packing_length=packing_length, pipeline=False).learn(
        records, 3, row_trainer(model), model
    )
    assert torch.allclose(gradient(model), reference, rtol=1e-4, atol=1e-7)
    assert outcome.loss == pytest.approx(float(reference_loss), rel=1e-5)
    assert outcome.sums["rollout/count"] == 4 and outcome.sums["stage2_ab/rollouts"] == 4
    assert outcome.sums["packing/segments"] == 4
    assert 1 < outcome.sums["packing/rows"] < 4
    assert outcome.sums["loss/weight"] == pytest.approx(total_weight)
    # Packing off: padded batches of per_device_train_batch_size (3 here) segments, same gradient.
    outcome = learner(rollouts, packing_length=packing_length, pipeline=False, packing=False).learn(
        records, 3, row_trainer(model), model
    )
    assert torch.allclose(gradient(model), reference, rtol=1e-4, atol=1e-7)
    assert outcome.sums["stage2_ab/step/forward_passes"] == 2 and "packing/rows" not in outcome.sums

    # Pipelined: rollouts from a separate copy of the weights (as on a rollout server) in a thread.
    from transformers import AutoModelForImageTextToText

    server_model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    backend = RecordingBackend(hf_backend(server_model, parts.encoder))
    piped = DecodeBatchedRollouts(
        RolloutChannel(model, parts.encoder, parts.codec, parts.cfg, backend),
        decode_batch_size=2,
        training_seed=0,
    )
    train_log: list[tuple[float, float]] = []
    outcome = learner(piped, packing_length=longest + 8, pipeline=True).learn(
        records, 3, row_trainer(model, train_log), model
    )
    # Rows were formed while rollouts streamed in, yet the step gradient is the same.
    assert torch.allclose(gradient(model), reference, rtol=1e-4, atol=1e-7)
    assert outcome.loss == pytest.approx(float(reference_loss), rel=1e-5)
    assert [size for size, _, _ in backend.calls] == [2, 2]
    later_rollouts = [(start, end) for _, start, end in backend.calls[1:]]
    assert any(g0 < t1 and t0 < g1 for g0, g1 in later_rollouts for t0, t1 in train_log), (
        "no rollout overlapped learning"
    )
    assert outcome.sums["stage2_ab/step/learner_wait_s"] < outcome.sums["stage2_ab/step/seconds"]


def test_pipeline_reraises_a_rollout_failure_in_the_learner(parts):
    class FailingChunk(RuntimeError):
        pass

    def produce_chunk(records: Any, global_step: int, start: int) -> Any:
        raise FailingChunk(f"backend died on chunk starting at {start}")

    failing = StepLearner(
        produce_chunk=produce_chunk,
        decode_batch_size=2,
        packing=True,
        packing_length=512,
        batch_size=1,
        pad_token_id=0,
        pipeline=True,
        wait_timeout_s=30.0,
    )
    with pytest.raises(FailingChunk, match="chunk starting at 0"):
        failing.learn(parts.records[:4], 0, row_trainer(parts.model), parts.model)


def test_pipeline_wait_is_bounded_and_names_the_phase(parts):
    release = threading.Event()

    def stalled_chunk(records: Any, global_step: int, start: int) -> Any:
        release.wait(10.0)  # a backend that never answers within the learner's bound
        raise RuntimeError("released")

    stalled = StepLearner(
        produce_chunk=stalled_chunk,
        decode_batch_size=2,
        packing=True,
        packing_length=512,
        batch_size=1,
        pad_token_id=0,
        pipeline=True,
        wait_timeout_s=0.5,
    )
    from rollmatch.errors import BackendError

    try:
        with pytest.raises(BackendError, match=r"optimizer step 7.*decode batch 1/2"):
            stalled.learn(parts.records[:4], 7, row_trainer(parts.model), parts.model)
    finally:
        release.set()
