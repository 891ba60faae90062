"""Child processes of a launch: each in its own session, logging to its own file, torn down as a tree.

Owns: :class:`Child` (one started :class:`~rollmatch.launch.plan.ProcessSpec`: its process, exit
status and log tail), :func:`start_child`, the launch record ``pids.json`` (:func:`write_pids`: the
launcher and every process started; :func:`survivors`: which still run, the orphan check;
:func:`previous_launch`: what an earlier launch on the same output directory left) and
:func:`terminate_all` (SIGTERM to every process group of the tree, SIGKILL after a grace period).
Leaves out: deciding when to stop (``launch.supervisor``); stopping trees after the launcher died
(``launch.watchdog``).

Why whole trees: children start with ``start_new_session=True`` (setsid), so a Ctrl-C in the
launcher's terminal reaches only the launcher, which then stops everything in order. torchrun
starts its workers in sessions of their own too, so killing torchrun's group alone could orphan
them; the launcher therefore signals the groups of every descendant it can see.

Dying with the launcher: on Linux each child also asks the kernel for SIGTERM when the launcher dies
(``prctl(PR_SET_PDEATHSIG)``), so a launcher killed with SIGKILL does not leave servers holding devices
and ports; the watchdog (``launch.watchdog``) then stops their descendants and whatever ignores SIGTERM.
The kernel sends that signal when the *thread* that forked the child exits, not the process: so it is
armed only for children started from the main thread (the supervisor's), whose exit is the launcher's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from rollmatch.launch.plan import ProcessSpec
from rollmatch.launch.watchdog import process_alive

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    """Start ``spec`` in a new session; stdout and stderr go to its log file (created or truncated).

    From the main thread on Linux, the child gets SIGTERM when this process dies (see the module doc).
    """
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with spec.log_path.open("wb") as log:
        process = subprocess.Popen(
            list(spec.command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGTERM),
        )
    try:
        created = psutil.Process(process.pid).create_time()
    except psutil.NoSuchProcess:  # exited already; the supervisor reads its exit code
        created = time.time()
    return Child(spec, process, created)


def write_pids(
    path: Path, children: list[Child], seen: dict[int, list[dict[str, Any]]], *, finished: bool = False
) -> None:
    """Record this launcher (pid, start time), every child and every descendant seen so far (pid,
    process group, start time) as JSON; ``finished`` once the launcher's teardown is done.

    ``seen``: child pid -> descendant records, updated in place (processes that exited stay listed).
    The record is also the lock of the output directory: see :func:`previous_launch`.
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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    record = {**launcher_identity(), "finished": finished, "processes": records}
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)


def launcher_identity() -> dict[str, Any]:
    """This process as a launch record names it: pid and start time (a reused pid is not mistaken for it)."""
    me = psutil.Process()
    return {"launcher": me.pid, "launcher_create_time": me.create_time()}


@dataclass(frozen=True)
class PreviousLaunch:
    """What the launch record of an earlier launch on the same output directory says now."""

    launcher: int
    launcher_alive: bool
    finished: bool  # its launcher finished its teardown
    running: list[str]  # what it started and still runs (as :func:`survivors` names them)
    processes: list[dict[str, Any]]  # every process it recorded: pid, pgid, create_time

    @property
    def stale(self) -> bool:
        """Its launcher is gone without having finished its teardown, or left processes running."""
        return not self.launcher_alive and (not self.finished or bool(self.running))


def previous_launch(path: Path) -> PreviousLaunch | None:
    """The launch record at ``path``; None when there is none or it is unreadable (it gets overwritten).

    A record without the launcher's start time (written before it was recorded) counts its launcher
    alive while any process has its pid.
    """
    try:
        record = json.loads(path.read_text())
        launcher = int(record["launcher"])
        started = record.get("launcher_create_time")
        alive = process_alive(launcher, started) if started is not None else psutil.pid_exists(launcher)
        processes = [proc for entry in record["processes"] for proc in [entry, *entry["descendants"]]]
        return PreviousLaunch(
            launcher=launcher,
            launcher_alive=alive,
            finished=bool(record.get("finished", False)),
            running=survivors(record),
            processes=[
                {"pid": p["pid"], "pgid": p.get("pgid", p["pid"]), "create_time": p["create_time"]}
                for p in processes
            ],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def survivors(pids_record: dict[str, Any]) -> list[str]:
    """The processes of a ``pids.json`` record (children and every descendant seen) that still run."""
    alive = []
    for entry in pids_record["processes"]:
        for proc in [entry, *entry["descendants"]]:
            if process_alive(proc["pid"], proc["create_time"]):
                alive.append(f"{entry['name']}: pid {proc['pid']}")
    return alive


def _child_setup(sig: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn``: the child ignores SIGUSR1 (Slurm's warning may reach every process of a step;
    the launcher forwards it to the learner's ranks, which handle it, and nothing else may die of it:
    an ignored signal stays ignored across exec) and, where it can, gets ``sig`` when this process dies.

    libc is looked up before the fork: the child, a copy of a threaded process, only calls into it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    usr1, ignore = int(signal.SIGUSR1), ctypes.c_void_p(int(signal.SIG_IGN))
    # PDEATHSIG follows the forking thread: another thread's exit would fire it
    arm_death = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
    parent = os.getpid()

    def setup() -> None:
        libc.signal(usr1, ignore)
        if not arm_death:
            return
        libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)))
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os._exit(128 + int(sig))

    return setup


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
