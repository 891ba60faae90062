"""``rollmatch diagnose``: what own-rollout training could teach a checkpoint, measured without training.

Owns: one greedy rollout per record of a split, then

- **targets vs SFT** (:mod:`rollmatch.detection.target_diffs`): per rollout-matching target, the share
  of rollouts whose target holds other token ids than SFT's and the share of differing positions;
  for reordered GT, the share of its differing targets that differ only by an appended miss;
- **prefix sensitivity** (:func:`prefix_probe`): for each ``k``, continue greedily from the GT prefix
  of ``k`` objects (the teacher-forced state SFT trains on) and from the model's own greedy prefix of
  ``k`` elements (its state at inference), and compare the recall of the objects not yet found. A gap
  is exposure bias: the model does worse after its own prefix than after the GT's.

Leaves out: training, and the decoding settings (always greedy: the probe compares the model's mode
from two states). The JSON it prints is described in docs/detection.md, "Diagnostics".
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rollmatch.config.schema import MatchingConfig, RollmatchConfig
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder
from rollmatch.data.records import Record
from rollmatch.data.requests import RolloutRequest
from rollmatch.detection.codec import ObjectCodec, ParseResult, decode_with_offsets
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.objects import DetObject, canonical_order
from rollmatch.detection.scoring import ScoreCounts, ScoredResponse, score_response
from rollmatch.detection.target_diffs import TargetDiffTotals, target_diff
from rollmatch.evaluation import command_config, load_for_eval
from rollmatch.rollout.alignment import check_prompt_alignment
from rollmatch.rollout.types import Decoding, RolloutBackend

DEFAULT_PREFIX_KS = (1, 2)


@dataclass
class ProbeTotals:
    """Sums of the prefix probe at one ``k`` (records with more than ``k`` GT objects and at least
    ``k`` complete elements in their own rollout)."""

    records: int = 0
    remaining_after_gt: int = 0  # GT objects left after the GT prefix
    found_after_gt: int = 0
    # the model's own prefix, split by whether it was all right (k matched elements) or held a mistake
    remaining_after_own: dict[str, int] = field(default_factory=lambda: {"clean": 0, "mistake": 0})
    found_after_own: dict[str, int] = field(default_factory=lambda: {"clean": 0, "mistake": 0})
    records_own: dict[str, int] = field(default_factory=lambda: {"clean": 0, "mistake": 0})

    def summary(self) -> dict[str, Any]:
        own_remaining = sum(self.remaining_after_own.values())
        own_found = sum(self.found_after_own.values())
        after_gt = _rate(self.found_after_gt, self.remaining_after_gt)
        after_own = _rate(own_found, own_remaining)
        return {
            "records": self.records,
            "recall_after_gt_prefix": after_gt,
            "recall_after_own_prefix": after_own,
            "exposure_gap": round(after_gt - after_own, 4),
            **{
                f"own_prefix_{kind}": {
                    "records": self.records_own[kind],
                    "recall_after_own_prefix": _rate(
                        self.found_after_own[kind], self.remaining_after_own[kind]
                    ),
                }
                for kind in ("clean", "mistake")
            },
        }


def diagnose(
    backend: RolloutBackend,
    encoder: PromptEncoder,
    codec: ObjectCodec,
    records: Sequence[Record],
    *,
    max_new_tokens: int,
    matching: MatchingConfig,
    prefix_ks: Sequence[int] = DEFAULT_PREFIX_KS,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy rollouts of ``records``, the target differences and the prefix probe (see the module)."""
    decoding = Decoding(temperature=0.0, max_new_tokens=max_new_tokens)
    counts = ScoreCounts()
    diffs = TargetDiffTotals()
    probes = {k: ProbeTotals() for k in prefix_ks}
    for offset in tqdm(range(0, len(records), batch_size), desc="diagnose", disable=not progress):
        batch = list(records[offset : offset + batch_size])
        encoded = [encoder.encode(r) for r in batch]
        scored = _roll_out(backend, encoder, codec, batch, encoded, decoding, matching, offset)
        for item in scored:
            counts.add(item)
            diffs.add(
                target_diff(
                    item.parse,
                    item.gt_objects,
                    item.match,
                    codec=codec,
                    tokenizer=encoder.tokenizer,
                    eos_token_id=encoder.eos_token_id,
                )
            )
        for k, totals in probes.items():
            prefix_probe(
                backend, encoder, codec, batch, encoded, scored, k, decoding, matching, totals, offset
            )
    detection = counts.detection
    return {
        "records": len(records),
        "decoding": "greedy",
        "matching": {"iou_threshold": matching.iou_threshold, "label_mode": matching.label_mode},
        "rollouts": {
            "precision": round(detection.precision, 4),
            "recall": round(detection.recall, 4),
            "f1": round(detection.f1, 4),
            "truncated_frac": round(counts.parsing.truncated_frac, 4),
        },
        "targets_vs_sft": diffs.summary(),
        "prefix_probe": {str(k): totals.summary() for k, totals in probes.items()},
    }


