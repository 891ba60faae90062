"""Two (or more) real gloo ranks forked from the test process, for tests about our distributed logic.

``torchrun`` starts an agent and one fresh interpreter per rank, each importing torch and
transformers again (seconds each on a 2-core machine). Where a test is about what our code does
across ranks, not about torchrun, :func:`run_forked_ranks` forks the ranks from the already-imported
test process instead: each child gets the environment torchrun would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free port), runs ``target(rank)``
and exits with 0, or 1 after printing its traceback. The launcher's tests keep real ``torchrun``.
:func:`train_in_forked_ranks` runs ``rollmatch train CONFIG`` so, each rank's output in its own log
file (the layout ``torchrun --log-dir`` writes: ``<log_dir>/<rank>/...log``).

Forking a process that has run OpenMP regions with several threads can hang the child; the suite
runs with ``OMP_NUM_THREADS=1`` (tests/conftest.py), which this checks.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from local_ports import free_tcp_port

# Called before forking while the test process is in a process group: each closes what holds one (the
# in-process vLLM engines of a test folder register their close here, e.g. tests/server/conftest.py).
BEFORE_FORK: list[Callable[[], None]] = []


def _leave_process_group() -> None:
    """An in-process vLLM engine starts a one-process gloo world in the test process: inherited by a
    forked rank, it would be that rank's world (or refuse the rank's own), and cannot be torn down in
    the child. Close the engines that hold it first (a later test starts them again)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    for close in BEFORE_FORK:
        close()
    assert not dist.is_initialized(), (
        "the test process is in a torch.distributed process group that forked ranks would inherit; "
        "register the close of what holds it in fork_ranks.BEFORE_FORK"
    )


def run_forked_ranks(
    target: Callable[[int], None], *, world_size: int = 2, timeout_s: float = 280.0, check: bool = True
) -> dict[int, int | None]:
    """Run ``target(rank)`` in ``world_size`` forked ranks; return each rank's exit code (``None``:
    still running after ``timeout_s``, then killed). ``check``: raise naming every rank that did not
    exit 0 instead (a rank's traceback goes to its stderr, which pytest captures)."""
    ranks = ForkedRanks(target, world_size=world_size)
    try:
        return ranks.wait(timeout_s, check=check)
    finally:
        ranks.kill()  # a test interrupted while it waits (its own timeout) leaves no rank behind


class ForkedRanks:
    """``world_size`` ranks forked now, each running ``target(rank)``; :meth:`wait` collects them (a
    test that acts while the ranks run, e.g. kills a server under them, waits afterwards)."""

    def __init__(self, target: Callable[[int], None], *, world_size: int = 2, rank_env: bool = True):
        assert os.environ.get("OMP_NUM_THREADS") == "1", (
            "forked ranks need OMP_NUM_THREADS=1 (see module doc)"
        )
        _leave_process_group()
        port = free_tcp_port()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int | None] = {}
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:  # the rank: never returns into pytest
                code = 1
                try:
                    if rank_env:
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
            self.pids[rank] = pid
            self.codes[rank] = None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to every rank still running."""
        self.running()
        for rank, pid in self.pids.items():
            if self.codes[rank] is None:
                os.kill(pid, sig)

    def running(self) -> bool:
        """Whether any rank still runs (collects the exit codes of those that ended)."""
        for rank, pid in self.pids.items():
            if self.codes[rank] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[rank] = os.waitstatus_to_exitcode(status)
        return any(code is None for code in self.codes.values())

    def wait(self, timeout_s: float, *, check: bool = True) -> dict[int, int | None]:
        """Each rank's exit code once all ended (``None``: still running after ``timeout_s``, then
        killed); ``check``: raise naming every rank that did not exit 0 instead."""
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill()
        failed = {rank: code for rank, code in self.codes.items() if code != 0}
        assert not (check and failed), (
            f"forked ranks failed (rank: exit code, None = still running after {timeout_s:g}s and killed): "
            f"{failed}; their tracebacks are in the captured output"
        )
        return dict(self.codes)

    def kill(self) -> None:
        """Kill every rank still running (its exit code stays ``None``)."""
        self.running()
        for rank, pid in self.pids.items():
            if self.codes[rank] is None:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def train_in_forked_ranks(config_path: Path, log_dir: Path, *, world_size: int = 2) -> ForkedRanks:
    """``rollmatch train config_path`` (the CLI's own entry) in ``world_size`` forked ranks, each
    writing its stdout and stderr to ``log_dir/<rank>/output.log``; a rank exits 0, or 1 when the
    command failed (its exit code or traceback is in its log). ``world_size`` 0: one process without
    the ranks' environment, as a plain ``rollmatch train`` runs."""
    # Imported once here, not in every rank (the ranks share these pages until they write them).
    import transformers

    import rollmatch.cli
    import rollmatch.training.entry

    _ = (transformers.AutoModelForImageTextToText, transformers.AutoProcessor, rollmatch.training.entry)

    def rank_main(rank: int) -> None:
        folder = log_dir / str(rank)
        folder.mkdir(parents=True, exist_ok=True)
        log = os.open(folder / "output.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (the rank's own stdout)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        logging.root.handlers.clear()  # the test process's capture handlers: the command logs to stderr
        code = rollmatch.cli.main(["train", str(config_path)])
        if code != 0:
            raise SystemExit(f"rollmatch train exited with {code}")

    return ForkedRanks(rank_main, world_size=world_size or 1, rank_env=world_size > 0)
