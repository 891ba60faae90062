"""Token lengths of every training record, without decoding an image or loading the model.

Owns: :func:`record_lengths` (prompt and GT-target tokens per record), :class:`LengthScan` (the
records that do not fit ``training.global_max_length``) and :func:`fitting_records` (what ``train``
keeps under ``data.over_length``). A record's prompt length is the chat template's text tokens plus
the image tokens the processor makes of an image of the record's ``width`` x ``height`` (measured once
per size with :func:`rollmatch.data.prompts.image_probe`); its target is the GT serialization in the
run's frame and object format plus EOS, tokenized as training tokenizes it. No image is opened, so
the whole set is scanned, not a sample of it (``tests/config/test_check_inputs.py`` checks the counts
against the full encoding).

Leaves out: checking the image files themselves (``rollmatch data validate``) and the exact check of
every packed segment (``packing.segment``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from rollmatch.config.schema import NoiseObjectsConfig, RollmatchConfig
from rollmatch.data.prompts import PromptEncoder, image_probe
from rollmatch.data.records import Record
from rollmatch.detection.codec import ObjectCodec
from rollmatch.detection.noise_objects import noise_rng, sample_noise_objects
from rollmatch.detection.objects import DetObject, canonical_order, frame_extent, to_frame
from rollmatch.detection.targets import build_gt_target
from rollmatch.errors import ConfigError, ConfigProblem

log = logging.getLogger(__name__)

LENGTH_KEY = "training.global_max_length"
NAMED = 5  # over-long records named in a message; the rest are counted


@dataclass(frozen=True)
class RecordLength:
    """Tokens one record needs: its prompt (template, text, image tokens) and its GT target (+ EOS)."""

    record_id: str
    prompt_tokens: int
    target_tokens: int


@dataclass
class LengthScan:
    """The records that do not fit a row: a GT target too long, or no room for a full rollout."""

    limit: int
    rollout_budget: int | None  # max_new_tokens when the variant rolls out, else None
    total: int = 0
    over: list[tuple[str, int]] = field(default_factory=list)  # (record id, tokens needed)

    def needed(self, length: RecordLength) -> int:
        """Tokens of the longest row this record can make: its target, or a full rollout."""
        rollout = length.prompt_tokens + self.rollout_budget + 1 if self.rollout_budget is not None else 0
        return max(length.prompt_tokens + length.target_tokens, rollout)

    def summary(self) -> str:
        named = ", ".join(f"{rid!r} ({tokens} tokens)" for rid, tokens in self.over[:NAMED])
        more = f" and {len(self.over) - NAMED} more" if len(self.over) > NAMED else ""
        budget = (
            f" or prompt + custom.extra.rollout_matching.max_new_tokens ({self.rollout_budget}) + 1"
            if self.rollout_budget is not None
            else ""
        )
        return (
            f"{len(self.over)} of {self.total} training records need more than {self.limit} tokens "
            f"(prompt + GT target{budget}): {named}{more}"
        )

    def problem(self) -> ConfigProblem:
        return ConfigProblem(
            LENGTH_KEY,
            self.limit,
            f"{self.summary()}; raise {LENGTH_KEY}, lower data.max_pixels"
            + (" or max_new_tokens" if self.rollout_budget is not None else "")
            + ", or set data.over_length: drop to train without them",
        )


def record_lengths(
    records: Sequence[Record],
    encoder: PromptEncoder,
    codec: ObjectCodec,
    *,
    desc_weight: float = 1.0,
    noise: NoiseObjectsConfig | None = None,
) -> Iterator[RecordLength]:
    """Prompt and target tokens of each record, in order (see the module docstring for how). With
    ``noise`` enabled the target holds the record's noise objects as drawn at step 0 (their number is
    fixed per record; with digit coordinates a later draw may differ by a few digits)."""
    sizes: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}
    texts: dict[str, int] = {}
    image_token_id = encoder.image_token_id
    for record in records:
        text = encoder.tokenizer.apply_chat_template(
            encoder.messages(record), tokenize=False, add_generation_prompt=True
        )
        if text not in texts:
            ids = encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
            texts[text] = len(ids) - sum(1 for i in ids if i == image_token_id)
        if record.image_size not in sizes:
            sizes[record.image_size] = image_probe(encoder.processor, record.image_size)
        frame_size, image_tokens = sizes[record.image_size]
        # Every image of a record has its size (docs/data.md); the prompt holds one run of tokens per image.
        prompt = texts[text] + image_tokens * len(record.images)
        objects = canonical_order(
            [
                DetObject(o.label, to_frame(o.bbox, record.image_size, encoder.coord_frame, frame_size))
                for o in record.objects
            ]
        )
        extra: list[DetObject] = []
        if noise is not None and noise.enabled:
            extent = frame_extent(encoder.coord_frame, frame_size)
            rng = noise_rng(noise.seed, record.id, 0)
            extra = sample_noise_objects(objects, extent, noise, rng, sample_id=record.id)
        target = build_gt_target(
            objects,
            codec=codec,
            tokenizer=encoder.tokenizer,
            eos_token_id=encoder.eos_token_id,
            desc_weight=desc_weight,
            noise=extra,
        )
        yield RecordLength(record.id, prompt, len(target.token_ids))


def scan_lengths(
    cfg: RollmatchConfig, records: Sequence[Record], encoder: PromptEncoder, codec: ObjectCodec
) -> LengthScan:
    """Every record that cannot fit one row of ``training.global_max_length`` tokens."""
    rolls_out = cfg.custom.trainer_variant != "sft"
    scan = LengthScan(cfg.training.global_max_length, cfg.rollout.max_new_tokens if rolls_out else None)
    for length in record_lengths(
        records, encoder, codec, desc_weight=cfg.loss.desc_weight, noise=cfg.loss.noise_objects
    ):
        scan.total += 1
        needed = scan.needed(length)
        if needed > scan.limit:
            scan.over.append((length.record_id, needed))
    return scan


def fitting_records(
    cfg: RollmatchConfig, records: Sequence[Record], encoder: PromptEncoder, codec: ObjectCodec
) -> list[Record]:
    """The records ``train`` uses: all of them, or (``data.over_length: drop``) those that fit a row.

    Raises :class:`ConfigError` naming the over-long records under ``data.over_length: error``, and
    when ``drop`` would leave nothing to train on.
    """
    scan = scan_lengths(cfg, records, encoder, codec)
    if not scan.over:
        return list(records)
    if cfg.data.over_length == "error":
        raise ConfigError([scan.problem()])
    dropped = {record_id for record_id, _ in scan.over}
    kept = [record for record in records if record.id not in dropped]
    if not kept:
        raise ConfigError([scan.problem()])
    log.warning("data.over_length: drop leaves out %s", scan.summary())
    return kept
