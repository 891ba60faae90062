"""``rollmatch eval``: roll out over a dataset and score the detections.

Owns: batching records through any rollout backend, strict parsing, matching at IoU 0.5
(precision / recall / F1), COCO-style mAP through pycocotools, and the predictions JSONL.
Rollouts carry no confidence, so for mAP each prediction is scored by its position in the
decoded list (earlier = higher); documented in docs/runbook.md.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder
from rollmatch.data.records import Record
from rollmatch.detection.codec import ObjectCodec, ParseResult
from rollmatch.detection.matching import hungarian_match
from rollmatch.detection.metrics import DetectionCounts, coco_map
from rollmatch.detection.objects import CoordFrame, DetObject, from_frame
from rollmatch.rollout.alignment import check_prompt_alignment
from rollmatch.rollout.types import Decoding, RolloutBackend


@dataclass
class EvalResult:
    num_samples: int
    precision: float
    recall: float
    f1: float
    mean_iou: float
    map: float
    map_50: float
    map_75: float
    truncated_frac: float
    invalid: dict[str, int]
    seconds: float
    predictions_path: str | None


def evaluate(
    backend: RolloutBackend,
    encoder: PromptEncoder,
    codec: ObjectCodec,
    records: Sequence[Record],
    *,
    decoding: Decoding,
    batch_size: int = 8,
    predictions_path: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
) -> EvalResult:
    """Roll out every record, parse strictly, match at IoU 0.5, compute P/R/F1 and COCO mAP."""
    start = time.perf_counter()
    counts = DetectionCounts()
    invalid: Counter[str] = Counter()
    truncated = 0
    scored_preds: list[list[tuple[DetObject, float]]] = []
    gts_all: list[list[DetObject]] = []
    lines: list[str] = []
    batches = range(0, len(records), batch_size)
    for offset in tqdm(batches, desc="eval", disable=not progress, unit="batch"):
        batch = records[offset : offset + batch_size]
        encoded = [encoder.encode(r) for r in batch]
        rollouts = backend.generate([e.to_request() for e in encoded], decoding, seed + offset)
        for record, enc, rollout in zip(batch, encoded, rollouts, strict=True):
            check_prompt_alignment(rollout, enc.input_ids, encoder.tokenizer)
            gts = encoder.gt_objects(record, enc)
            parse = codec.parse(
                rollout.response_token_ids,
                extent=encoder.frame_extent(enc),
                hit_max_tokens=rollout.hit_max_tokens,
            )
            match = hungarian_match(parse.objects, gts, iou_threshold=0.5)
            counts.add(match, len(parse.objects), len(gts))
            invalid.update(parse.invalid)
            truncated += int(parse.truncated)
            n = len(parse.objects)
            scored_preds.append([(obj, 1.0 - i / (n + 1)) for i, obj in enumerate(parse.objects)])
            gts_all.append(gts)
            lines.append(
                json.dumps(
                    prediction_line(record, enc, encoder.coord_frame, parse.objects, rollout.text, parse)
                )
            )
    labels = sorted({o.label for gts in gts_all for o in gts} | {o.label for p in scored_preds for o, _ in p})
    maps = coco_map(scored_preds, gts_all, labels) if records else {"map": 0.0, "map_50": 0.0, "map_75": 0.0}
    if predictions_path is not None:
        Path(predictions_path).parent.mkdir(parents=True, exist_ok=True)
        Path(predictions_path).write_text("".join(line + "\n" for line in lines))
    return EvalResult(
        num_samples=len(records),
        precision=counts.precision,
        recall=counts.recall,
        f1=counts.f1,
        mean_iou=counts.mean_iou,
        map=maps["map"],
        map_50=maps["map_50"],
        map_75=maps["map_75"],
        truncated_frac=truncated / len(records) if records else 0.0,
        invalid=dict(invalid),
        seconds=time.perf_counter() - start,
        predictions_path=str(predictions_path) if predictions_path is not None else None,
    )


def prediction_line(
    record: Record,
    encoded: EncodedPrompt,
    frame: CoordFrame,
    objects: list[DetObject],
    text: str,
    parse: ParseResult,
) -> dict:
    """One predictions-JSONL entry: boxes back in pixels of the original image."""
    frame_size = encoded.frame_sizes[0]
    return {
        "id": record.id,
        "objects": [
            {
                "label": o.label,
                "bbox": [round(v, 2) for v in from_frame(o.bbox, record.image_size, frame, frame_size)],
            }
            for o in objects
        ],
        "text": text,
        "truncated": parse.truncated,
        "invalid": parse.invalid,
    }


def eval_command(args: argparse.Namespace) -> int:
    from rollmatch.config.load import load_config
    from rollmatch.data.records import load_records

    overrides = [f"model.path={args.model}", *args.overrides]
    if args.backend:
        overrides.append(f"custom.extra.rollout_matching.rollout_backend={args.backend}")
    cfg = load_config(args.config, overrides)
    records = load_records(args.data, max_samples=args.max_samples)
    predictions_path = args.out or str(Path(args.model) / "predictions.jsonl")
    result = run_eval(cfg, records, predictions_path)
    print(json.dumps(asdict(result), indent=2))
    if args.pictures > 0:
        from rollmatch.viz import render_pictures

        pictures_dir = Path(predictions_path).parent / "pictures"
        render_pictures(
            records, predictions_path, pictures_dir, grid_size=args.pictures, max_images=args.pictures
        )
        print(f"pictures of the first {min(args.pictures, len(records))} images: {pictures_dir}")
    return 0


def run_eval(cfg: RollmatchConfig, records: Sequence[Record], predictions_path: str | None) -> EvalResult:
    """Evaluate ``cfg.model.path`` with the configured backend (HF or vLLM) on ``records``."""
    from rollmatch.collectives import LocalCollectives
    from rollmatch.detection.codec import build_codec
    from rollmatch.rollout.build import build_backend
    from rollmatch.training.channels import decoding_from_config
    from rollmatch.training.entry import load_pretrained

    encoder = PromptEncoder.from_pretrained(cfg.model.path, cfg.data)
    model = load_pretrained(cfg)  # an evaluated model dir has adapters merged already
    codec = build_codec(cfg.custom.object_format, encoder.tokenizer, [encoder.eos_token_id])
    backend = build_backend(
        cfg,
        model=model,
        tokenizer=encoder.tokenizer,
        model_dir=cfg.model.path,
        collectives=LocalCollectives(),
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
    )
    try:
        return evaluate(
            backend,
            encoder,
            codec,
            records,
            decoding=decoding_from_config(cfg, cfg.eval.max_new_tokens),
            batch_size=cfg.eval.batch_size,
            predictions_path=predictions_path,
            seed=cfg.training.seed,
        )
    finally:
        backend.close()
