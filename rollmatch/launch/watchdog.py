"""The launch watchdog: a tiny process that stops a launch's process trees when the launcher dies first.

Owns: :class:`Watchdog` (the launcher's side: start the watcher, tell it every process to guard, close
the pipe after teardown), the watcher itself (:func:`main`, run as a script) and :func:`stop_trees`
(SIGTERM to recorded processes, their descendants and every process group they lead or belong to,
SIGKILL after a grace period), which ``rollmatch launch`` also uses to stop what a dead launcher left.
Leaves out: the normal teardown of a live launcher (``launch.processes.terminate_all``).

Why a watcher: children run in sessions of their own (Ctrl-C reaches only the launcher) and torchrun
starts its workers in sessions of their own too, so a launcher killed with SIGKILL takes nobody with
it. Each child also gets SIGTERM from the kernel when the launcher dies (``PR_SET_PDEATHSIG``, set in
``launch.processes``), which stops cooperative children, but not their own-session descendants once
the child is gone, nor a child that ignores SIGTERM. The watcher reads one JSON line per guarded
process from a pipe whose write end only the launcher holds; end of file means the launcher has
exited: it then stops whatever of the guarded trees still runs (after a clean teardown: nothing) and
exits. It runs in a session of its own, so a signal to the launcher's process group spares it.

Runs as ``python -P .../watchdog.py`` without importing the ``rollmatch`` package (no torch, starts in
milliseconds): this file imports only the standard library and psutil.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import psutil

_POLL_S = 0.2
_KILL_WAIT_S = 5.0
_CLEAN = "clean"  # the launcher's last line after its own teardown


class Watchdog:
    """The launcher's handle on its watcher process; its log goes to ``log_path``."""

    def __init__(self, log_path: Path, grace_s: float):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        script = str(Path(__file__).resolve())
        pids = ["--launcher", str(os.getpid()), "--spare-group", str(os.getpgid(0))]
        command = [sys.executable, "-P", script, *pids, "--grace-s", str(grace_s)]
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.log_path = log_path
        self._sent: set[tuple[int, float]] = set()

    def guard(self, record: Mapping[str, Any]) -> bool:
        """Guard a process (``pid``, ``create_time``, ``pgid``); False if the watcher is gone."""
        key = (record["pid"], record["create_time"])
        if key in self._sent:
            return True
        line = {k: record[k] for k in ("pid", "create_time", "pgid")}
        if not self._send(json.dumps(line)):
            return False
        self._sent.add(key)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """After the launcher's own teardown: the watcher stops anything left, then exits."""
        self._send(_CLEAN)
        with contextlib.suppress(OSError):
            self._stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_s)

    @property
    def _stdin(self) -> IO[bytes]:
        assert self.process.stdin is not None
        return self.process.stdin

    def _send(self, line: str) -> bool:
        try:
            self._stdin.write(line.encode() + b"\n")
            self._stdin.flush()
        except (OSError, ValueError):  # the watcher died (broken pipe) or the pipe is closed
            return False
        return True


