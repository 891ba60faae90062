"""Pre-flight check of the row size, before the first optimizer step.

Owns :func:`check_row_sizing`: ``training.global_max_length`` is both the row capacity and the longest
allowed sample, so a record whose GT target (Channel-A / ``sft``) or whose prompt plus a full rollout
budget (Channel-B) cannot fit a row would otherwise stop training at the step that first meets it.
The check encodes the training records most likely to be the longest (largest images, most objects and
label text) and fails with one message naming the record and the knobs. Leaves out: the exact check of
every segment at the step that builds it (``packing.segment`` raises naming the sample).
"""

from __future__ import annotations

from collections.abc import Sequence

from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.detection.codec import ObjectCodec
from rollmatch.detection.targets import build_gt_target
from rollmatch.errors import ConfigError, ConfigProblem

_LENGTH_KEY = "training.global_max_length"
PROBED_RECORDS = 8


def largest_records(records: Sequence[Record], count: int, max_pixels: int) -> list[Record]:
    """The ``count`` records with the most image pixels (up to the processor's budget), then objects, then label text."""

    def size(record: Record) -> tuple[int, int, int]:
        pixels = min(record.width * record.height, max_pixels) * max(len(record.images), 1)
        return pixels, len(record.objects), sum(len(o.label) for o in record.objects)

    return sorted(records, key=size, reverse=True)[:count]


def check_row_sizing(
    cfg: RollmatchConfig, records: Sequence[Record], encoder: PromptEncoder, codec: ObjectCodec
) -> None:
    """Raise :class:`ConfigError` if the largest training records cannot fit a row (see the module docstring)."""
    limit = cfg.training.global_max_length
    probes = largest_records(records, PROBED_RECORDS, encoder.pixel_bounds[1])
    rolls_out = cfg.custom.trainer_variant != "sft"
    problems: list[ConfigProblem] = []
    for record in probes:
        encoded = encoder.encode(record)
        prompt = len(encoded.input_ids)
        target = build_gt_target(
            encoder.gt_objects(record, encoded),
            codec=codec,
            tokenizer=encoder.tokenizer,
            eos_token_id=encoder.eos_token_id,
            desc_weight=cfg.loss.desc_weight,
        )
        if prompt + len(target.token_ids) > limit:
            problems.append(
                ConfigProblem(
                    _LENGTH_KEY,
                    limit,
                    f"record {record.id!r} needs {prompt + len(target.token_ids)} tokens for its prompt ({prompt}) and "
                    f"GT target ({len(target.token_ids)}), more than a row holds: raise {_LENGTH_KEY}, lower "
                    "data.max_pixels, or drop the record",
                )
            )
        budget = cfg.rollout.max_new_tokens
        if rolls_out and prompt + budget + 1 > limit:
            problems.append(
                ConfigProblem(
                    _LENGTH_KEY,
                    limit,
                    f"record {record.id!r} has a {prompt}-token prompt: a rollout of custom.extra.rollout_matching."
                    f"max_new_tokens = {budget} tokens would not fit a row; raise {_LENGTH_KEY} to at least "
                    f"{prompt + budget + 1} or lower max_new_tokens",
                )
            )
        if problems:
            break  # the first record that does not fit says what to change
    if problems:
        raise ConfigError(problems)
