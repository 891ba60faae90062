"""Several rollouts per record (`rollouts_per_record` K): K samples of each record, each its own segment,
its own deterministic seed and its own count, in micro and step mode (server and async modes: the GRPO
end-to-end tests)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from resolved_runs import cpu_run

from rollmatch.collectives import LocalCollectives
from rollmatch.config.decoding import rollout_decoding
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.object_formats import build_codec
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout, RolloutRequest, SyncReport
from rollmatch.training import variants
from rollmatch.training.segment_producers import RolloutSegmentProducer
from rollmatch.training.variants import BuildContext, build_stage2

SAMPLING = {"temperature": 1.0}


class SeedRecordingBackend:
    """The real HF backend, plus each call's request sample ids and seed."""

    def __init__(self, inner: HFBackend):
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[list[str], int]] = []
        self.responses: list[tuple[int, ...]] = []

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        self.calls.append(([r.sample_id for r in requests], seed))
        out = self.inner.generate(requests, decoding, seed)
        self.responses.extend(tuple(r.response_token_ids) for r in out)
        return out

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        return self.inner.sync_weights(model, version)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def setup(loaded_tiny, tiny_model_dir, make_config):
    model, _ = loaded_tiny

    def build(
        per_record: int, packing: bool = True, **extra: Any
    ) -> tuple[Any, PromptEncoder, Any, list[Any]]:
        cfg = make_config(
            {
                "custom": {
                    "trainer_variant": "stage2_ab_training",
                    "extra": {
                        "rollout_matching": {
                            "max_new_tokens": 8,
                            "rollouts_per_record": per_record,
                            "decoding": SAMPLING,
                        }
                    },
                },
                "stage2_ab": {"schedule": {"b_ratio": 1.0}, **extra},
                "training": {"per_device_train_batch_size": 1, "packing": packing},
            }
        )
        encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
        return (
            cfg,
            encoder,
            build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id]),
            load_records(cfg.data.train_jsonl),
        )

    yield model, build
    model.zero_grad(set_to_none=True)


def backend(model: Any, encoder: PromptEncoder) -> SeedRecordingBackend:
    return SeedRecordingBackend(
        HFBackend(
            model, encoder.tokenizer, eos_token_id=encoder.eos_token_id, pad_token_id=encoder.pad_token_id
        )
    )


def channel(
    model: Any, cfg: Any, encoder: Any, codec: Any, decode_batch: int | None
) -> RolloutSegmentProducer:
    return RolloutSegmentProducer(
        model,
        encoder,
        codec,
        cfg,
        backend(model, encoder),
        decoding=rollout_decoding(cfg),
        decode_batch_size=decode_batch,
    )


def test_each_record_brings_k_samples_with_their_own_seeds_and_segments(setup) -> None:
    model, build = setup
    cfg, encoder, codec, records = build(3)
    rollouts = channel(model, cfg, encoder, codec, decode_batch=2)
    out = rollouts.produce(records[:4], global_step=5)

    ids = [r.id for r in records[:4]]
    calls = rollouts.backend.calls
    # two calls of 2 records, each record's 3 requests together
    assert [c[0] for c in calls] == [
        [i for i in ids[:2] for _ in range(3)],
        [i for i in ids[2:] for _ in range(3)],
    ]
    # request k of record r samples with step_seed + r * K + k: the second call starts 2 * 3 later
    assert calls[1][1] - calls[0][1] == 6
    assert [s.sample_id for s in out.segments] == [i for i in ids for _ in range(3)]
    assert len(out.versions) == 12
    assert out.sums["rollout/count"] == 12 and out.sums["samples"] == 12
    # sampling: the 3 samples of a record are not all one rollout (random tiny model, 8 tokens each)
    responses = rollouts.backend.responses
    assert any(len(set(responses[3 * r : 3 * r + 3])) > 1 for r in range(4))


def test_samples_do_not_depend_on_the_decode_batch_size(setup) -> None:
    model, build = setup
    cfg, encoder, codec, records = build(2)
    whole, single = (channel(model, cfg, encoder, codec, decode_batch=size) for size in (None, 1))
    whole.produce(records[:3], global_step=1)
    single.produce(records[:3], global_step=1)
    assert len(whole.backend.calls) == 1 and len(single.backend.calls) == 3
    assert whole.backend.responses == single.backend.responses


