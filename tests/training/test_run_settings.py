"""Run settings travel with the weights: ``checkpoint-N/`` and ``final/`` hold ``rollmatch_run.json``
and the processor; ``rollmatch eval --model final/`` without ``--config`` scores what eval with the
config scores, on a coordinate-token model whose answers read as digits would score 0; a model with
coordinate tokens and no saved settings is refused, not decoded as digits; a resume with other answer
settings is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rollmatch.cli import main
from rollmatch.config.load import config_to_yaml
from rollmatch.config.run_file import RUN_FILE, read_run_file
from rollmatch.errors import ConfigError
from rollmatch.training.entry import run_training

pytestmark = pytest.mark.heavy

PROMPT = "Find the shapes ({labels}). Answer with a JSON list."


def eval_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") : out.rindex("}") + 1])


def test_eval_reads_the_saved_settings(
    make_config, coord_model_dir: Path, shapes_small: dict[str, Path], tmp_path: Path, capsys
) -> None:
    labels = sorted(
        {
            o["label"]
            for line in shapes_small["train"].read_text().splitlines()
            for o in json.loads(line)["objects"]
        }
    )
    cfg = make_config(
        {
            "model": {"path": str(coord_model_dir)},
            "data": {"prompt": PROMPT, "labels": labels, "min_pixels": 3136, "max_pixels": 12544},
            "custom": {"object_format": "coord_tokens", "trainer_variant": "sft"},
            "training": {
                "max_steps": 60,
                "save_steps": 30,
                "save_total_limit": 1,
                "learning_rate": 3e-3,
                "per_device_train_batch_size": 4,
            },
            "eval": {"max_new_tokens": 40},
        }
    )
    result = run_training(cfg)
    final = Path(result.final_model_dir)
    for folder in (final, Path(result.output_dir) / "checkpoint-60"):
        saved = read_run_file(folder)
        assert saved is not None, folder
        assert saved["settings"]["custom.object_format"] == "coord_tokens"
        assert saved["settings"]["data.labels"] == labels and saved["settings"]["data.prompt"] == PROMPT
        assert saved["settings"]["data.max_pixels"] == 12544 and saved["coord_tokens"]["bins"] == 1000
        assert (folder / "processor_config.json").is_file() and (folder / "tokenizer.json").is_file()
    config_path = tmp_path / "run.yaml"
    config_path.write_text(config_to_yaml(cfg))
    common = ["eval", "--model", str(final), "--data", str(shapes_small["val"]), "--backend", "hf"]
    with_config = eval_json(
        capsys, [*common, "--config", str(config_path), "--out", str(tmp_path / "a.jsonl")]
    )
    without = eval_json(capsys, [*common, "--out", str(tmp_path / "b.jsonl")])
    assert with_config["invalid"].get("bad_json", 0) == 0 and with_config["objects_per_image"] > 0
    for key in ("f1", "precision", "recall", "invalid", "objects_per_image", "unknown_labels"):
        assert without[key] == with_config[key], key
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()

    # The same weights without their settings: refused, not read as digits (which scored F1 0).
    bare = tmp_path / "bare"
    shutil.copytree(final, bare)
    (bare / RUN_FILE).unlink()
    assert main(["eval", "--model", str(bare), "--data", str(shapes_small["val"]), "--backend", "hf"]) == 2
    assert "custom.object_format" in capsys.readouterr().err

    # A resume that changes the prompt is refused, naming the key.
    changed = cfg.model_copy(deep=True)
    changed.data.prompt = "Another prompt {labels}"
    changed.training.resume_from_checkpoint = "latest"
    changed.training.max_steps = 10
    with pytest.raises(ConfigError, match=r"data\.prompt"):
        run_training(changed)
    assert yaml.safe_load(config_path.read_text())["data"]["prompt"] == PROMPT