def stop_trees(
    records: Iterable[Mapping[str, Any]],
    grace_s: float,
    say: Callable[[str], None],
    *,
    spare_groups: Iterable[int] = (),
    leaderless_groups: bool = False,
) -> list[int]:
    """Stop every recorded process that still runs (same ``pid`` and ``create_time``), its descendants and
    the members of every process group they belong to: SIGTERM, then SIGKILL after ``grace_s``.

    ``leaderless_groups``: also the members of a recorded ``pgid`` whose leader has exited (a server's
    engine processes after the server died). Only for records of processes that ran moments ago: once
    such a group is empty, its number may name a stranger's group. Never signals this process's own
    group nor ``spare_groups``. Returns the pids that had to be killed.
    """
    records = list(records)
    spare = {os.getpgid(0), *spare_groups}
    found: dict[int, psutil.Process] = {}
    groups: set[int] = set()

    def collect() -> list[psutil.Process]:
        return _collect(records, found, groups, spare, leaderless_groups=leaderless_groups)

    running = collect()
    if not running:
        return []
    say(
        f"stopping pid(s) {_pids(running)} (process group(s) {', '.join(map(str, sorted(groups)))}): "
        f"SIGTERM, SIGKILL after {grace_s:.0f}s"
    )
    # SIGTERM once per process and group: a second one may force a hard exit (uvicorn, torchrun).
    termed_pids: set[int] = set()
    termed_groups: set[int] = set()

    def terminate(procs: list[psutil.Process]) -> None:
        _signal([p for p in procs if p.pid not in termed_pids], groups - termed_groups, signal.SIGTERM)
        termed_pids.update(p.pid for p in procs)
        termed_groups.update(groups)

    terminate(running)
    deadline = time.monotonic() + grace_s
    while running and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        running = collect()
        terminate(running)  # what started meanwhile
    if not running:
        return []
    stubborn = sorted(p.pid for p in running)
    say(f"killing pid(s) {_pids(running)} (SIGKILL): still running after {grace_s:.0f}s")
    deadline = time.monotonic() + _KILL_WAIT_S
    while running and time.monotonic() < deadline:
        _signal(running, groups, signal.SIGKILL)
        time.sleep(_POLL_S)
        running = collect()
    if running:
        say(f"pid(s) {_pids(running)} survived SIGKILL (uninterruptible sleep?)")
    return stubborn


def process_alive(pid: int, create_time: float) -> bool:
    """True if the recorded process (same pid and start time) still runs (zombies count as gone)."""
    return _same_process(pid, create_time) is not None


def main(argv: list[str] | None = None) -> int:
    """The watcher: guard what the launcher sends; at end of file stop what is left."""
    parser = argparse.ArgumentParser(description="rollmatch launch watchdog (started by `rollmatch launch`)")
    parser.add_argument("--launcher", type=int, required=True)
    parser.add_argument("--spare-group", type=int, required=True)
    parser.add_argument("--grace-s", type=float, required=True)
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):  # only the launcher's exit ends the watch
        signal.signal(sig, signal.SIG_IGN)
    records: list[dict[str, Any]] = []
    clean = False
    for line in sys.stdin:
        if line.strip() == _CLEAN:
            clean = True
        elif line.strip():
            with contextlib.suppress(ValueError):  # a torn line: the launcher died while writing it
                records.append(json.loads(line))
    if not clean:
        _say(f"launcher pid {args.launcher} exited without stopping its processes")
    stop_trees(records, args.grace_s, _say, spare_groups=[args.spare_group], leaderless_groups=True)
    return 0


# ------------------------------------------------------------------------------------ private helpers
def _collect(
    records: list[Mapping[str, Any]],
    found: dict[int, psutil.Process],
    groups: set[int],
    spare: set[int],
    *,
    leaderless_groups: bool,
) -> list[psutil.Process]:
    """Add to ``found`` / ``groups`` what runs now; the running processes found so far.

    The group of a process found is ours too: no process joins a group of another session, and the
    kernel hands out no pid that names a group with members.
    """
    for record in records:
        proc = _same_process(record["pid"], record["create_time"])
        if proc is not None:
            found.setdefault(proc.pid, proc)
        leader = record.get("pgid", record["pid"])
        if leaderless_groups and _leader_exited(leader):
            groups.add(leader)
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            for descendant in proc.children(recursive=True):
                found.setdefault(descendant.pid, descendant)
    for proc in found.values():
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(proc.pid))
    groups.difference_update(spare)
    if groups:
        for proc in psutil.process_iter():
            with contextlib.suppress(OSError):
                if os.getpgid(proc.pid) in groups:
                    found.setdefault(proc.pid, proc)
    found.pop(os.getpid(), None)
    return [proc for proc in found.values() if _running(proc)]


def _same_process(pid: int, create_time: float) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass  # exited (or not ours to see)
    return None


def _leader_exited(pgid: int) -> bool:
    """True if no process has the pid ``pgid``, or a zombie has it."""
    try:
        return psutil.Process(pgid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(procs: list[psutil.Process], groups: set[int], sig: signal.Signals) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    for proc in procs:  # send_signal checks the pid still names the same process
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def _pids(procs: list[psutil.Process]) -> str:
    return ", ".join(str(p.pid) for p in sorted(procs, key=lambda p: p.pid))


def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [watchdog {os.getpid()}] {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
