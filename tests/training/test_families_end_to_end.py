"""Every family from its real processor configuration, as a downloaded checkpoint is used:
``check-config`` shows the frame ``auto`` resolves to, one training step, then ``rollmatch eval``'s
path with no frame set (docs/models.md, "Use a downloaded checkpoint")."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollmatch.cli import main
from rollmatch.config.load import load_config
from rollmatch.data.records import load_records
from rollmatch.evaluation import run_eval
from rollmatch.training.entry import run_training

FAMILY_FRAMES = {"qwen2_vl": "norm1000", "qwen2_5_vl": "pixels", "qwen3_vl": "norm1000"}


@pytest.mark.heavy
@pytest.mark.parametrize("family", sorted(FAMILY_FRAMES))
def test_check_config_one_step_and_eval_per_family(
    family: str,
    tiny_model_dirs: dict[str, Path],
    shapes_small: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model_dir = tiny_model_dirs[family]
    config = tmp_path / "run.yaml"
    raw = {
        "model": {"path": str(model_dir)},
        "data": {"train_jsonl": str(shapes_small["train"]), "val_jsonl": None, "max_samples": 2},
        "custom": {
            "trainer_variant": "sft",
            "extra": {"rollout_matching": {"rollout_backend": "hf", "max_new_tokens": 8}},
        },
        "eval": {"max_samples": 2, "max_new_tokens": 8},
        "training": {
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 2,
            "max_steps": 1,
            "report_to": [],
            "save_steps": 1000,
            "global_max_length": 1024,
        },
    }
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert main(["check-config", str(config)]) == 0
    assert (
        f"data.coord_frame: auto -> {FAMILY_FRAMES[family]} (model_type '{family}'" in capsys.readouterr().err
    )
    cfg = load_config(config)
    result = run_training(cfg)
    final = Path(result.final_model_dir)
    assert (final / "config.json").is_file()
    evaluated = load_config(config, [f"model.path={final}"])  # as `rollmatch eval --model DIR` does
    out = run_eval(evaluated, load_records(shapes_small["val"]), str(tmp_path / "predictions.jsonl"))
    assert out.num_samples == 2
