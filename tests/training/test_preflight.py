"""Preflight's verdict on single answers: what an Instruct model writes (a ```json fence, synonyms) is
named as such; the project's format with known labels is valid."""

from __future__ import annotations

from typing import Any

import pytest

from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.training.preflight import PreflightReport, classify_response, fenced_labels

VOCABULARY = frozenset({"couch", "person"})


def parse(tiny_tokenizer: Any, text: str, *, hit_max_tokens: bool = False) -> Any:
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    codec = QwenJsonCodec(tiny_tokenizer, [eos])
    ids = tiny_tokenizer.encode(text, add_special_tokens=False) + ([] if hit_max_tokens else [eos])
    return codec.parse(ids, extent=(1000, 1000), hit_max_tokens=hit_max_tokens)


@pytest.mark.parametrize(
    ("text", "reasons"),
    [
        ('[{"bbox_2d": [1, 2, 30, 40], "label": "couch"}]', []),
        ('```json\n[{"bbox_2d": [1, 2, 30, 40], "label": "sofa"}]\n```', ["fenced_json", "unknown_label"]),
        ('```json\n[{"bbox_2d": [1, 2, 30, 40], "label": "couch"}]\n```', ["fenced_json"]),
        ('[{"bbox_2d": [1, 2, 30, 40], "label": "sofa"}]', ["unknown_label"]),
        ("There is a couch.", ["not_a_list"]),
        ('[{"bbox_2d": [30, 2, 1, 40], "label": "couch"}]', ["bad_box"]),
    ],
)
def test_each_answer_gets_its_reasons(tiny_tokenizer: Any, text: str, reasons: list[str]) -> None:
    assert classify_response(parse(tiny_tokenizer, text), VOCABULARY) == reasons


def test_truncated_and_over_long(tiny_tokenizer: Any) -> None:
    cut = parse(tiny_tokenizer, '[{"bbox_2d": [1, 2, 30, 40], "label": "couch"}, {"bbox', hit_max_tokens=True)
    assert classify_response(cut, VOCABULARY) == ["truncated"]
    whole = parse(tiny_tokenizer, "[]")
    assert classify_response(whole, VOCABULARY, over_long=True) == ["over_long"]
    assert classify_response(parse(tiny_tokenizer, '[{"bbox_2d": [1, 2, 3, 4], "label": "x"}]'), None) == []


def test_fenced_labels_reads_only_a_fenced_list() -> None:
    assert fenced_labels('```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "sofa"}]\n```') == ["sofa"]
    assert fenced_labels('[{"label": "sofa"}]') == []
    assert fenced_labels("```json\nnot json\n```") == []


def test_the_report_names_each_reason_with_its_fix_and_an_example() -> None:
    report = PreflightReport(
        records=4,
        valid=1,
        min_valid_fraction=0.5,
        reasons={"fenced_json": 3, "unknown_label": 2},
        examples={
            "fenced_json": {"record": "a", "answer": "```json"},
            "unknown_label": {"record": "b", "answer": "["},
        },
    )
    assert not report.passed and report.valid_fraction == 0.25
    text = report.summary()
    assert (
        "FAILED: 1 of 4" in text and "fenced_json: 3 records" in text and "unknown_label: 2 records" in text
    )
    assert "stage-1" in text and "{labels}" in text


@pytest.mark.heavy
def test_a_failed_preflight_stops_every_rank_with_the_report(make_config, tmp_path, free_port) -> None:
    """Two gloo ranks under torchrun, started from the untrained tiny model: rank 0's rollouts are not
    in the format, every rank stops (exit 2) with the report before the first step, none hangs."""
    import os
    import subprocess

    from rollmatch.config.load import config_to_yaml
    from rollmatch.launch.plan import torchrun_command

    cfg = make_config(
        {
            "preflight": {"records": 2, "min_valid_fraction": 0.5},
            "training": {"per_device_train_batch_size": 1, "max_steps": 2},
        }
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(config_to_yaml(cfg))
    entry = tmp_path / "train.py"
    entry.write_text("import sys\nfrom rollmatch.cli import main\nsys.exit(main(['train', sys.argv[1]]))\n")
    command = torchrun_command(2, free_port(), str(entry), str(cfg_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode != 0, done.stderr[-3000:]
    assert done.stderr.count("preflight.min_valid_fraction") >= 2, done.stderr[-3000:]  # both ranks
    assert "preflight FAILED: 0 of 2 rollouts valid" in done.stderr
    assert not (tmp_path / "out" / "final").exists()
