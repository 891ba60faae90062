"""tools/gpu_check.py where no GPU is: it refuses clearly (one JSON, exit 2), its arguments are checked,
and the parts that judge item results work. The items themselves run only on a GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_prints_one_json_and_exits_2() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    printed = json.loads(done.stdout)
    assert printed["ok"] is False and printed["items"] == {}
    assert "no CUDA device visible" in printed["error"] and "GPU machine" in printed["error"]


def test_arguments_are_checked() -> None:
    gpu_check = _module()
    assert gpu_check.parse_args([]).items == list(gpu_check.ITEMS)
    assert gpu_check.parse_args(["--items", "nccl_push_server_killed"]).items == ["nccl_push_server_killed"]
    for bad in (["--items", "nope"], ["--item-timeout-s", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def test_item_results_are_judged_from_the_items_process() -> None:
    gpu_check = _module()
    good = gpu_check.item_result(0, 'log line\n{"status": "pass", "figures": {"x": 1}}\n', "", 3.21)
    assert good == {"status": "pass", "figures": {"x": 1}, "seconds": 3.2}
    crashed = gpu_check.item_result(-6, "", "Fatal Python error: Aborted", 1.0)
    assert crashed["status"] == "fail" and "killed by SIGABRT" in crashed["why"]
    assert "Aborted" in crashed["log_tail"]
    silent = gpu_check.item_result(0, "no json here", "", 1.0)
    assert silent["status"] == "fail" and "exit code 0" in silent["why"]
    assert gpu_check.summarize({"a": {"status": "pass"}, "b": {"status": "unavailable"}})
    assert not gpu_check.summarize({"a": {"status": "pass"}, "b": {"status": "fail"}})
    assert not gpu_check.summarize({"a": {"status": "unavailable"}})  # nothing ran: not a pass


def test_the_nccl_item_says_why_it_cannot_run_without_two_gpus(tmp_path: Path) -> None:
    result = _module().nccl_push_server_killed(tmp_path)
    assert result["status"] == "unavailable" and "0 GPU(s)" in result["why"]
