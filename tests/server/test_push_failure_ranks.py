"""A weight push that fails on rank 0 for a reason that is not a ``RollmatchError`` (a DNS error, a
server's answer that does not parse): every rank of a real 2-rank gloo job hears the cause within
seconds, instead of the other rank waiting out the collective timeout."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.launch.plan import torchrun_command

pytestmark = pytest.mark.heavy
REPO = Path(__file__).resolve().parents[2]
COLLECTIVE_TIMEOUT_S = 40.0
HEARD_WITHIN_S = 15.0  # far below the collective timeout, generous on a loaded machine


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        ("dns", "gaierror: [Errno -2] Name or service not known"),
        ("answer", "ValueError: invalid literal for int() with base 10: 'many (injected)'"),
    ],
)
def test_a_push_that_fails_on_rank_0_for_any_reason_fails_every_rank_with_the_cause(
    fault: str,
    cause: str,
    hf_sync_server: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    free_port: Callable[[], int],
) -> None:
    worker = REPO / "tests" / "server" / "push_failure_worker.py"
    args = (
        str(tiny_model_dir),
        hf_sync_server.url,
        str(free_port()),
        str(tmp_path),
        str(COLLECTIVE_TIMEOUT_S),
    )
    run = subprocess.run(
        torchrun_command(2, free_port(), str(worker), *args),
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), ROLLMATCH_TEST_FAULT=fault),
    )
    output = (run.stdout + run.stderr)[-4000:]
    outcomes = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    # rank 0 raises the cause, attributed to the server whose group it could not form
    assert outcomes[0]["outcome"].startswith(f"ServerPushFailed: rollout server {hf_sync_server.url}: "), (
        outcomes,
        output,
    )
    assert cause in outcomes[0]["outcome"], outcomes
    assert outcomes[1]["outcome"].startswith("SyncError: rank 0's weight push of version 1 failed: "), (
        outcomes,
        output,
    )
    assert cause in outcomes[1]["outcome"], outcomes
    assert all(o["seconds"] < HEARD_WITHIN_S for o in outcomes.values()), outcomes
