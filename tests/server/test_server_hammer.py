"""A short run of ``bench/server_hammer.py``: a real server under every adversarial case answers each
``/health/`` probe within the bound (the ReDoS and big sync bodies froze it for seconds before)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "server_hammer.py"


@pytest.mark.heavy
@pytest.mark.integration  # a server, its hammer and a prober process, timed: not beside another test
def test_health_stays_within_its_bound_under_the_hammer() -> None:
    command = [sys.executable, str(BENCH), "--workers", "2", "--requests", "2", "--case-seconds", "10"]
    command += [
        "--scale",
        "0.25",
        "--bound-health-s",
        "1.0",
    ]  # a loaded CI machine: twice the documented bound
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["cases"]) >= {"redos", "tiny_values", "big_sync", "padded_images"}
    for name, case in result["cases"].items():
        assert case["health_failures"] == 0 and case["health_max_s"] <= 1.0, (name, case)
        assert not any(status.startswith("5") for status in case["statuses"]), (name, case)
    assert result["ok"] and done.returncode == 0, done.stderr[-3000:]
