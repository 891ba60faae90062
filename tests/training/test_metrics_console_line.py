"""The console gets one short metrics line every ``training.logging_steps``, not HF's dict of every metric;
metrics.jsonl keeps them all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollmatch.config.load import load_config
from rollmatch.training.console import metrics_line
from rollmatch.training.entry import run_training


def test_metrics_line_shows_the_watched_metrics_only() -> None:
    logs = {"loss": 0.8234, "learning_rate": 1e-5, "grad_norm": 1.5, "match/f1": 0.41, "packing/rows": 3.0}
    assert metrics_line(120, 1000, logs) == "step 120/1000 | loss 0.8234 | lr 1e-05 | grad_norm 1.5 | f1 0.41"
    end = {"train_runtime": 12.34, "train_loss": 0.5, "train_samples_per_second": 3.0}
    assert metrics_line(4, 4, end) == "end of training at step 4 | train_loss 0.5 | runtime 12.3s"


def test_logging_steps_default_is_ten() -> None:
    assert load_config(None).training.logging_steps == 10


@pytest.mark.heavy
def test_training_prints_one_line_per_log_interval(make_config: Any, tmp_path: Path, capfd) -> None:
    cfg = make_config({"training": {"max_steps": 4, "logging_steps": 2}})
    run_training(cfg)
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert all("loss " in line and "f1 " in line for line in lines)
    assert (
        sum(1 for line in out.splitlines() if line.startswith("end of training at step 4 | train_loss ")) == 1
    )
    assert "'packing/rows'" not in out and "{'loss'" not in out  # HF's dict of every metric is gone
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("packing/rows" in entry for entry in logged)  # ... every metric is still in metrics.jsonl
