"""``rollmatch eval``: one scoring path with training (``cfg.matching``), records limit, and a
config-less command that runs on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pytest

from rollmatch.collectives import LocalCollectives
from rollmatch.config.decoding import eval_decoding, rollout_decoding
from rollmatch.config.load import load_config
from rollmatch.config.resolved import resolve_run
from rollmatch.config.rules import check_runtime
from rollmatch.config.schema import DataConfig, MatchingConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record, load_records
from rollmatch.data.shapes import generate_shapes
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject
from rollmatch.evaluation import evaluate, run_eval
from rollmatch.rollout.build import machine_overrides
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance, RolloutRequest, SyncReport
from rollmatch.rollout.vllm_settings import vllm_installed
from rollmatch.training.periodic_eval import DetectionEval, eval_metrics

REPO = Path(__file__).resolve().parents[1]


class ReplayBackend:
    """A rollout backend that answers each sample with a given response text.

    A random tiny model cannot be made to write chosen boxes, so the responses are injected; the
    code under test (encoding, alignment, scoring, metrics) runs as it does with a real engine.
    """

    name = "replay"
    weight_version = 0

    def __init__(self, tokenizer: object, texts: dict[str, str]):
        self.tokenizer = tokenizer
        self.texts = texts

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        return [
            Rollout(
                sample_id=r.sample_id,
                prompt_token_ids=list(r.prompt_token_ids),
                response_token_ids=self.tokenizer.encode(self.texts[r.sample_id], add_special_tokens=False),
                text=self.texts[r.sample_id],
                finish_reason="stop",
                weight_version=0,
                provenance=RolloutProvenance(backend=self.name, seed=seed + i, decoding=decoding),
            )
            for i, r in enumerate(requests)
        ]

    def sync_weights(self, model: object, version: int) -> SyncReport:
        return SyncReport(version=version, num_bytes=0, seconds=0.0, mode="none")

    def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=1, n_val=4, size=224, seed=3)


def test_eval_scores_with_the_configured_matching(tiny_model_dir: Path, shapes: dict[str, Path]) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records: list[Record] = load_records(shapes["val"])
    gts = {r.id: encoder.gt_objects(r, encoder.encode(r)) for r in records}
    # every GT box found, but each record's first object under another label
    texts = {
        rid: codec.serialize([DetObject("other", o.bbox) if i == 0 else o for i, o in enumerate(objects)])
        for rid, objects in gts.items()
    }
    n_gt = sum(len(objects) for objects in gts.values())

    def f1(matching: MatchingConfig) -> float:
        backend = ReplayBackend(encoder.tokenizer, texts)
        result = evaluate(
            backend, encoder, codec, records, decoding=Decoding(), matching=matching, progress=False
        )
        assert result.num_samples == len(records) and result.truncated_frac == 0.0
        assert (result.label_mode, result.iou_threshold) == (matching.label_mode, matching.iou_threshold)
        return result.f1

    assert f1(MatchingConfig(label_mode="ignore")) == 1.0  # geometry only
    relabelled = len(records)
    assert f1(MatchingConfig()) == pytest.approx((n_gt - relabelled) / n_gt)  # label-aware by default


def test_eval_matching_is_the_evaluations_own_whatever_the_run_trained_with() -> None:
    cfg = load_config(None, ["matching.label_mode=ignore", "matching.iou_threshold=0.3"])
    assert (cfg.eval.matching.label_mode, cfg.eval.matching.iou_threshold) == ("require", 0.5)


def test_eval_reports_counts_duplicates_and_recall_by_gt_count(
    tiny_model_dir: Path, shapes: dict[str, Path]
) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records: list[Record] = load_records(shapes["val"])[:6]
    gts = {r.id: encoder.gt_objects(r, encoder.encode(r)) for r in records}
    # record 0 answered with its first object twice (a duplicate), the others exactly
    texts = {
        rid: codec.serialize([*objects, objects[0]] if i == 0 else objects)
        for i, (rid, objects) in enumerate(gts.items())
    }
    result = evaluate(
        ReplayBackend(encoder.tokenizer, texts), encoder, codec, records, decoding=Decoding(), progress=False
    )
    n_pred, n = sum(len(objects) for objects in gts.values()) + 1, len(records)
    assert n >= 3 and result.exact_count_acc == pytest.approx((n - 1) / n)
    assert result.duplicate_rate == result.duplicate_rate_any_label == pytest.approx(1 / n_pred)
    assert result.fp_per_image == pytest.approx(1 / n) and result.objects_per_image == pytest.approx(
        n_pred / n
    )
    assert set(result.recall_by_gt_count.values()) == {1.0}
    assert sorted(result.recall_by_gt_count) == sorted({str(len(o)) for o in gts.values()})


def test_machine_overrides_give_a_config_this_machine_runs() -> None:
    picked = machine_overrides()
    cfg = load_config(None, picked)
    assert cfg.rollout.rollout_backend == ("vllm" if vllm_installed() else "hf")
    assert cfg.rollout.vllm.tensor_parallel_size == 1
    import torch

    gpus = torch.cuda.device_count()
    device_type = "cuda" if gpus else "cpu"
    assert check_runtime(cfg, world_size=1, device_count=gpus, device_type=device_type) == []
    if vllm_installed():  # the colocated engine's rules, through the one door to a run
        resolve_run(cfg, world_size=1, device_count=gpus, device_type=device_type, model_required=False)


@pytest.mark.heavy
@pytest.mark.integration  # the CLI in a subprocess with the default backend: a vLLM engine where installed
def test_eval_command_without_config_runs_as_the_readme_says(
    tiny_model_dir: Path, shapes: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "preds.jsonl"
    command = [
        str(Path(sys.executable).with_name("rollmatch")), "eval", "--model", str(tiny_model_dir),
        "--data", str(shapes["val"]), "--out", str(out), "--max-samples", "2",
        "custom.extra.rollout_matching.max_new_tokens=8",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine settings for this machine" in done.stderr and "tensor_parallel_size=1" in done.stderr
    lines = done.stdout.splitlines()  # vLLM may log to stdout before the result
    start = max(i for i, line in enumerate(lines) if line == "{")
    result = json.loads("\n".join(lines[start:]))
    assert result["num_samples"] == 2 and len(out.read_text().splitlines()) == 2


def test_eval_reads_each_checkpoint_frame_without_a_flag(
    tiny_model_dirs: dict[str, Path], shapes: dict[str, Path], tmp_path: Path
) -> None:
    """A Qwen2.5-VL (pixels) and a Qwen3-VL (norm1000) checkpoint on the same JSONL, each answering
    in its own frame: both score every box and write the same original-pixel boxes."""
    records: list[Record] = load_records(shapes["val"])
    written: dict[str, list[dict]] = {}
    for family, frame in (("qwen2_5_vl", "pixels"), ("qwen3_vl", "norm1000")):
        cfg = load_config(None, [f"model.path={tiny_model_dirs[family]}"])  # as `rollmatch eval --model` does
        encoder = PromptEncoder.from_pretrained(
            cfg.model.path, cfg.data, object_format=cfg.custom.object_format
        )
        assert encoder.coord_frame == frame
        codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
        texts = {r.id: codec.serialize(encoder.gt_objects(r, encoder.encode(r))) for r in records}
        out = tmp_path / f"{family}.jsonl"
        result = evaluate(
            ReplayBackend(encoder.tokenizer, texts),
            encoder,
            codec,
            records,
            decoding=Decoding(),
            matching=MatchingConfig(),
            predictions_path=str(out),
            progress=False,
        )
        assert result.f1 == 1.0
        written[family] = [json.loads(line) for line in out.read_text().splitlines()]
    for record, a, b in zip(records, written["qwen2_5_vl"], written["qwen3_vl"], strict=True):
        pairs = zip(
            sorted(o["bbox"] for o in a["objects"]), sorted(o["bbox"] for o in b["objects"]), strict=True
        )
        for box_a, box_b in pairs:  # within one resized pixel of the coarser frame (224 px -> >= 56 px)
            assert all(abs(x - y) <= record.width / 56 for x, y in zip(box_a, box_b, strict=True))


class RecordingReplayBackend(ReplayBackend):
    """A :class:`ReplayBackend` that keeps the decoding of every call."""

    def __init__(self, tokenizer: object, texts: dict[str, str]):
        super().__init__(tokenizer, texts)
        self.decodings: list[Decoding] = []

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        self.decodings.append(decoding)
        return super().generate(requests, decoding, seed)


SAMPLED_ROLLOUTS = [
    "custom.extra.rollout_matching.decoding.temperature=1.3",
    "custom.extra.rollout_matching.decoding.top_k=5",
    "custom.extra.rollout_matching.max_new_tokens=40",
]


def test_eval_decoding_is_its_own_never_the_rollout_decoding() -> None:
    cfg = load_config(None, SAMPLED_ROLLOUTS)
    assert eval_decoding(cfg) == Decoding(max_new_tokens=40)  # greedy, the rollout's budget
    cfg = load_config(None, [*SAMPLED_ROLLOUTS, "eval.decoding.temperature=0.7", "eval.max_new_tokens=12"])
    assert eval_decoding(cfg) == Decoding(temperature=0.7, max_new_tokens=12)
    assert rollout_decoding(cfg).temperature == 1.3  # the rollouts keep theirs


def test_in_training_eval_decodes_with_eval_decoding_and_records_it(
    tiny_model_dir: Path, shapes: dict[str, Path], tmp_path: Path
) -> None:
    cfg = load_config(None, [*SAMPLED_ROLLOUTS, f"training.output_dir={tmp_path}"])
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records: list[Record] = load_records(shapes["val"])[:2]
    texts = {r.id: codec.serialize(encoder.gt_objects(r, encoder.encode(r))) for r in records}
    backend = RecordingReplayBackend(encoder.tokenizer, texts)
    detection_eval = DetectionEval(
        cfg=cfg,
        decoding=eval_decoding(cfg),  # what build_detection_eval hands it from the resolved run
        backend=backend,
        sync=None,  # type: ignore[arg-type]  # _evaluate pushes no weights
        encoder=encoder,
        codec=codec,
        records=records,
        collectives=LocalCollectives(),
    )
    metrics = detection_eval._evaluate(global_step=3)
    assert backend.decodings == [Decoding(max_new_tokens=40)]
    assert metrics["eval/f1"] == 1.0
    result = evaluate(backend, encoder, codec, records, decoding=Decoding(temperature=0.5), progress=False)
    assert result.decoding == asdict(Decoding(temperature=0.5))


@pytest.mark.heavy
def test_eval_json_records_greedy_decoding_whatever_the_rollouts_sample(
    tiny_model_dir: Path, shapes: dict[str, Path], tmp_path: Path
) -> None:
    records = load_records(shapes["val"])[:2]
    base = [f"model.path={tiny_model_dir}", "custom.extra.rollout_matching.rollout_backend=hf"]
    base += ["custom.extra.rollout_matching.max_new_tokens=12"]
    sampled = run_eval(load_config(None, [*base, *SAMPLED_ROLLOUTS[:2]]), records, str(tmp_path / "a.jsonl"))
    greedy = run_eval(load_config(None, base), records, str(tmp_path / "b.jsonl"))
    assert sampled.decoding == greedy.decoding == asdict(Decoding(max_new_tokens=12))
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


def test_eval_reports_count_regulation_order_and_both_maps(
    tiny_model_dir: Path, shapes: dict[str, Path]
) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records: list[Record] = sorted(load_records(shapes["val"]), key=lambda r: -len(r.objects))
    gts = [encoder.gt_objects(r, encoder.encode(r)) for r in records]
    assert len(gts[0]) >= 2 and len(gts[1]) >= 2, "the test needs two records with >= 2 objects"
    # record 0 listed in reverse order; record 1 stops after its first object; the rest exact
    answers = [gts[0][::-1], gts[1][:1], *gts[2:]]
    texts = {r.id: codec.serialize_in_order(a) for r, a in zip(records, answers, strict=True)}
    result = evaluate(
        ReplayBackend(encoder.tokenizer, texts),
        encoder,
        codec,
        records,
        decoding=Decoding(),
        count_buckets=[1, 3],
        progress=False,
    )
    n = len(records)
    assert result.count_error == pytest.approx(-(len(gts[1]) - 1) / n)
    assert result.count_mae == pytest.approx((len(gts[1]) - 1) / n)
    taus = [-1.0] + [1.0 for g in gts[2:] if len(g) >= 2]  # record 1 has one matched object: no tau
    assert result.kendall_tau == pytest.approx(sum(taus) / len(taus))
    assert result.recall_first_third == 1.0 and result.recall_last_third < 1.0  # record 1 stopped early
    assert result.count_buckets == [1, 3]
    assert sum(b["images"] for b in result.gt_count_buckets.values()) == n
    assert set(result.gt_count_buckets) <= {"1-2", "3+"}
    missed_bucket = "3+" if len(gts[1]) >= 3 else "1-2"
    assert result.gt_count_buckets[missed_bucket]["recall"] < 1.0
    assert result.map_position_scored == result.map and result.map_50_position_scored == result.map_50
    assert 0.0 < result.map_uniform_score <= 1.0
    metrics = eval_metrics(result, weight_version=0)
    assert metrics["eval/map_uniform_score"] == result.map_uniform_score
    assert metrics["eval/kendall_tau"] == result.kendall_tau
    assert (
        metrics[f"eval/gt_count_{missed_bucket}/recall"] == result.gt_count_buckets[missed_bucket]["recall"]
    )


def test_eval_drops_the_noise_label_before_scoring_and_counts_it(
    tiny_model_dir: Path, shapes: dict[str, Path], tmp_path: Path
) -> None:
    """A model trained with ``loss.noise_objects`` ends its answers with noise objects: with the noise
    label they are dropped from the scores and the predictions file; without it they are false positives."""
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records: list[Record] = load_records(shapes["val"])[:4]
    texts = {}
    for r in records:
        encoded = encoder.encode(r)
        w, h = encoder.frame_extent(encoded)
        noise = [
            DetObject("noise", (1, 1, w // 3, h // 3)),
            DetObject("noise", (w // 2, h // 2, w - 1, h - 1)),
        ]
        texts[r.id] = codec.serialize_in_order([*encoder.gt_objects(r, encoded), *noise])
    backend = ReplayBackend(encoder.tokenizer, texts)
    kept = evaluate(backend, encoder, codec, records, decoding=Decoding(), progress=False)
    dropped = evaluate(
        backend,
        encoder,
        codec,
        records,
        decoding=Decoding(),
        progress=False,
        noise_label="noise",
        predictions_path=tmp_path / "preds.jsonl",
    )
    assert dropped.f1 == 1.0 and dropped.fp_per_image == 0.0 and dropped.exact_count_acc == 1.0
    assert dropped.noise_objects_per_image == 2.0 and dropped.noise_label == "noise"
    assert kept.fp_per_image == 2.0 and kept.f1 < 1.0 and kept.noise_objects_per_image == 0.0
    lines = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert all(o["label"] != "noise" for line in lines for o in line["objects"])
    assert eval_metrics(dropped, weight_version=0)["eval/noise_objects_per_image"] == 2.0
    assert "eval/noise_objects_per_image" not in eval_metrics(kept, weight_version=0)