def prefix_probe(
    backend: RolloutBackend,
    encoder: PromptEncoder,
    codec: ObjectCodec,
    records: Sequence[Record],
    encoded: Sequence[EncodedPrompt],
    scored: Sequence[ScoredResponse],
    k: int,
    decoding: Decoding,
    matching: MatchingConfig,
    totals: ProbeTotals,
    seed: int,
) -> None:
    """Add one batch's prefix probe at ``k`` to ``totals``.

    Own prefix: the greedy rollout's first ``k`` complete elements; greedy decoding continues them
    exactly as the rollout did, so its remaining elements are the continuation (no second call). The
    GT it found is matched on those ``k`` elements; the rest of the GT is what is left to find. GT
    prefix: the SFT target's token ids up to (not including) the token that closes the ``k``-th
    canonical GT object, so the model itself chooses between going on and stopping; continued
    greedily with the token budget the prefix leaves. Either way recall counts the later predictions matched to what is left.
    """
    chosen = [i for i, item in enumerate(scored) if len(item.gt_objects) > k and item.parse.num_complete >= k]
    if not chosen:
        return
    prefixes = {i: gt_prefix_ids(codec, encoder.tokenizer, scored[i].gt_objects, k) for i in chosen}
    requests = {i: _continued_request(encoded[i], prefixes[i]) for i in chosen}
    continued = {}
    # one call per prefix length: the continuation gets the budget the prefix left, as the own one did
    for length in sorted({len(ids) for ids in prefixes.values()}):
        group = [i for i in chosen if len(prefixes[i]) == length]
        budget = replace(decoding, max_new_tokens=max(decoding.max_new_tokens - length, 1))
        continued.update(
            zip(group, backend.generate([requests[i] for i in group], budget, seed), strict=True)
        )
    for i in chosen:
        request, prefix, rollout = requests[i], prefixes[i], continued[i]
        check_prompt_alignment(rollout, request.prompt_token_ids, encoder.tokenizer)
        item = scored[i]
        gts = canonical_order(item.gt_objects)
        parse = codec.parse(
            prefix + list(rollout.response_token_ids),
            extent=encoder.frame_extent(encoded[i]),
            hit_max_tokens=rollout.hit_max_tokens,
        )
        totals.records += 1
        remaining, found = _recall_after(parse, k, gts[k:], matching)
        totals.remaining_after_gt += remaining
        totals.found_after_gt += found
        own_first = _objects_in(item.parse, k)
        first_match = hungarian_match(item.parse.objects[:own_first], gts, **matching.model_dump())
        left = [gts[g] for g in first_match.fn]
        kind = "clean" if len(first_match.pairs) == k else "mistake"
        remaining, found = _recall_after(item.parse, k, left, matching)
        totals.records_own[kind] += 1
        totals.remaining_after_own[kind] += remaining
        totals.found_after_own[kind] += found


