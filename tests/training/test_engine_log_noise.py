"""A short rollout-matching run on the in-process vLLM engine prints each kind of engine line at
most once: no per-sync INFO lines, the per-generate CPU warning once, repeats summarised."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rollmatch.config.load import config_to_yaml
from rollmatch.rollout.engine_logs import REPEAT_MARK, RepeatedLines

REPO = Path(__file__).resolve().parents[2]
# vLLM's format: "(EngineCore_DP0 pid=123) INFO 11-26 20:50:01 [file.py:123] message" (ANSI colours removed)
VLLM_LINE = re.compile(
    r"^(?:\S*\([^)]*\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\] (.*)$"
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def engine_lines(log: str) -> list[tuple[str, str]]:
    """``(level, message)`` of every vLLM log line in ``log``."""
    return [m.groups() for m in map(VLLM_LINE.match, ANSI.sub("", log).splitlines()) if m]


def test_engine_line_pattern_matches_vllm_format() -> None:
    sample = "(MainProcess pid=4242) WARNING 11-26 20:50:01 [cpu_worker.py:140] CPU backend doesn't allow"
    assert engine_lines(sample + "\nplain line") == [("WARNING", "CPU backend doesn't allow")]


def test_repeated_lines_pass_once_and_are_counted() -> None:
    repeats = RepeatedLines()
    logger = logging.getLogger("vllm.test_engine_logs")
    records = [
        logger.makeRecord(logger.name, logging.WARNING, "f.py", 1, "skip %s", ("it",), None) for _ in range(3)
    ]
    other = logger.makeRecord(logger.name, logging.INFO, "f.py", 2, "loaded", (), None)
    assert [repeats.filter(r) for r in [*records, other]] == [True, False, False, True]
    assert records[0].getMessage() == f"skip it{REPEAT_MARK}"
    assert repeats.summary() == ["engine log: 2 more WARNING line(s) like 'skip %s' hidden"]


@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_short_vllm_run_repeats_no_engine_line(make_config, tmp_path: Path) -> None:
    cfg = make_config(
        {
            "custom": {
                "extra": {
                    "rollout_matching": {
                        "rollout_backend": "vllm",
                        "vllm": {
                            "mode": "colocate",
                            "tensor_parallel_size": 1,
                            "enforce_eager": True,
                            "kv_cache_space_gib": 0.25,
                        },
                    }
                }
            },
            "training": {"max_steps": 3, "eval_strategy": "no"},
        }
    )
    path = tmp_path / "run.yaml"
    path.write_text(config_to_yaml(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "ROLLMATCH_VERBOSE")}
    done = subprocess.run(
        [sys.executable, "-m", "rollmatch.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=REPO,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    engine = engine_lines(log)
    repeated = {line: n for line, n in Counter(engine).items() if n > 1}
    assert repeated == {}, repeated
    assert all(level != "INFO" for level, _ in engine), engine
    assert "Reloading and processing weights took" not in log
    assert "Successfully reset prefix cache" not in log
