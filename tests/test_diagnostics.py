"""``rollmatch diagnose``: target-vs-SFT differences and the prefix-sensitivity probe.

The probe's arithmetic runs on a scripted backend (a random tiny model cannot be made to write chosen
boxes): a model that writes a false positive first and then stops after one object, but lists every
remaining object when it continues a GT prefix. The command itself runs on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from rollmatch.config.schema import DataConfig, MatchingConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.data.shapes import generate_shapes
from rollmatch.detection.codec import decode_with_offsets
from rollmatch.detection.object_formats import build_codec
from rollmatch.detection.objects import DetObject, canonical_order
from rollmatch.diagnostics import diagnose, gt_prefix_ids
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance, RolloutRequest, SyncReport

REPO = Path(__file__).resolve().parents[1]


class ScriptedBackend:
    """Own answer: a false positive, then the first GT object, then stop. Continuing a GT prefix: the
    rest of the GT list, exactly."""

    name = "scripted"
    weight_version = 0

    def __init__(
        self, tokenizer, codec, prompts: dict[str, int], gts: dict[str, list[DetObject]], fp: DetObject
    ):
        self.tokenizer, self.codec, self.prompts, self.gts, self.fp = tokenizer, codec, prompts, gts, fp
        self.continued = 0

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        out = []
        for i, r in enumerate(requests):
            ordered = canonical_order(self.gts[r.sample_id])
            prefix = list(r.prompt_token_ids[self.prompts[r.sample_id] :])
            if prefix:
                self.continued += 1
                text = self.codec.serialize_in_order(ordered)[len(self.tokenizer.decode(prefix)) :]
            else:
                text = self.codec.serialize_in_order([self.fp, ordered[0]])
            out.append(
                Rollout(
                    sample_id=r.sample_id,
                    prompt_token_ids=list(r.prompt_token_ids),
                    response_token_ids=self.tokenizer.encode(text, add_special_tokens=False),
                    text=text,
                    finish_reason="stop",
                    weight_version=0,
                    provenance=RolloutProvenance(backend=self.name, seed=seed + i, decoding=decoding),
                )
            )
        return out

    def sync_weights(self, model: object, version: int) -> SyncReport:
        return SyncReport(version=version, num_bytes=0, seconds=0.0, mode="none")

    def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=1, n_val=6, size=224, seed=3)


def test_prefix_probe_measures_recall_after_the_gt_prefix_and_after_the_own_one(
    tiny_model_dir: Path, shapes: dict[str, Path]
) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records = load_records(shapes["val"])
    encoded = {r.id: encoder.encode(r) for r in records}
    gts = {r.id: encoder.gt_objects(r, encoded[r.id]) for r in records}
    width, height = encoder.frame_extent(encoded[records[0].id])
    false_positive = DetObject("star", (width - 12, height - 12, width - 2, height - 2))  # no shape is a star
    backend = ScriptedBackend(
        encoder.tokenizer, codec, {rid: len(e.input_ids) for rid, e in encoded.items()}, gts, false_positive
    )
    result = diagnose(
        backend,
        encoder,
        codec,
        records,
        max_new_tokens=256,
        matching=MatchingConfig(),
        prefix_ks=(1,),
        progress=False,
    )
    probe = result["prefix_probe"]["1"]
    eligible = [rid for rid, objects in gts.items() if len(objects) > 1]
    assert probe["records"] == len(eligible) == backend.continued > 0
    # after the GT's first object the model lists the rest: recall 1
    assert probe["recall_after_gt_prefix"] == 1.0
    # its own first element is a false positive (a mistake); after it, only the first GT object is found
    left = sum(len(gts[rid]) for rid in eligible)
    assert probe["own_prefix_mistake"] == {
        "records": len(eligible),
        "recall_after_own_prefix": round(len(eligible) / left, 4),
    }
    assert probe["own_prefix_clean"]["records"] == 0
    assert probe["exposure_gap"] == pytest.approx(1.0 - len(eligible) / left, abs=1e-3)
    targets = result["targets_vs_sft"]
    # the false positive comes first: the default target is SFT's, the keep-all targets are not
    assert targets["prefix_fn_matched_supervise"]["differs_frac"] == 0.0
    assert targets["prefix_fn_all_supervise"]["differs_frac"] == 1.0
    assert result["rollouts"]["precision"] == 0.5 and result["decoding"] == "greedy"


def test_gt_prefix_stops_before_the_token_that_closes_the_kth_object(tiny_model_dir: Path) -> None:
    encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig())
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    gts = [DetObject("red square", (10, 20, 300, 400)), DetObject("fish", (5, 600, 100, 700))]
    ids = gt_prefix_ids(codec, encoder.tokenizer, gts, 1)
    text = decode_with_offsets(encoder.tokenizer, ids).text
    full = codec.serialize(gts)
    first_close = full.index("}")
    assert full.startswith(text) and len(text) <= first_close and "}" not in text
    # the ids are SFT's own: a prefix of the encoded GT serialization
    assert encoder.tokenizer.encode(full, add_special_tokens=False)[: len(ids)] == ids


@pytest.mark.heavy
def test_diagnose_command_prints_json_on_the_tiny_model(
    tiny_model_dir: Path, shapes: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "diagnose.json"
    command = [
        str(Path(sys.executable).with_name("rollmatch")),
        "diagnose",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(shapes["val"]),
        "--backend",
        "hf",
        "--max-samples",
        "3",
        "--prefix-k",
        "1",
        "--out",
        str(out),
        "custom.extra.rollout_matching.max_new_tokens=16",
    ]  # fmt: skip  (eval.max_new_tokens left null: the rollouts' budget applies)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["records"] == 3 and result["model"] == str(tiny_model_dir)
    assert result["max_new_tokens"] == 16
    assert set(result["targets_vs_sft"]) == {
        "prefix_fn_matched_supervise",
        "prefix_fn_matched_none",
        "prefix_fn_all_none",
        "prefix_fn_all_supervise",
        "reordered_gt",
    }
    # a random model writes no complete element: every target is the GT list, i.e. SFT's
    assert all(v["differs_frac"] == 0.0 for v in result["targets_vs_sft"].values())
    assert result["prefix_probe"]["1"]["records"] == 0
