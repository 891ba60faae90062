"""Two (or more) real gloo ranks forked from the test process, for tests about our distributed logic.

``torchrun`` starts an agent and one fresh interpreter per rank, each importing torch and
transformers again (seconds each on a 2-core machine). Where a test is about what our code does
across ranks, not about torchrun, :func:`run_forked_ranks` forks the ranks from the already-imported
test process instead: each child gets the environment torchrun would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free port), runs ``target(rank)``
and exits with 0, or 1 after printing its traceback. The launcher's tests keep real ``torchrun``.

Forking a process that has run OpenMP regions with several threads can hang the child; the suite
runs with ``OMP_NUM_THREADS=1`` (tests/conftest.py), which this checks.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

from local_ports import free_tcp_port


def run_forked_ranks(
    target: Callable[[int], None], *, world_size: int = 2, timeout_s: float = 280.0, check: bool = True
) -> dict[int, int | None]:
    """Run ``target(rank)`` in ``world_size`` forked ranks; return each rank's exit code (``None``:
    still running after ``timeout_s``, then killed). ``check``: raise naming every rank that did not
    exit 0 instead (a rank's traceback goes to its stderr, which pytest captures)."""
    assert os.environ.get("OMP_NUM_THREADS") == "1", "forked ranks need OMP_NUM_THREADS=1 (see module doc)"
    port = free_tcp_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the rank: never returns into pytest
            code = 1
            try:
                os.environ.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    GROUP_RANK="0",
                    WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(world_size),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
                target(rank)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[rank] = pid
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int | None] = dict.fromkeys(pids)
    while any(code is None for code in codes.values()) and time.monotonic() < deadline:
        for rank, pid in pids.items():
            if codes[rank] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for rank, pid in pids.items():
        if codes[rank] is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    failed = {rank: code for rank, code in codes.items() if code != 0}
    assert not (check and failed), (
        f"forked ranks failed (rank: exit code, None = still running after {timeout_s:g}s and killed): "
        f"{failed}; their tracebacks are in the captured output"
    )
    return codes
