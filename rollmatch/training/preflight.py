"""Preflight: does the start model answer in the run's format before rollout training spends on it?

A Qwen-VL Instruct checkpoint answers a grounding prompt in a ```` ```json ```` fence (strictly: not a
list) with its own words for the classes ("sofa" for "couch"). Rollout training from such a model
gets GT-only targets (Channel-B) and reward 0 (GRPO) until something else retrains the format, so the
run should start from a stage-1 model. Before a run other than ``sft`` trains, rank 0 rolls out
``preflight.records`` training records greedily with the start model and stops the run, with the
report, when fewer than ``preflight.min_valid_fraction`` of them are valid. ``rollmatch preflight
CONFIG`` prints the same report without training.

Owns: :func:`classify_response` (one rollout -> the reasons it is not usable), :class:`PreflightReport`,
:func:`run_preflight`, the training hook and the command. Leaves out: parsing (``detection.codec``),
rolling out (``rollout/``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from rollmatch.detection.codec import ELEMENT_REASONS, LIST_REASONS, ObjectCodec, ParseResult
from rollmatch.detection.targets import build_gt_target
from rollmatch.errors import ConfigError, ConfigProblem

if TYPE_CHECKING:
    from rollmatch.config.decoding import Decoding
    from rollmatch.config.schema import RollmatchConfig, RolloutMatchingConfig
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.records import Record
    from rollmatch.rollout.types import RolloutBackend
    from rollmatch.training.variants import BuildContext

log = logging.getLogger(__name__)

# Why a rollout is not usable, in the order a report lists them, with what usually fixes it.
REASONS: dict[str, str] = {
    "fenced_json": "the answer is wrapped in a ```json fence (Instruct style): train stage-1 SFT on the "
    "project's format first (configs/recipes/, docs/runbook.md)",
    "not_a_list": "the answer does not start with a JSON list: train stage-1 SFT on the project's format",
    "bad_structure": "the list is malformed (junk between elements, text after it)",
    "bad_box": "an element has bad keys or coordinates (out of the frame, degenerate, not integers): check "
    "data.coord_frame matches what the model was trained in",
    "unknown_label": "a label outside the run's class list (synonyms): put the list in the prompt "
    "({labels} in data.prompt, data.labels) and train stage-1 with it",
    "truncated": "the answer hit max_new_tokens or stopped inside the list: raise "
    "custom.extra.rollout_matching.max_new_tokens",
    "over_long": "the record's prompt plus GT answer exceed training.global_max_length",
}
_BAD_STRUCTURE = tuple(r for r in LIST_REASONS if r != "not_a_list")


def classify_response(
    parse: ParseResult, vocabulary: frozenset[str] | None, *, over_long: bool = False
) -> list[str]:
    """The reasons (keys of :data:`REASONS`) one rollout is not usable; [] when it is valid."""
    reasons: list[str] = []
    text = parse.response_text.lstrip()
    if text.startswith("```"):
        reasons.append("fenced_json")
    elif parse.invalid.get("not_a_list"):
        reasons.append("not_a_list")
    if any(parse.invalid.get(r) for r in _BAD_STRUCTURE):
        reasons.append("bad_structure")
    if any(parse.invalid.get(r) for r in ELEMENT_REASONS):
        reasons.append("bad_box")
    labels = [obj.label for obj in parse.objects] + fenced_labels(parse.response_text)
    if vocabulary is not None and any(label not in vocabulary for label in labels):
        reasons.append("unknown_label")
    if parse.truncated:
        reasons.append("truncated")
    if over_long:
        reasons.append("over_long")
    return reasons


_FENCE = re.compile(r"^\s*```[A-Za-z]*\s*(.*?)\s*(?:```|$)", re.S)


def fenced_labels(text: str) -> list[str]:
    """The ``label`` values of a JSON list inside a ```` ``` ```` fence (what an Instruct model writes),
    so a fenced answer's labels are checked too; [] when the text is not a fenced JSON list."""
    match = _FENCE.match(text)
    if match is None:
        return []
    try:
        items = json.loads(match.group(1))
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    return [str(item["label"]) for item in items if isinstance(item, dict) and "label" in item]


@dataclass
class PreflightReport:
    """How many of the rolled-out records gave a usable answer, and why the others did not."""

    records: int
    valid: int
    min_valid_fraction: float
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> records with it
    examples: dict[str, dict[str, str]] = field(default_factory=dict)  # reason -> first record id, answer

    @property
    def valid_fraction(self) -> float:
        return self.valid / self.records if self.records else 1.0

    @property
    def passed(self) -> bool:
        return self.valid_fraction >= self.min_valid_fraction

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "valid_fraction": self.valid_fraction, "passed": self.passed}

    def summary(self) -> str:
        """The report as lines a user reads: the fraction, then each reason with its fix and an example."""
        verdict = "passed" if self.passed else "FAILED"
        lines = [
            f"preflight {verdict}: {self.valid} of {self.records} rollouts valid ({self.valid_fraction:.0%}; "
            f"preflight.min_valid_fraction {self.min_valid_fraction})"
        ]
        for reason in REASONS:
            if reason in self.reasons:
                example = self.examples[reason]
                lines.append(
                    f"  {reason}: {self.reasons[reason]} records; {REASONS[reason]}. e.g. record "
                    f"{example['record']!r}: {example['answer']!r}"
                )
        return "\n".join(lines)


def run_preflight(
    backend: RolloutBackend,
    encoder: PromptEncoder,
    codec: ObjectCodec,
    records: Sequence[Record],
    *,
    decoding: Decoding,
    max_length: int,
    min_valid_fraction: float,
    batch_size: int = 8,
    seed: int = 0,
) -> PreflightReport:
    """Roll ``records`` out with ``backend`` and classify each answer (:func:`classify_response`)."""
    vocabulary = frozenset(encoder.labels.names) if encoder.labels is not None else None
    report = PreflightReport(records=len(records), valid=0, min_valid_fraction=min_valid_fraction)
    for offset in range(0, len(records), batch_size):
        batch = records[offset : offset + batch_size]
        encoded = [encoder.encode(r) for r in batch]
        rollouts = backend.generate([e.to_request() for e in encoded], decoding, seed + offset)
        for record, enc, rollout in zip(batch, encoded, rollouts, strict=True):
            parse = codec.parse(
                rollout.response_token_ids,
                extent=encoder.frame_extent(enc),
                hit_max_tokens=rollout.hit_max_tokens,
            )
            target = build_gt_target(
                encoder.gt_objects(record, enc),
                codec=codec,
                tokenizer=encoder.tokenizer,
                eos_token_id=encoder.eos_token_id,
                desc_weight=1.0,
            )
            over_long = len(enc.input_ids) + len(target.token_ids) > max_length
            reasons = classify_response(parse, vocabulary, over_long=over_long)
            report.valid += not reasons
            for reason in reasons:
                report.reasons[reason] = report.reasons.get(reason, 0) + 1
                report.examples.setdefault(reason, {"record": record.id, "answer": rollout.text[:200]})
    return report


def preflight_decoding(rollout: RolloutMatchingConfig, eval_decoding: Decoding) -> Decoding:
    """Greedy (``eval.decoding``) with the rollouts' answer budget: what the start model answers at best."""
    return replace(eval_decoding, max_new_tokens=rollout.max_new_tokens)


def preflight_before_training(ctx: BuildContext, records: Sequence[Record]) -> None:
    """Rank 0 checks the start model on the first ``preflight.records`` records with the training model
    itself (HF generate, before DDP / DeepSpeed wrap it: no other rank takes part, whatever the rollout
    backend); every rank stops with the report when it fails. A model still on the CPU (DeepSpeed
    places it later) is moved to this rank's GPU first, as training would."""
    import torch

    from rollmatch.rollout.hf import HFBackend

    cfg = ctx.cfg
    failure: str | None = None
    if ctx.collectives.is_main:
        if torch.cuda.is_available() and next(ctx.model.parameters()).device.type == "cpu":
            ctx.model.to(torch.device("cuda", torch.cuda.current_device()))
        backend = HFBackend(
            ctx.model,
            ctx.encoder.tokenizer,
            eos_token_id=ctx.encoder.eos_token_id,
            pad_token_id=ctx.encoder.pad_token_id,
            batch_size=cfg.eval.batch_size,
        )
        report = run_preflight(
            backend,
            ctx.encoder,
            ctx.codec,
            records[: cfg.preflight.records],
            decoding=preflight_decoding(cfg.rollout, ctx.run.eval_decoding),
            max_length=cfg.training.global_max_length,
            min_valid_fraction=cfg.preflight.min_valid_fraction,
            batch_size=cfg.eval.batch_size,
            seed=cfg.training.seed,
        )
        log.info("%s", report.summary())
        failure = None if report.passed else report.summary()
    failure = ctx.collectives.broadcast_object(failure, "preflight: rank 0's verdict")
    if failure is not None:
        raise ConfigError([preflight_problem(cfg, failure)])


def preflight_problem(cfg: RollmatchConfig, summary: str) -> ConfigProblem:
    return ConfigProblem(
        "preflight.min_valid_fraction",
        cfg.preflight.min_valid_fraction,
        f"the start model ({cfg.model.path}) is not ready for rollout training:\n{summary}\n"
        "Start from a stage-1 model, or lower preflight.min_valid_fraction (0: never stop) to train anyway",
    )


def preflight_command(args: argparse.Namespace) -> int:
    """``rollmatch preflight CONFIG [overrides]``: the report as JSON on stdout, its summary on stderr;
    exit 0 when it passes, 1 when it fails."""
    from rollmatch.config.load import load_config
    from rollmatch.data.records import load_records
    from rollmatch.evaluation import load_for_eval

    cfg = load_config(args.config, args.overrides)  # exactly what `train` would check: no saved settings
    records = load_records(cfg.data.train_jsonl, max_samples=cfg.data.max_samples)[
        : args.records or cfg.preflight.records
    ]
    if not records:
        raise ConfigError([ConfigProblem("preflight.records", 0, "roll out at least one record")])
    setup = load_for_eval(cfg)
    try:
        report = run_preflight(
            setup.backend,
            setup.encoder,
            setup.codec,
            records,
            decoding=preflight_decoding(cfg.rollout, setup.run.eval_decoding),
            max_length=cfg.training.global_max_length,
            min_valid_fraction=cfg.preflight.min_valid_fraction,
            batch_size=cfg.eval.batch_size,
            seed=cfg.training.seed,
        )
    finally:
        setup.backend.close()
    print(json.dumps(report.as_dict(), indent=2))
    print(report.summary(), file=sys.stderr)
    return 0 if report.passed else 1
