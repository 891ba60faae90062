"""Segment producers: turn a batch of records into training segments.

Owns the two ways a sample becomes a teacher-forced segment:

- :class:`GTSegmentProducer` (stage-1 ``sft`` and Stage-2 Channel-A): prompt + the GT serialization + EOS.
- :class:`RolloutSegmentProducer` (``rollout_matching_sft`` and Channel-B): rollouts (no grad) in calls of
  ``decode_batch_size`` samples -> prompt alignment check -> strict parse -> Hungarian match ->
  ``prefix + FN tail + EOS`` (``loss.objective: grpo``: each rollout's own tokens with its group-normalised
  advantage and behaviour log-probs, ``training.grpo_targets``).

Both return segments plus metric sums (counts, not means) so callers can aggregate exactly across
micro-steps and ranks. Leaves out: rows (``training.rows``), when weights are synced and which
records a step uses (``training.step``, ``training.channel_modes``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder
from rollmatch.data.records import Record
from rollmatch.detection.codec import ObjectCodec
from rollmatch.detection.noise_objects import noise_rng, sample_noise_objects
from rollmatch.detection.objects import DetObject
from rollmatch.detection.scoring import score_response
from rollmatch.detection.targets import (
    TargetSequence,
    build_gt_target,
    build_matched_target,
    target_differs_from_sft,
)
from rollmatch.errors import BackendError
from rollmatch.packing.segment import Segment, build_segment
from rollmatch.rollout.alignment import check_prompt_alignment
from rollmatch.rollout.chunking import step_seed
from rollmatch.rollout.types import Decoding, Rollout, RolloutBackend
from rollmatch.training.grpo_targets import GrpoGroups, PolicyTokens
from rollmatch.training.rollout_log import RolloutLog
from rollmatch.training.schedule import fixed_size_chunks


@dataclass
class ChannelOutput:
    """Segments of one batch plus additive metric sums (aggregated by ``training.metric_summary``).

    ``versions``: for rollout segments, the weight version each one's rollout was generated under
    (as the backend reported it); empty for GT segments.
    """

    segments: list[Segment]
    sums: Counter[str] = field(default_factory=Counter)
    versions: list[int] = field(default_factory=list)

    def extend(self, other: ChannelOutput) -> None:
        self.segments.extend(other.segments)
        self.sums.update(other.sums)
        self.versions.extend(other.versions)


class _SegmentFactory:
    """Shared by both channels: prompt + response target -> :class:`Segment`."""

    def __init__(
        self, model: torch.nn.Module, encoder: PromptEncoder, codec: ObjectCodec, cfg: RollmatchConfig
    ):
        self.model = model
        self.encoder = encoder
        self.codec = codec
        self.cfg = cfg

    def segment(
        self,
        encoded: EncodedPrompt,
        target: TargetSequence,
        created_step: int,
        policy: PolicyTokens | None = None,
    ) -> Segment:
        return build_segment(
            self.model,
            sample_id=encoded.sample_id,
            prompt_ids=encoded.input_ids,
            response_ids=target.token_ids,
            response_weights=target.weights,
            pixel_values=encoded.pixel_values,
            image_grid_thw=encoded.image_grid_thw,
            prompt_mm_token_type_ids=encoded.mm_token_type_ids,
            max_length=self.cfg.training.global_max_length,
            created_step=created_step,
            response_unlikelihood_weights=target.unlikelihood_weights or None,
            response_advantages=None if policy is None else policy.advantages,
            response_behaviour_logprobs=None if policy is None else policy.behaviour_logprobs,
            behaviour_version=None if policy is None else policy.weight_version,
            normaliser=None if policy is None else policy.normaliser,
        )


class GTSegmentProducer(_SegmentFactory):
    """Teacher forcing on the GT serialization (no rollouts)."""

    def produce(self, records: Sequence[Record], global_step: int) -> ChannelOutput:
        out = ChannelOutput(segments=[])
        noise = self.cfg.loss.noise_objects
        for record in records:
            encoded = self.encoder.encode(record)
            gts = self.encoder.gt_objects(record, encoded)
            extra: list[DetObject] = []
            if noise.enabled:  # fresh noise each step, the same on a rerun (detection.noise_objects)
                rng = noise_rng(noise.seed, encoded.sample_id, global_step)
                extent = self.encoder.frame_extent(encoded)
                extra = sample_noise_objects(gts, extent, noise, rng, sample_id=encoded.sample_id)
            target = build_gt_target(
                gts,
                codec=self.codec,
                tokenizer=self.encoder.tokenizer,
                eos_token_id=self.encoder.eos_token_id,
                desc_weight=self.cfg.loss.desc_weight,
                noise=extra,
                noise_label_weight=noise.label_weight,
            )
            out.segments.append(self.segment(encoded, target, global_step))
            out.sums["samples"] += 1
            if noise.enabled:
                out.sums["target/noise_objects"] += len(extra)
        return out


class RolloutSegmentProducer(_SegmentFactory):
    """Rollout-matching: the model's own prefix plus the GT objects it missed.

    Records are rolled out in contiguous calls of ``decode_batch_size`` records (``None``: one call),
    independent of the learner's micro-batch. Each record brings ``K = rollouts_per_record`` requests
    (record ``i``'s sample ``k`` is request ``i * K + k``, so a record's samples stay together), each
    with its own segment. Request ``j`` of a call samples with ``call seed + j``, and the call starting at
    record ``r`` of a step is seeded ``step_seed(training seed, step) + r * K``: every sample of a step has
    its own seed, and a step's rollouts do not depend on the decode batch size.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        encoder: PromptEncoder,
        codec: ObjectCodec,
        cfg: RollmatchConfig,
        backend: RolloutBackend,
        *,
        decoding: Decoding,
        decode_batch_size: int | None = None,
        rollout_log: RolloutLog | None = None,
    ):
        super().__init__(model, encoder, codec, cfg)
        self.backend = backend
        self.rollout_log = (
            rollout_log  # remembers the rollout behind each segment (training.log_rollouts_every)
        )
        self.decoding = decoding  # the resolved run's rollout decoding
        self.decode_batch_size = decode_batch_size
        self.rollouts_per_record = cfg.rollout.rollouts_per_record
        # Rollout servers report failovers (``servers/*``); the other backends have no such sums.
        self._server_sums: Callable[[], Counter[str]] | None = getattr(backend, "take_server_sums", None)
        # The objective picks how a record's rollouts become targets, once.
        self._grpo = GrpoGroups(encoder, codec, cfg) if cfg.loss.objective == "grpo" else None

    def produce(self, records: Sequence[Record], global_step: int) -> ChannelOutput:
        """Every record of one step, decode batch by decode batch; segments in record order."""
        out = ChannelOutput(segments=[])
        size = self.decode_batch_size or max(len(records), 1)
        for start, end in fixed_size_chunks(len(records), size):
            out.extend(self.produce_chunk(records[start:end], global_step, start))
        return out

    def produce_chunk(self, records: Sequence[Record], global_step: int, start: int) -> ChannelOutput:
        """One rollout call: the chunk of step ``global_step`` that starts at record ``start``."""
        seed = step_seed(self.cfg.training.seed, global_step) + start * self.rollouts_per_record
        return self.roll_out(records, seed=seed, created_step=global_step)

    def roll_out(self, records: Sequence[Record], *, seed: int, created_step: int) -> ChannelOutput:
        """One backend call for ``records`` (K requests each; request ``j`` samples with ``seed + j``),
        then a segment per rollout, in request order (record by record, sample by sample)."""
        encoded = [self.encoder.encode(r) for r in records]
        per_record = self.rollouts_per_record
        requests = [e.to_request() for e in encoded for _ in range(per_record)]
        start = time.perf_counter()
        rollouts = self.backend.generate(requests, self.decoding, seed)
        seconds = time.perf_counter() - start
        if len(rollouts) != len(requests):
            raise BackendError(
                f"the {self.backend.name} rollout backend returned {len(rollouts)} rollouts for {len(requests)} "
                f"requests ({len(records)} records x rollouts_per_record {per_record})"
            )
        out = ChannelOutput(segments=[])
        out.sums["rollout/seconds"] += seconds
        if self._server_sums is not None:
            out.sums.update(self._server_sums())
        groups = [
            (record, enc, rollouts[index * per_record : (index + 1) * per_record])
            for index, (record, enc) in enumerate(zip(records, encoded, strict=True))
        ]
        for _, enc, group in groups:
            for rollout in group:
                check_prompt_alignment(rollout, enc.input_ids, self.encoder.tokenizer)
        for (_, enc, group), targets in zip(groups, self.call_targets(groups), strict=True):
            for target, sums, policy in targets:
                out.sums.update(sums)
                out.segments.append(self.segment(enc, target, created_step, policy))
            out.versions.extend(rollout.weight_version for rollout in group)
        if self.rollout_log is not None:
            self.rollout_log.rolled_out(records, encoded, rollouts, out.segments)
        return out

    def call_targets(
        self, groups: Sequence[tuple[Record, EncodedPrompt, Sequence[Rollout]]]
    ) -> list[list[tuple[TargetSequence, Counter[str], PolicyTokens | None]]]:
        """The targets of one rollout call's records, K rollouts each: rollout matching builds each
        rollout's own target; GRPO rewards the groups and keeps each rollout's tokens with its advantage."""
        if self._grpo is not None:
            return [list(targets) for targets in self._grpo.targets_of_groups(groups)]
        return [
            [(*self.rollout_target(record, encoded, rollout), None) for rollout in group]
            for record, encoded, group in groups
        ]

    def rollout_target(
        self, record: Record, encoded: EncodedPrompt, rollout: Rollout
    ) -> tuple[TargetSequence, Counter[str]]:
        """Parse, match and build ``Y_train`` for one rollout; returns the target and metric sums."""
        scored = score_response(
            self.codec,
            rollout.response_token_ids,
            self.encoder.gt_objects(record, encoded),
            extent=self.encoder.frame_extent(encoded),
            hit_max_tokens=rollout.hit_max_tokens,
            matching=self.cfg.matching,
            ignore_regions=self.encoder.ignore_regions(record, encoded),
        )
        target = build_matched_target(
            scored.parse,
            scored.gt_objects,
            scored.match,
            codec=self.codec,
            tokenizer=self.encoder.tokenizer,
            eos_token_id=self.encoder.eos_token_id,
            loss=self.cfg.loss,
        )
        sums: Counter[str] = Counter(scored.counts().to_sums())
        sums.update(
            {
                "samples": 1,
                "rollout/count": 1,
                "rollout/tokens": len(rollout.response_token_ids),
                # the rollout taught something stage-1 SFT would not (another order, another prefix)
                "target/differs_from_sft": int(self._differs_from_sft(target, scored.gt_objects)),
                "target/dropped_elements": target.dropped_elements,
                "target/unlikelihood_tokens": sum(1 for u in target.unlikelihood_weights if u > 0),
                # a target longer than the rollout budget teaches answers that can never finish
                "target/over_max_new_tokens": int(len(target.token_ids) > self.decoding.max_new_tokens),
                "rollout/weight_version_sum": rollout.weight_version,
            }
        )
        return target, sums

    def _differs_from_sft(self, target: TargetSequence, gt_objects: Sequence[DetObject]) -> bool:
        """Does ``target`` hold another token-id sequence than the SFT target of the same GT? Weights
        alone do not count: a target whose ids are SFT's teaches nothing SFT's states do not hold."""
        return target_differs_from_sft(target, gt_objects, self.codec, self.encoder.tokenizer)