def test_micro_mode_step_counts_every_rollout(setup, monkeypatch) -> None:
    model, build = setup
    cfg, encoder, codec, records = build(
        2, packing=False
    )  # padded: one batch per micro-batch, nothing carried
    recording = backend(model, encoder)
    monkeypatch.setattr(variants, "backend_for", lambda ctx: recording)
    ctx = BuildContext(
        run=cpu_run(cfg, gradient_accumulation_steps=2),
        model=model,
        encoder=encoder,
        codec=codec,
        collectives=LocalCollectives(),
    )
    plan = build_stage2(ctx).planner.plan([[r] for r in records[:2]], 0)
    assert plan.kind == "B"
    assert plan.sums["stage2_ab/rollouts"] == 4 and plan.sums["rollout/count"] == 4
    assert sum(len(c[0]) for c in recording.calls) == 4
    trained = sum(len(row["segment_lengths"]) for micro in plan.micro_steps for row in micro.rows)
    assert trained == 4


def test_step_mode_budget_counts_rollouts(setup, monkeypatch) -> None:
    model, build = setup
    cfg, encoder, codec, records = build(2, channel_b={"mode": "step", "rollouts_per_step": 6})
    recording = backend(model, encoder)
    monkeypatch.setattr(variants, "backend_for", lambda ctx: recording)
    ctx = BuildContext(
        run=cpu_run(cfg, gradient_accumulation_steps=1),
        model=model,
        encoder=encoder,
        codec=codec,
        collectives=LocalCollectives(),
        train_records=records,
    )
    plan = build_stage2(ctx).planner.plan([[records[0]]], 0)
    micro = plan.micro_steps[-1]
    for _ in micro.passes(0.0):
        pass
    sums = micro.local_sums()
    assert sums["stage2_ab/rollouts"] == 6 and sums["rollout/count"] == 6  # 3 records x 2 samples
    assert sum(len(c[0]) for c in recording.calls) == 6


@pytest.mark.parametrize("mode", ["micro", "step"])
def test_grpo_channel_b_rows_carry_advantages_and_behaviour_logprobs(setup, monkeypatch, mode: str) -> None:
    """stage2_ab_training with Channel-B = GRPO: the B rows carry per-token advantages (zero-sum within each
    record's group) and the behaviour log-probs; the step's normaliser counts the rollout tokens."""
    model, build = setup
    extra = {"channel_b": {"mode": "step", "rollouts_per_step": 4}} if mode == "step" else {}
    cfg, encoder, codec, records = build(2, packing=False, **extra)
    cfg.loss.objective = "grpo"
    recording = backend(model, encoder)
    monkeypatch.setattr(variants, "backend_for", lambda ctx: recording)
    ctx = BuildContext(
        run=cpu_run(cfg, gradient_accumulation_steps=2),
        model=model,
        encoder=encoder,
        codec=codec,
        collectives=LocalCollectives(),
        train_records=records,
    )
    plan = build_stage2(ctx).planner.plan([[r] for r in records[:2]], 0)
    batches = [batch for micro in plan.micro_steps for batch, _ in micro.passes(plan.total_weight)]
    sums = Counter(plan.sums)
    for micro in plan.micro_steps:
        sums.update(micro.local_sums())
    assert sums["grpo/rollouts"] == 4 and sums["grpo/groups"] == 2
    per_sample = []
    for batch in batches:
        assert {"advantages", "behaviour_logprobs"} <= set(batch)
        trained = batch["weights"] != 0
        assert bool((batch["behaviour_logprobs"][trained] < 0).all())
        for row in range(batch["weights"].shape[0]):
            values = batch["advantages"][row][trained[row]]
            assert bool((values == values[0]).all())  # one advantage per rollout
            per_sample.append(float(values[0]))
    assert len(per_sample) == 4
    assert per_sample[0] + per_sample[1] == pytest.approx(0.0, abs=1e-6)  # group-normalised: zero mean
    assert per_sample[2] + per_sample[3] == pytest.approx(0.0, abs=1e-6)
