"""``rollmatch_run.json``: versioned, read as a layer under the user's config (which overrides it),
compared on resume, and read by ``rollmatch serve`` for the flags left at their defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollmatch.cli import build_parser
from rollmatch.config.load import load_config
from rollmatch.config.run_file import RUN_FILE, changed_settings, read_run_file, run_layer, write_run_file
from rollmatch.errors import ConfigError

SAVED = {
    "rollmatch_run_version": 1,
    "trainer_variant": "rollout_matching_sft",
    "objective": "rollout_matching",
    "settings": {
        "custom.object_format": "coord_tokens",
        "data.coord_frame": "norm1000",
        "data.prompt": "Find {labels}.",
        "data.labels": ["cat", "dog"],
        "data.prompt_max_labels": None,
        "data.min_pixels": 3136,
        "data.max_pixels": 12544,
        "eval.max_new_tokens": 300,
        "training.seed": 3,
    },
    "coord_tokens": None,
}


def test_the_saved_settings_sit_under_the_config(tmp_path: Path) -> None:
    write_run_file(tmp_path, SAVED)
    saved = read_run_file(tmp_path)
    assert saved == SAVED
    under = [("saved", run_layer(saved))]
    cfg = load_config(None, under=under)
    assert cfg.custom.object_format == "coord_tokens" and cfg.data.labels == ["cat", "dog"]
    assert cfg.data.max_pixels == 12544 and cfg.eval.max_new_tokens == 300
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  max_pixels: 50176\n")
    overridden = load_config(config, ["eval.max_new_tokens=20"], under=under)
    assert overridden.data.max_pixels == 50176 and overridden.eval.max_new_tokens == 20
    assert overridden.data.prompt == "Find {labels}."  # the keys the config leaves alone stay saved


def test_a_newer_or_broken_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / RUN_FILE).write_text(json.dumps({**SAVED, "rollmatch_run_version": 99}))
    with pytest.raises(ConfigError, match="version 99"):
        read_run_file(tmp_path)
    (tmp_path / RUN_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_run_file(tmp_path)
    assert read_run_file(tmp_path / "absent") is None


def test_resume_names_each_changed_answer_setting() -> None:
    now = json.loads(json.dumps(SAVED))
    now["settings"]["data.prompt"] = "Other."
    now["settings"]["training.seed"] = 4  # not an answer setting
    (problem,) = changed_settings(SAVED, now)
    assert problem.key == "data.prompt" and "Find {labels}." in problem.fix


def test_serve_takes_the_saved_pixels_and_frame_unless_a_flag_is_given(tmp_path: Path) -> None:
    from rollmatch.server.serve import apply_saved_run_settings

    write_run_file(tmp_path, SAVED)
    args = build_parser().parse_args(["serve", "--model", str(tmp_path)])
    apply_saved_run_settings(args)
    assert (args.min_pixels, args.max_pixels, args.coord_frame) == (3136, 12544, "norm1000")
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--max-pixels", "6272"])
    apply_saved_run_settings(args)
    assert args.max_pixels == 6272
