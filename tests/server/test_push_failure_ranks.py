"""A weight push that fails on rank 0 for a reason that is not a ``RollmatchError`` (a DNS error, a
server's answer that does not parse): every rank of a real 2-rank gloo job hears the cause within
seconds, instead of the other rank waiting out the collective timeout."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fork_ranks import run_forked_ranks

pytestmark = pytest.mark.heavy
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
    import push_failure_worker

    group_port = free_port()  # one group for both ranks

    def rank_main(rank: int) -> None:  # the worker's main in each forked rank; it leaves with os._exit
        os.environ["ROLLMATCH_TEST_FAULT"] = fault
        push_failure_worker.main(
            str(tiny_model_dir), hf_sync_server.url, group_port, tmp_path, COLLECTIVE_TIMEOUT_S
        )

    codes = run_forked_ranks(rank_main, timeout_s=300, check=False)
    output = f"rank exit codes {codes}; their tracebacks are in the captured output"
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
