"""``rollmatch eval``: roll out over a dataset and score the detections.

Owns: batching records through any rollout backend, scoring each response through the one
scoring path of training (``detection.scoring``: strict parse + matching with ``cfg.eval.matching``,
the evaluation's own settings whatever the run trained with; precision / recall / F1, exact-count
accuracy, duplicates, recall by GT count, and the count-regulation and order metrics of
``detection.count_metrics``), COCO-style mAP through pycocotools, and the predictions JSONL.
Answers decode with ``eval.decoding`` (default greedy), never the rollout decoding; the result
records it. Rollouts carry no confidence, so mAP is reported twice: ``map_position_scored`` (each
prediction scored by its position in the decoded list, earlier = higher; also under the older name
``map``) and ``map_uniform_score`` (every box 1.0, as lmms-eval and published VLM detection numbers
score); documented in docs/runbook.md.

Without ``--config`` the engine settings are picked for this machine
(:func:`rollmatch.rollout.build.machine_overrides`) and printed; with a config they are the
config's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rollmatch.config.resolved import ResolvedRun
from rollmatch.config.schema import (
    DEFAULT_COUNT_BUCKETS,
    ROLLOUT_KEY,
    DecodingConfig,
    MatchingConfig,
    RollmatchConfig,
)
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder
from rollmatch.data.records import Record
from rollmatch.detection.codec import ObjectCodec, ParseResult
from rollmatch.detection.metrics import coco_map
from rollmatch.detection.noise_objects import noise_label_of
from rollmatch.detection.objects import CoordFrame, DetObject, from_frame
from rollmatch.detection.scoring import ScoreCounts, score_response
from rollmatch.errors import ConfigError, ConfigProblem, DataError
from rollmatch.rollout.alignment import check_prompt_alignment
from rollmatch.rollout.types import Decoding, RolloutBackend


@dataclass
class EvalResult:
    num_samples: int
    decoding: dict[str, float | int]  # the decoding that produced the scored answers (eval.decoding)
    iou_threshold: float  # the matching the numbers below were scored with (eval.matching)
    label_mode: str
    precision: float
    recall: float
    f1: float
    mean_iou: float
    map: float  # = map_position_scored (the name kept from before both scorings were reported)
    map_50: float
    map_75: float
    map_position_scored: float  # COCO mAP, each box scored by its list position (earlier = higher)
    map_50_position_scored: float
    map_75_position_scored: float
    map_uniform_score: float  # COCO mAP, every box scored 1.0 (as lmms-eval and VLM detection papers)
    map_50_uniform_score: float
    map_75_uniform_score: float
    truncated_frac: float
    invalid: dict[str, int]
    unknown_labels: int | None  # valid predictions whose label is not in the run's class list (None: no list)
    objects_per_image: float  # valid predicted objects (noise objects not counted)
    noise_label: str | None  # answers' objects with this label were dropped before scoring (eval.noise_label)
    noise_objects_per_image: float  # valid objects with the noise label, dropped
    fp_per_image: float
    ignored_predictions: int  # predictions on a record's ignore (crowd) regions: neither TP nor FP
    exact_count_acc: float  # answers with exactly as many valid objects as GT objects
    duplicate_rate: float  # per valid object: same label and IoU >= 0.7 with an earlier object
    duplicate_rate_any_label: float
    recall_by_gt_count: dict[str, float]  # images with n GT objects -> their recall
    count_error: float  # mean signed (valid predicted - GT objects) per image
    count_mae: float
    recall_first_third: float  # recall of the GT objects in the first third of the canonical list
    recall_middle_third: float
    recall_last_third: float  # weak when answers stop early
    kendall_tau: float  # matched predictions' order vs canonical order, mean over images with >= 2 matched
    count_buckets: list[int]  # lower edges of the GT-count buckets below (eval.count_buckets)
    gt_count_buckets: dict[str, dict[str, float]]  # bucket -> images, precision, recall, f1
    seconds: float
    predictions_path: str | None


def evaluate(
    backend: RolloutBackend,
    encoder: PromptEncoder,
    codec: ObjectCodec,
    records: Sequence[Record],
    *,
    decoding: Decoding,
    matching: MatchingConfig | None = None,
    batch_size: int = 8,
    count_buckets: Sequence[int] = DEFAULT_COUNT_BUCKETS,
    predictions_path: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    noise_label: str | None = None,
) -> EvalResult:
    """Roll out every record, score it like training does (``matching``, default
    ``MatchingConfig()``), compute P/R/F1 and COCO mAP. Request ``i`` is seeded ``seed + i``. Objects
    labelled ``noise_label`` (``eval.noise_label``) are dropped before matching, from the scores and the
    predictions file alike, and counted in ``noise_objects_per_image``."""
    start = time.perf_counter()
    matching = matching if matching is not None else MatchingConfig()
    counts = ScoreCounts()
    scored_preds: list[list[tuple[DetObject, float]]] = []
    gts_all: list[list[DetObject]] = []
    crowds_all: list[list[DetObject]] = []  # ignore regions: a prediction there is no false positive
    lines: list[str] = []
    vocabulary = set(encoder.labels.names) if encoder.labels is not None else None
    unknown_labels = 0
    batches = range(0, len(records), batch_size)
    for offset in tqdm(batches, desc="eval", disable=not progress, unit="batch"):
        batch = records[offset : offset + batch_size]
        encoded = [encoder.encode(r) for r in batch]
        rollouts = backend.generate([e.to_request() for e in encoded], decoding, seed + offset)
        for record, enc, rollout in zip(batch, encoded, rollouts, strict=True):
            check_prompt_alignment(rollout, enc.input_ids, encoder.tokenizer)
            crowds = encoder.ignore_regions(record, enc)
            crowds_all.append(crowds)
            scored = score_response(
                codec,
                rollout.response_token_ids,
                encoder.gt_objects(record, enc),
                extent=encoder.frame_extent(enc),
                hit_max_tokens=rollout.hit_max_tokens,
                matching=matching,
                ignore_regions=crowds,
                noise_label=noise_label,
            )
            counts.add(scored)
            objects = scored.parse.objects
            if vocabulary is not None:
                unknown_labels += sum(obj.label not in vocabulary for obj in objects)
            scored_preds.append([(obj, 1.0 - i / (len(objects) + 1)) for i, obj in enumerate(objects)])
            gts_all.append(list(scored.gt_objects))
            line = prediction_line(record, enc, encoder.coord_frame, objects, rollout.text, scored.parse)
            lines.append(json.dumps(line))
    labels = sorted({o.label for gts in gts_all for o in gts} | {o.label for p in scored_preds for o, _ in p})
    uniform = [[(obj, 1.0) for obj, _ in image] for image in scored_preds]
    maps = _maps(scored_preds, gts_all, crowds_all, labels, "position_scored") | _maps(
        uniform, gts_all, crowds_all, labels, "uniform_score"
    )
    if predictions_path is not None:
        Path(predictions_path).parent.mkdir(parents=True, exist_ok=True)
        Path(predictions_path).write_text("".join(line + "\n" for line in lines))
    detection, answers = counts.detection, counts.answers
    images = max(len(records), 1)
    return EvalResult(
        num_samples=len(records),
        decoding=asdict(decoding),
        iou_threshold=matching.iou_threshold,
        label_mode=matching.label_mode,
        precision=detection.precision,
        recall=detection.recall,
        f1=detection.f1,
        mean_iou=detection.mean_iou,
        map=maps["map_position_scored"],
        map_50=maps["map_50_position_scored"],
        map_75=maps["map_75_position_scored"],
        **maps,
        truncated_frac=counts.parsing.truncated_frac,
        invalid=dict(counts.parsing.invalid),
        unknown_labels=unknown_labels if vocabulary is not None else None,
        objects_per_image=counts.parsing.valid / images,
        noise_label=noise_label,
        noise_objects_per_image=counts.parsing.noise_objects / images,
        fp_per_image=detection.fp / images,
        ignored_predictions=detection.ignored,
        **{
            name.removeprefix("answers/"): value
            for name, value in answers.as_metrics(counts.parsing.valid).items()
        },
        recall_by_gt_count=answers.recall_by_gt_count(),
        **counts.count_order.summary(),
        count_buckets=list(count_buckets),
        gt_count_buckets={
            label: {"images": images, "precision": c.precision, "recall": c.recall, "f1": c.f1}
            for label, (images, c) in counts.count_order.by_bucket(count_buckets).items()
        },
        seconds=time.perf_counter() - start,
        predictions_path=str(predictions_path) if predictions_path is not None else None,
    )


def _maps(
    predictions: list[list[tuple[DetObject, float]]],
    gts: list[list[DetObject]],
    crowds: list[list[DetObject]],
    labels: list[str],
    scoring: str,
) -> dict[str, float]:
    """``map_<scoring>``, ``map_50_<scoring>``, ``map_75_<scoring>`` (0.0 with no record)."""
    empty = {"map": 0.0, "map_50": 0.0, "map_75": 0.0}
    maps = coco_map(predictions, gts, labels, ignore_regions=crowds) if gts else empty
    return {f"{name}_{scoring}": maps[name] for name in ("map", "map_50", "map_75")}


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


def command_config(command: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> RollmatchConfig:
    """The config of a model command (``rollmatch eval`` / ``diagnose``): ``--config`` (or, without one,
    this machine's engine settings, printed), then ``--model``, ``--backend``, ``extra`` and the
    command line's overrides."""
    from rollmatch.config.load import load_config
    from rollmatch.config.run_file import RUN_FILE, describe, read_run_file, run_layer
    from rollmatch.rollout.build import machine_overrides

    saved = read_run_file(args.model)
    under = [] if saved is None else [(f"{args.model}/{RUN_FILE}", run_layer(saved))]
    if saved is not None:
        print(
            f"rollmatch {command}: run settings from {args.model}/{RUN_FILE} ({describe(saved)})"
            + ("; --config and overrides override them" if args.config or args.overrides else ""),
            file=sys.stderr,
        )
    picked = [] if args.config else machine_overrides()
    if picked:
        print(
            f"rollmatch {command}: no --config, engine settings for this machine: {' '.join(picked)}",
            file=sys.stderr,
        )
    overrides = [*picked, f"model.path={args.model}"]
    if args.backend:
        overrides.append(f"{ROLLOUT_KEY}.rollout_backend={args.backend}")
    return load_config(args.config, [*overrides, *extra, *args.overrides], under=under)


@dataclass
class EvalSetup:
    """What evaluating ``model.path`` in this one process needs; the caller closes ``backend``."""

    run: ResolvedRun  # resolved once: eval decoding, coordinate frame, pixel bounds
    encoder: PromptEncoder
    codec: ObjectCodec
    backend: RolloutBackend


def load_for_eval(cfg: RollmatchConfig) -> EvalSetup:
    """The resolved run, prompt encoder, codec and rollout backend (``cfg``'s) of ``cfg.model.path`` in
    this one process."""
    from rollmatch.collectives import LocalCollectives
    from rollmatch.config.resolved import resolve_run_on_this_machine
    from rollmatch.data.labels import prompt_labels
    from rollmatch.data.prompts import load_processor
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.models.pretrained import load_pretrained
    from rollmatch.rollout.build import build_backend

    run = resolve_run_on_this_machine(cfg)
    encoder = PromptEncoder(
        load_processor(run.model_dir, *run.pixel_bounds),
        cfg.data.prompt,
        run.frame,
        prompt_labels(cfg.data, cfg.training.seed),
    )
    check_object_format(cfg, encoder.tokenizer)
    model = load_pretrained(cfg)  # an evaluated model dir has adapters merged already
    codec = build_codec(cfg.custom.object_format, encoder.tokenizer, [encoder.eos_token_id])
    backend = build_backend(
        run,
        model=model,
        tokenizer=encoder.tokenizer,
        processor=encoder.processor,
        collectives=LocalCollectives(),
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
    )
    return EvalSetup(run=run, encoder=encoder, codec=codec, backend=backend)


def check_object_format(cfg: RollmatchConfig, tokenizer: Any) -> None:
    """Refuse to read a coordinate-token model's answers as digits: a tokenizer with ``<|coord_k|>``
    and ``custom.object_format: qwen_json`` is an error unless the model's own ``rollmatch_run.json``
    says it was trained on digits."""
    from rollmatch.config.run_file import RUN_FILE, read_run_file
    from rollmatch.detection.coord_tokens import supported_object_formats

    if cfg.custom.object_format != "qwen_json" or "coord_tokens" not in supported_object_formats(tokenizer):
        return
    saved = read_run_file(cfg.model.path)
    if saved is not None and saved["settings"].get("custom.object_format") == "qwen_json":
        return
    raise ConfigError(
        [
            ConfigProblem(
                "custom.object_format",
                "qwen_json",
                f"{cfg.model.path} has coordinate tokens (<|coord_0|>..<|coord_999|>) and no {RUN_FILE} saying "
                "it answers with digits; its answers would be read as digits and score 0. Set "
                "custom.object_format=coord_tokens (or evaluate the run's final/ or checkpoint-N/, which "
                f"hold {RUN_FILE})",
            )
        ]
    )


def eval_command(args: argparse.Namespace) -> int:
    from rollmatch.data.records import load_records

    coco_results = getattr(args, "coco_results", None)
    if coco_results and not getattr(args, "coco_annotations", None):
        raise DataError(
            "--coco-results needs --coco-annotations: the COCO annotation json the --data records were "
            "converted from (image ids and category ids come from it)"
        )
    extra = [] if args.max_samples is None else [f"eval.max_samples={args.max_samples}"]
    cfg = command_config("eval", args, extra)
    if cfg.eval.decoding != cfg.rollout.decoding:
        print(
            f"rollmatch eval: decoding with eval.decoding ({_settings(cfg.eval.decoding)}); "
            f"{ROLLOUT_KEY}.decoding ({_settings(cfg.rollout.decoding)}) is the training "
            "rollouts' and is not used here",
            file=sys.stderr,
        )
    records = load_records(args.data, max_samples=cfg.eval.max_samples)
    predictions_path = args.out or str(Path(args.model) / "predictions.jsonl")
    result = run_eval(cfg, records, predictions_path)
    print(json.dumps(asdict(result), indent=2))
    if coco_results:
        from rollmatch.data.coco_results import write_coco_results

        written, unknown = write_coco_results(predictions_path, args.coco_annotations, coco_results)
        left_out = f"; {unknown} boxes with a label that is no COCO category left out" if unknown else ""
        print(f"COCO results: {written} boxes in {coco_results}{left_out}", file=sys.stderr)
    if args.pictures > 0:
        from rollmatch.viz import render_pictures

        pictures_dir = Path(predictions_path).parent / "pictures"
        render_pictures(
            records,
            predictions_path,
            pictures_dir,
            grid_size=args.pictures,
            max_images=args.pictures,
            matching=cfg.eval.matching,
        )
        print(f"pictures of the first {min(args.pictures, len(records))} images: {pictures_dir}")
    return 0


def _settings(section: DecodingConfig) -> str:
    return ", ".join(f"{name} {value}" for name, value in section.model_dump().items())


def run_eval(cfg: RollmatchConfig, records: Sequence[Record], predictions_path: str | None) -> EvalResult:
    """Evaluate ``cfg.model.path`` with the configured backend (HF or vLLM) on ``records`` (the first
    ``eval.max_samples`` of them when set)."""
    if cfg.eval.max_samples is not None:
        records = records[: cfg.eval.max_samples]
    setup = load_for_eval(cfg)
    backend = setup.backend
    try:
        return evaluate(
            backend,
            setup.encoder,
            setup.codec,
            records,
            decoding=setup.run.eval_decoding,
            matching=cfg.eval.matching,
            batch_size=cfg.eval.batch_size,
            count_buckets=cfg.eval.count_buckets,
            predictions_path=predictions_path,
            seed=cfg.training.seed,
            noise_label=noise_label_of(cfg),
        )
    finally:
        backend.close()
