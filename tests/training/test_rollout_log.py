"""Rollouts logged while training: TensorBoard images read back with tensorboard's own reader, the rollout
JSONL and pictures, which steps log, what a line says (parse failure, matching, target), W&B, async mode."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from resolved_runs import cpu_run

from rollmatch.config.decoding import rollout_decoding
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record, RecordObject, load_records
from rollmatch.detection.object_formats import build_codec
from rollmatch.packing.segment import Segment
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance
from rollmatch.training.entry import run_training
from rollmatch.training.rollout_log import RolloutLog
from rollmatch.viz import FALSE_POSITIVE, MATCHED, MISSED

LINE_KEYS = {
    "step",
    "id",
    "image",
    "sample",
    "weight_version",
    "finish_reason",
    "text",
    "response_token_ids",
    "objects",
    "truncated",
    "invalid",
    "parse_failure",
    "gt",
    "matched",
    "false_positives",
    "missed",
    "counts",
    "target",
}


def event_images(output_dir: str) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Every image and text summary of the run's event files, read with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(output_dir).rglob("events.out.tfevents*"))
    assert files, f"no TensorBoard event file under {output_dir}"
    images: dict[str, list[Any]] = {}
    texts: dict[str, list[Any]] = {}
    for file in files:
        events = EventAccumulator(str(file), size_guidance={"images": 0, "tensors": 0})
        events.Reload()
        for tag in events.Tags()["images"]:
            images.setdefault(tag, []).extend(events.Images(tag))
        for tag in events.Tags()["tensors"]:
            texts.setdefault(tag, []).extend(events.Tensors(tag))
    return images, texts


@pytest.mark.heavy
def test_a_short_run_leaves_rollout_images_in_its_event_file_and_the_rollout_jsonl(make_config) -> None:
    cfg = make_config(
        {
            "training": {
                "max_steps": 3,
                "report_to": ["tensorboard"],
                "log_rollouts_every": 2,
                "log_rollouts_count": 2,
            }
        }
    )
    run_training(cfg)
    out = Path(cfg.training.output_dir)
    # logged: the first step, then every 2nd
    assert sorted(p.name for p in (out / "rollouts").glob("*.jsonl")) == ["step-1.jsonl", "step-2.jsonl"]
    records = {r.id: r for r in load_records(cfg.data.train_jsonl)}
    for step in (1, 2):
        lines = [json.loads(x) for x in (out / "rollouts" / f"step-{step}.jsonl").read_text().splitlines()]
        assert len(lines) == 2
        assert len({line["id"] for line in lines}) == 2  # other records first
        for line in lines:
            assert set(line) >= LINE_KEYS
            assert line["step"] == step and line["id"] in records
            assert line["weight_version"] == step - 1  # pushed before the step: its optimizer steps so far
            assert len(line["gt"]) == len(records[line["id"]].objects)
            counts = line["counts"]
            assert counts["tp"] + counts["fn"] == len(line["gt"])
            assert counts["tp"] + counts["fp"] == len(line["objects"])
            assert line["target"]["tokens"] >= line["target"]["supervised_tokens"] > 0
        pngs = sorted((out / "rollouts" / f"step-{step}").glob("*.png"))
        assert len(pngs) == 2
    images, texts = event_images(cfg.training.output_dir)
    assert sorted(images) == ["rollouts/0", "rollouts/1"]
    for tag, events in images.items():
        assert [e.step for e in events] == [1, 2]
        png = sorted((out / "rollouts" / f"step-{events[0].step}").glob(f"0{tag[-1]}-*.png"))[0]
        decoded = Image.open(io.BytesIO(events[0].encoded_image_string))
        assert decoded.size == Image.open(png).size == (events[0].width, events[0].height)
        assert np.array_equal(np.asarray(decoded.convert("RGB")), np.asarray(Image.open(png).convert("RGB")))
    text = texts["rollouts/text/text_summary"]
    assert [e.step for e in text] == [1, 2]


# ------------------------------------------------------------------------------ one rollout, by hand
@pytest.fixture
def parts(tiny_model_dir, make_config, tmp_path):
    cfg = make_config({"training": {"log_rollouts_every": 3, "log_rollouts_count": 2}})
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    image = tmp_path / "grey.png"
    Image.new("RGB", (200, 100), (90, 90, 90)).save(image)
    record = Record(
        id="r0",
        images=(str(image),),
        width=200,
        height=100,
        objects=(
            RecordObject("square", (20.0, 10.0, 80.0, 60.0)),
            RecordObject("circle", (120.0, 40.0, 180.0, 90.0)),
        ),
    )
    return cfg, encoder, codec, record


def rollout_of(encoder: PromptEncoder, prompt: list[int], text: str, finish: str = "stop") -> Rollout:
    ids = encoder.tokenizer.encode(text, add_special_tokens=False)
    return Rollout(
        sample_id="r0",
        prompt_token_ids=prompt,
        response_token_ids=ids,
        text=text,
        finish_reason=finish,  # type: ignore[arg-type]
        weight_version=7,
        provenance=RolloutProvenance(backend="hf", seed=0, decoding=Decoding()),
    )


def segment_of(prompt: list[int], target: list[int]) -> Segment:
    length = len(prompt) + len(target)
    weights = torch.tensor([0.0] * len(prompt) + [1.0] * len(target))
    return Segment(
        sample_id="r0",
        input_ids=torch.tensor(prompt + target),
        weights=weights,
        pixel_values=None,
        image_grid_thw=None,
        mm_token_type_ids=torch.zeros(length, dtype=torch.long),
        position_ids=torch.zeros(3, length, dtype=torch.long),
    )


def test_a_logged_line_and_picture_show_matched_false_positive_missed_and_the_parse_failure(parts) -> None:
    cfg, encoder, codec, record = parts
    encoded = encoder.encode(record)
    # norm1000 of a 200x100 image: the square (20,10)-(80,60) is (100,100)-(400,600); a box far from any GT;
    # an element with an empty label (invalid); then the list is cut (no closing bracket).
    text = (
        '[{"bbox_2d": [100, 100, 400, 600], "label": "square"}, {"bbox_2d": [450, 50, 550, 300], "label": "x"}, '
        '{"bbox_2d": [1, 1, 5, 5], "label": ""}, {"bbox_2d": [7'
    )
    rollout = rollout_of(encoder, encoded.input_ids, text, finish="length")
    target_ids = encoder.tokenizer.encode('[{"bbox_2d": [100, 100, 400, 600], "label": "square"}]')
    segment = segment_of(encoded.input_ids, target_ids)
    log = RolloutLog(cfg, encoder, codec)
    log.rolled_out([record], [encoded], [rollout], [segment])
    log.trained(0, [segment])
    out = Path(cfg.training.output_dir) / "rollouts"
    (line,) = [json.loads(x) for x in (out / "step-1.jsonl").read_text().splitlines()]
    assert line["id"] == "r0" and line["weight_version"] == 7 and line["finish_reason"] == "length"
    assert line["counts"] == {"tp": 1, "fp": 1, "fn": 1}
    assert line["matched"][0]["prediction"] == 0 and line["false_positives"] == [1]
    assert line["truncated"] is True and line["invalid"] == {"empty_label": 1}
    assert line["parse_failure"] == "truncated, empty_label x1"
    assert line["objects"][0] == {"label": "square", "bbox": [20.0, 10.0, 80.0, 60.0]}
    assert line["target"]["tokens"] == len(target_ids) == line["target"]["supervised_tokens"]
    assert line["target"]["text"].startswith('[{"bbox_2d": [100, 100, 400, 600]')
    (png,) = (out / "step-1").glob("*.png")
    pixels = np.asarray(Image.open(png).convert("RGB"))
    # 200x100 drawn at longest side 448: scale 2.24; matched box's left edge x=20*2.24, FP's left edge
    # x=90*2.24 (450/1000 of 200 px), the missed circle's bottom edge dashed yellow at y=90*2.24-1.
    scale = 448 / 200
    assert tuple(pixels[round(40 * scale), round(20 * scale)]) == MATCHED
    assert tuple(pixels[round(20 * scale), round(90 * scale)]) == FALSE_POSITIVE
    bottom = pixels[round(90 * scale) - 3 : round(90 * scale) + 1, round(120 * scale) : round(180 * scale)]
    assert max(sum(tuple(p) == MISSED for p in row) for row in bottom) >= 10
    assert pixels.shape[0] > round(100 * scale)  # the note band under the image
    # another call in the same step adds up to the count; step 2 is not due (every 3); step 3 is
    log.trained(0, [segment])
    log.trained(1, [segment])
    assert sorted(p.name for p in out.glob("*.jsonl")) == ["step-1.jsonl"]
    log.trained(2, [segment])
    assert (out / "step-3.jsonl").exists()
    # a resumed run that trains step 1 again rewrites its file instead of adding to it
    again = RolloutLog(cfg, encoder, codec)
    again.rolled_out([record], [encoded], [rollout], [segment])
    again.trained(0, [segment])
    assert len((out / "step-1.jsonl").read_text().splitlines()) == 1


def test_a_due_step_without_rollouts_passes_it_on_and_a_dead_segment_is_forgotten(parts) -> None:
    cfg, encoder, codec, record = parts
    encoded = encoder.encode(record)
    log = RolloutLog(cfg, encoder, codec)
    log.trained(0, [])  # step 1 trained no rollout (a Channel-A step): step 2 logs instead
    segment = segment_of(encoded.input_ids, [encoder.eos_token_id])
    log.rolled_out([record], [encoded], [rollout_of(encoder, encoded.input_ids, "[]")], [segment])
    assert log.remembered == 1
    log.trained(1, [segment])
    out = Path(cfg.training.output_dir) / "rollouts"
    assert [p.name for p in out.glob("*.jsonl")] == ["step-2.jsonl"]
    line = json.loads((out / "step-2.jsonl").read_text())
    assert line["parse_failure"] is None and line["counts"] == {"tp": 0, "fp": 0, "fn": 2}
    del segment
    assert log.remembered == 0  # an entry lives only as long as its segment


def test_wandb_gets_the_pictures_when_it_is_in_report_to(parts, monkeypatch) -> None:
    """wandb is not installed here: a stand-in module records what the log would send."""
    cfg, encoder, codec, record = parts
    cfg.training.report_to = ["wandb"]
    sent: list[dict[str, Any]] = []
    stand_in = types.ModuleType("wandb")
    stand_in.Image = lambda image, caption: ("image", image.size, caption)  # type: ignore[attr-defined]
    stand_in.log = sent.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    encoded = encoder.encode(record)
    segment = segment_of(encoded.input_ids, [encoder.eos_token_id])
    log = RolloutLog(cfg, encoder, codec)
    log.rolled_out([record], [encoded], [rollout_of(encoder, encoded.input_ids, "[]")], [segment])
    log.trained(0, [segment])
    (logged,) = sent
    assert logged["train/global_step"] == 1
    kind, _, caption = logged["rollouts/0"]
    assert kind == "image" and caption.startswith("r0")


def test_tensorboard_in_report_to_without_a_writer_is_an_error_naming_the_phase(parts) -> None:
    cfg, encoder, codec, record = parts
    cfg.training.report_to = ["tensorboard"]
    encoded = encoder.encode(record)
    segment = segment_of(encoded.input_ids, [encoder.eos_token_id])
    log = RolloutLog(cfg, encoder, codec)
    log.rolled_out([record], [encoded], [rollout_of(encoder, encoded.input_ids, "[]")], [segment])
    with pytest.raises(RuntimeError, match="no TensorBoard writer"):
        log.trained(0, [segment])


def test_async_mode_logs_from_the_learner_what_each_step_trains(
    loaded_tiny, tiny_model_dir, make_config, tmp_path
):
    """The actor rolls out in its thread and only remembers; the learner's step logs the packs it trains
    (the record trace says which), with the version they were rolled out under (window 0: the step's)."""
    from rollmatch.collectives import LocalCollectives
    from rollmatch.rollout.hf import HFBackend
    from rollmatch.training.channel_b.actor import RolloutActor
    from rollmatch.training.channel_b.async_mode import AsyncPacks
    from rollmatch.training.channel_b.ready_packs import ReadyPackQueue, VersionPurePacker
    from rollmatch.training.channel_b.record_stream import RecordStream
    from rollmatch.training.channel_modes import WindowRows
    from rollmatch.training.rows import RowPlanner
    from rollmatch.training.segment_producers import GTSegmentProducer, RolloutSegmentProducer
    from rollmatch.training.step import ABSchedule, StepPlanner

    model, _ = loaded_tiny
    cfg = make_config(
        {
            "custom": {"trainer_variant": "stage2_ab_training"},
            "stage2_ab": {"schedule": {"b_ratio": 1.0}},
            "training": {"log_rollouts_every": 1, "log_rollouts_count": 3},
        }
    )
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records = load_records(cfg.data.train_jsonl)
    log = RolloutLog(cfg, encoder, codec)
    backend = HFBackend(
        model, encoder.tokenizer, eos_token_id=encoder.eos_token_id, pad_token_id=encoder.pad_token_id
    )

    def rows() -> RowPlanner:
        return RowPlanner(
            packing=True, packing_length=1024, carry_limit=16, pad_token_id=encoder.pad_token_id
        )

    queue: ReadyPackQueue[Any] = ReadyPackQueue(8)
    actor = RolloutActor(
        rollouts=RolloutSegmentProducer(
            model,
            encoder,
            codec,
            cfg,
            backend,
            decoding=rollout_decoding(cfg),
            decode_batch_size=2,
            rollout_log=log,
        ),
        stream=RecordStream(records, rank=0, world_size=1, seed=0),
        queue=queue,
        packer=VersionPurePacker(length=lambda s: s.length, capacity=1024, batch_size=None),
        decode_batch_size=2,
        prefetch_target=2,
        version_window=0,
        training_seed=0,
        rank=0,
    )
    trace = tmp_path / "trace.jsonl"
    channel = AsyncPacks(
        backend=backend,
        model=model,
        actor=actor,
        queue=queue,
        rows=rows(),
        version_window=0,
        sync_every_steps=1,
        accounting_path=None,
        max_wait_s=60.0,
        trace_path=str(trace),
    )
    steps = StepPlanner(
        schedule=ABSchedule(1.0),
        channel_a=WindowRows(GTSegmentProducer(model, encoder, codec, cfg).produce, rows()),
        channel_b=channel,
        sync=channel,
        collectives=LocalCollectives(),
        report_ab=True,
        rollout_log=log,
    )
    try:
        for step in range(2):
            plan = steps.plan([records[:1]], step)
            assert plan.kind == "B"
            for micro in plan.micro_steps:
                micro.finish(model, torch.zeros(()))
    finally:
        assert actor.stop(timeout_s=30.0)
    trained = {
        line["step"]: {r[1] for r in line["records"]}
        for line in map(json.loads, trace.read_text().splitlines())
        if line["event"] == "trained"
    }
    out = Path(cfg.training.output_dir) / "rollouts"
    for step in (1, 2):
        lines = [json.loads(x) for x in (out / f"step-{step}.jsonl").read_text().splitlines()]
        assert lines and {line["id"] for line in lines} <= trained[step - 1]
        assert {line["weight_version"] for line in lines} == {step - 1}


@pytest.mark.parametrize("pipeline", [False, True])
def test_step_mode_logs_the_rollouts_its_last_micro_step_trains(
    loaded_tiny, tiny_model_dir, make_config, train_plan, pipeline
) -> None:
    from rollmatch.collectives import LocalCollectives
    from rollmatch.training.variants import BuildContext, build_variant

    model, _ = loaded_tiny
    cfg = make_config(
        {
            "custom": {"trainer_variant": "stage2_ab_training"},
            "stage2_ab": {
                "schedule": {"b_ratio": 1.0},
                "channel_b": {"mode": "step", "rollout_decode_batch_size": 1},
            },
            "training": {"log_rollouts_every": 1, "log_rollouts_count": 3},
        }
    )
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records = load_records(cfg.data.train_jsonl)
    log = RolloutLog(cfg, encoder, codec)
    ctx = BuildContext(
        run=cpu_run(cfg, gradient_accumulation_steps=1),
        model=model,
        encoder=encoder,
        codec=codec,
        collectives=LocalCollectives(),
        train_records=records,
        rollout_log=log,
    )
    parts = build_variant(ctx)
    parts.planner.channel_b.pipeline = pipeline  # in process: the pipeline's rollout thread, same backend
    try:
        train_plan(model, parts.planner.plan([records[:2]], 0))
    finally:
        parts.close()
        model.zero_grad(set_to_none=True)
    lines = [
        json.loads(x)
        for x in (Path(cfg.training.output_dir) / "rollouts" / "step-1.jsonl").read_text().splitlines()
    ]
    assert sorted(line["id"] for line in lines) == sorted(r.id for r in records[:2])