def gt_prefix_ids(codec: ObjectCodec, tokenizer: Any, gts: Sequence[DetObject], k: int) -> list[int]:
    """SFT's token ids of ``gts`` (canonical) up to, not including, the token holding the ``k``-th
    object's closing ``}``."""
    ordered = canonical_order(gts)
    text = codec.serialize_in_order(ordered)
    close = len(codec.serialize_in_order(ordered[:k])) - 2  # the k-th element's "}"
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    spans = decode_with_offsets(tokenizer, ids).token_spans()
    return ids[: next(i for i, (start, stop) in enumerate(spans) if start <= close < stop)]


def _recall_after(
    parse: ParseResult, k: int, remaining: Sequence[DetObject], matching: MatchingConfig
) -> tuple[int, int]:
    """``(objects left to find, how many of them the predictions after the k-th element match)``."""
    later = parse.objects[_objects_in(parse, k) :]
    match = hungarian_match(later, list(remaining), **matching.model_dump())
    return len(remaining), len(match.pairs)


def _objects_in(parse: ParseResult, elements: int) -> int:
    return sum(parse.element_valid[:elements])


def _continued_request(encoded: EncodedPrompt, response_prefix: Sequence[int]) -> RolloutRequest:
    """The prompt with a response already begun: its ids are the prompt's plus ``response_prefix``."""
    request = encoded.to_request()
    request.prompt_token_ids = [*request.prompt_token_ids, *response_prefix]
    if request.mm_token_type_ids is not None:
        request.mm_token_type_ids = [*request.mm_token_type_ids, *([0] * len(response_prefix))]
    return request


def _roll_out(
    backend: RolloutBackend,
    encoder: PromptEncoder,
    codec: ObjectCodec,
    records: Sequence[Record],
    encoded: Sequence[EncodedPrompt],
    decoding: Decoding,
    matching: MatchingConfig,
    seed: int,
) -> list[ScoredResponse]:
    rollouts = backend.generate([e.to_request() for e in encoded], decoding, seed)
    scored = []
    for record, enc, rollout in zip(records, encoded, rollouts, strict=True):
        check_prompt_alignment(rollout, enc.input_ids, encoder.tokenizer)
        scored.append(
            score_response(
                codec,
                rollout.response_token_ids,
                encoder.gt_objects(record, enc),
                extent=encoder.frame_extent(enc),
                hit_max_tokens=rollout.hit_max_tokens,
                matching=matching,
                ignore_regions=encoder.ignore_regions(record, enc),
            )
        )
    return scored


def run_diagnose(cfg: RollmatchConfig, records: Sequence[Record], prefix_ks: Sequence[int]) -> dict[str, Any]:
    """:func:`diagnose` on ``cfg.model.path`` with the configured backend, ``eval.*`` matching and budget."""
    setup = load_for_eval(cfg)
    backend = setup.backend
    budget = setup.run.eval_decoding.max_new_tokens  # eval.max_new_tokens, null: the rollouts' budget
    try:
        result = diagnose(
            backend,
            setup.encoder,
            setup.codec,
            records,
            max_new_tokens=budget,
            matching=cfg.eval.matching,
            prefix_ks=prefix_ks,
            batch_size=cfg.eval.batch_size,
        )
    finally:
        backend.close()
    return {
        "model": cfg.model.path,
        "object_format": cfg.custom.object_format,
        "max_new_tokens": budget,
        **result,
    }


def diagnose_command(args: argparse.Namespace) -> int:
    from rollmatch.data.records import load_records

    cfg = command_config("diagnose", args)
    records = load_records(args.data, max_samples=args.max_samples)
    result = {"data": str(args.data), **run_diagnose(cfg, records, args.prefix_k)}
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _rate(count: int, total: int) -> float:
    return round(count / total, 4) if total else 0.0
