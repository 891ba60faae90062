"""Child processes of a launch: each in its own session, logging to its own file, torn down as a tree.

Owns: :class:`Child` (one started :class:`~rollmatch.launch.plan.ProcessSpec`: its process, exit
status and log tail), :func:`start_child`, :func:`write_pids` / :func:`survivors` (the record of every
process started, and which of them still run: the orphan check) and :func:`terminate_all` (SIGTERM to
every process group of the tree, SIGKILL after a grace period). Leaves out: deciding when to stop (``launch.supervisor``).

Why whole trees: children start with ``start_new_session=True`` (setsid), so a Ctrl-C in the
launcher's terminal reaches only the launcher, which then stops everything in order. torchrun
starts its workers in sessions of their own too, so killing torchrun's group alone could orphan
them; the launcher therefore signals the groups of every descendant it can see.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from rollmatch.launch.plan import ProcessSpec


@dataclass
class Child:
    """A started process of the plan."""

    spec: ProcessSpec
    process: subprocess.Popen[bytes]
    create_time: float

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        """None while running; a negative code is the signal that ended it."""
        return self.process.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log {self.spec.log_path} unreadable: {exc})"
        kept = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
        return "\n".join(kept[-lines:])

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []


def start_child(spec: ProcessSpec) -> Child:
    """Start ``spec`` in a new session; stdout and stderr go to its log file (created or truncated)."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with spec.log_path.open("wb") as log:
        process = subprocess.Popen(
            list(spec.command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,
        )
    try:
        created = psutil.Process(process.pid).create_time()
    except psutil.NoSuchProcess:  # exited already; the supervisor reads its exit code
        created = time.time()
    return Child(spec, process, created)


def write_pids(path: Path, children: list[Child], seen: dict[int, list[dict[str, Any]]]) -> None:
    """Record every child and every descendant seen so far (pid, process group, start time) as JSON.

    ``seen``: child pid -> descendant records, updated in place (processes that exited stay listed).
    """
    records = []
    for child in children:
        known = {d["pid"] for d in seen.setdefault(child.pid, [])}
        for proc in child.descendants():
            with contextlib.suppress(psutil.Error, ProcessLookupError):  # it may exit meanwhile
                if proc.pid not in known:
                    seen[child.pid].append(_record(proc))
        records.append(
            {
                "name": child.spec.name,
                "pid": child.pid,
                "pgid": child.pid,  # start_new_session: the child leads its own group
                "create_time": child.create_time,
                "log": str(child.spec.log_path),
                "descendants": seen[child.pid],
            }
        )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"launcher": os.getpid(), "processes": records}, indent=2))
    os.replace(tmp, path)


def terminate_all(children: list[Child], grace_s: float) -> list[str]:
    """SIGTERM every process group of every child's tree; SIGKILL what is left after ``grace_s``.

    Returns the names of the children that had to be killed. Never signals the launcher's own group.
    Direct children are waited for through ``Popen`` only, so their exit codes stay readable.
    """
    heads: dict[str, psutil.Process] = {}
    descendants: list[psutil.Process] = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            heads[child.spec.name] = psutil.Process(child.pid)
        descendants.extend(child.descendants())
    _signal_groups([*heads.values(), *descendants], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
    killed = [c.spec.name for c in children if c.exit_code() is None]
    stubborn = [heads[name] for name in killed if name in heads]
    if alive or stubborn:
        _signal_groups(alive + stubborn, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=5.0)  # reap: no zombie children
    psutil.wait_procs(alive, timeout=5.0)
    return killed


def process_alive(pid: int, create_time: float) -> bool:
    """True if the recorded process (same pid and start time) still runs (zombies count as gone)."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(pids_record: dict[str, Any]) -> list[str]:
    """The processes of a ``pids.json`` record (children and every descendant seen) that still run."""
    alive = []
    for entry in pids_record["processes"]:
        for proc in [entry, *entry["descendants"]]:
            if process_alive(proc["pid"], proc["create_time"]):
                alive.append(f"{entry['name']}: pid {proc['pid']}")
    return alive


def _record(proc: psutil.Process) -> dict[str, Any]:
    return {"pid": proc.pid, "pgid": os.getpgid(proc.pid), "create_time": proc.create_time()}


def _signal_groups(procs: list[psutil.Process], sig: signal.Signals) -> None:
    own_group = os.getpgid(0)
    groups: set[int] = set()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            groups.add(os.getpgid(proc.pid))
    for group in groups - {own_group}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    for proc in procs:  # a descendant that joined the launcher's group gets the signal directly
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
