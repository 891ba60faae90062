"""``data.coord_frame: auto``: resolved from the checkpoint's family, explicit values winning, shown by check-config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from resolved_runs import resolved_config

from rollmatch.cli import main
from rollmatch.config.frames import describe_coord_frame, fixed_coord_frame, resolve_coord_frame
from rollmatch.config.load import load_config
from rollmatch.errors import ConfigError


def _model_dir(root: Path, model_type: str) -> Path:
    folder = root / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    ("model_type", "frame"),
    [
        ("qwen2_vl", "norm1000"),
        ("qwen2_5_vl", "pixels"),
        ("qwen3_vl", "norm1000"),
        ("qwen3_vl_moe", "norm1000"),  # Qwen3-VL 30B-A3B / 235B-A22B
    ],
)
def test_auto_is_the_family_pretraining_frame(tmp_path: Path, model_type: str, frame: str) -> None:
    folder = _model_dir(tmp_path, model_type)
    assert load_config(None).data.coord_frame == "auto"  # the default
    assert resolve_coord_frame("auto", folder) == frame
    for explicit in ("norm1000", "pixels"):  # explicit values win
        assert resolve_coord_frame(explicit, folder) == explicit
    # coordinate tokens are a frame of their own (k/999 of the side), whatever the family
    assert resolve_coord_frame("auto", folder, object_format="coord_tokens") == "norm1000"


def test_unknown_family_or_missing_config_fails_asking_for_an_explicit_frame(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'llava'.*set data\.coord_frame: norm1000 or pixels"):
        resolve_coord_frame("auto", _model_dir(tmp_path, "llava"))
    with pytest.raises(ConfigError, match=r"model\.path.*or set data\.coord_frame explicitly"):
        resolve_coord_frame("auto", tmp_path / "nowhere")
    assert resolve_coord_frame("pixels", tmp_path / "nowhere") == "pixels"  # needs no checkpoint
    assert fixed_coord_frame("auto") is None and fixed_coord_frame("auto", "coord_tokens") == "norm1000"


def test_coord_tokens_rule_accepts_auto_and_refuses_pixels() -> None:
    custom = {"custom": {"object_format": "coord_tokens"}}
    assert resolved_config(custom).data.coord_frame == "auto"
    with pytest.raises(ConfigError, match=r"data\.coord_frame.*set data\.coord_frame: norm1000"):
        resolved_config({**custom, "data": {"coord_frame": "pixels"}})


def test_check_config_prints_the_resolved_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _model_dir(tmp_path, "qwen2_5_vl")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(folder)}}), encoding="utf-8")
    assert main(["check-config", "--schema-only", str(config)]) == 0
    out = capsys.readouterr()
    assert yaml.safe_load(out.out)["data"]["coord_frame"] == "auto"  # the config itself is unchanged
    assert f"resolved: data.coord_frame: auto -> pixels (model_type 'qwen2_5_vl' of {folder})" in out.err
    assert main(["check-config", "--schema-only", str(config), "data.coord_frame=norm1000"]) == 0
    assert "resolved: data.coord_frame: norm1000 (set explicitly)" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({"model": {"path": str(_model_dir(tmp_path, "llava"))}}))
    assert main(["check-config", "--schema-only", str(config)]) == 2
    assert "data.coord_frame = 'auto'" in capsys.readouterr().err
    # a model directory that does not exist yet (the demo builds it later) is no error
    assert "when the run starts" in describe_coord_frame("auto", tmp_path / "later")
