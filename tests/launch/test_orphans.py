"""A launcher that dies without its teardown (SIGKILL) takes its children with it, and the next launch
on the same output directory takes the stale record over.

Real processes throughout: a stand-in launcher (a python process that starts children the way the
supervisor does) is SIGKILLed, then every child, descendant and process group must be gone. The
end-to-end test does the same to ``rollmatch launch`` itself (server + 2-rank torchrun learner).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from rollmatch.errors import LaunchError
from rollmatch.launch.command import claim_launch_dir
from rollmatch.launch.processes import previous_launch, process_alive
from rollmatch.launch.watchdog import stop_trees

# Launches, process trees and their watchdogs: the integration tier (tests/conftest.py).
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0

# Like torchrun: ignores SIGTERM itself and starts a worker in a session of its own (which ignores it too).
STUBBORN_TREE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('worker up', flush=True); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)
print('tree up', flush=True)
time.sleep(600)
"""
SLEEPER = "import time; print('up', flush=True); time.sleep(600)"

# A stand-in launcher: starts children as the supervisor does (start_child; with the watchdog
# if asked), prints their records, then waits to be killed.
STAND_IN = """
import json, sys, time
from pathlib import Path
from rollmatch.launch.plan import ProcessSpec
from rollmatch.launch.processes import start_child
from rollmatch.launch.watchdog import Watchdog

out, with_watchdog, scripts = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
watchdog = Watchdog(out / "watchdog.log", grace_s=1.0) if with_watchdog else None
records = []
for index, script in enumerate(scripts):
    spec = ProcessSpec("server", index, (sys.executable, "-c", script), {}, out / f"server-{index}.log")
    child = start_child(spec)
    records.append({"pid": child.pid, "create_time": child.create_time, "pgid": child.pid})
    if watchdog is not None:
        watchdog.guard(records[-1])
print(json.dumps(records), flush=True)
time.sleep(600)
"""


def test_children_get_sigterm_when_the_launcher_is_killed(tmp_path: Path) -> None:
    [child] = _kill_stand_in(tmp_path, [SLEEPER], with_watchdog=False)  # PR_SET_PDEATHSIG alone
    _assert_gone([child], "the child of a SIGKILLed launcher")


def test_the_watchdog_stops_a_tree_that_ignores_sigterm_when_the_launcher_is_killed(tmp_path: Path) -> None:
    records = _kill_stand_in(tmp_path, [STUBBORN_TREE, SLEEPER], with_watchdog=True, wait_for="worker up")
    _assert_gone(records, "the trees of a SIGKILLed launcher")
    log = (tmp_path / "watchdog.log").read_text()
    assert "exited without stopping its processes" in log and "killing pid(s)" in log, log


def test_stop_trees_reaches_descendants_in_sessions_of_their_own(tmp_path: Path) -> None:
    tree = subprocess.Popen(
        [sys.executable, "-c", STUBBORN_TREE], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        # both print to the pipe (the worker inherits it), in whichever order the machine runs them
        assert tree.stdout is not None
        assert {tree.stdout.readline(), tree.stdout.readline()} == {b"tree up\n", b"worker up\n"}
        _wait_until(lambda: len(psutil.Process(tree.pid).children()) == 1, "the worker")
        [worker] = psutil.Process(tree.pid).children()
        record = {"pid": tree.pid, "create_time": psutil.Process(tree.pid).create_time(), "pgid": tree.pid}
        said: list[str] = []
        killed = stop_trees([record], grace_s=0.5, say=said.append)
        assert sorted(killed) == sorted([tree.pid, worker.pid])  # both ignored SIGTERM
        assert tree.wait(timeout=5) == -signal.SIGKILL
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert said[0].startswith(f"stopping pid(s) {min(tree.pid, worker.pid)}")
    finally:
        tree.kill()
        tree.wait()


def test_members_of_a_group_whose_leader_exited_are_stopped_only_when_asked(tmp_path: Path) -> None:
    # The leader starts a member of its own group (like a server's engine process), then exits.
    member = (
        "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', sys.argv[1]]).pid, flush=True)"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", member, "import time; time.sleep(600)"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None
    member_proc = psutil.Process(int(leader.stdout.readline()))
    record = {"pid": leader.pid, "create_time": psutil.Process(leader.pid).create_time(), "pgid": leader.pid}
    assert leader.wait(timeout=30) == 0
    try:
        assert stop_trees([record], grace_s=1.0, say=print) == [] and member_proc.is_running()
        assert stop_trees([record], grace_s=5.0, say=print, leaderless_groups=True) == []  # SIGTERM did it
        _wait_until(
            lambda: not member_proc.is_running() or member_proc.status() == psutil.STATUS_ZOMBIE, "exit"
        )
    finally:
        with contextlib.suppress(psutil.Error):
            member_proc.kill()


def test_a_live_launcher_keeps_its_output_directory(tmp_path: Path) -> None:
    launcher = _sleeper()
    try:
        pids = tmp_path / "launch" / "pids.json"
        _write_record(pids, launcher, processes=[])
        with pytest.raises(LaunchError, match=rf"a launch \(pid {launcher.pid}\) still runs here"):
            claim_launch_dir(pids, grace_s=1.0)
        assert json.loads(pids.read_text())["launcher"] == launcher.pid  # untouched
    finally:
        launcher.kill()
        launcher.wait()


def test_the_record_of_a_killed_launcher_is_taken_over_and_its_leftovers_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launcher, leftover = _sleeper(), _sleeper()
    pids = tmp_path / "launch" / "pids.json"
    try:
        _write_record(pids, launcher, processes=[leftover])
        launcher.kill()
        launcher.wait()
        claim_launch_dir(pids, grace_s=2.0)
        assert leftover.wait(timeout=5) == -signal.SIGTERM
    finally:
        leftover.kill()
        leftover.wait()
    out = capsys.readouterr().out
    assert f"taking over {pids}: the launch that wrote it (pid {launcher.pid}) is gone" in out
    assert f"stopping what it left running: server-0: pid {leftover.pid}" in out
    record = json.loads(pids.read_text())
    assert record["launcher"] == os.getpid() and record["processes"] == [] and not record["finished"]


def test_a_finished_launch_is_taken_over_silently(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    launcher = _sleeper()
    pids = tmp_path / "launch" / "pids.json"
    _write_record(pids, launcher, processes=[], finished=True)
    launcher.kill()
    launcher.wait()
    previous = previous_launch(pids)
    assert previous is not None and not previous.launcher_alive and not previous.stale
    claim_launch_dir(pids, grace_s=1.0)
    assert capsys.readouterr().out == ""
    assert json.loads(pids.read_text())["launcher"] == os.getpid()


@pytest.mark.heavy
@pytest.mark.timeout(420)
def test_a_sigkilled_launch_leaves_no_process_and_the_next_launch_starts(
    launch_config: Callable[..., Path], start_launch: Callable[..., Any]
) -> None:
    config = launch_config(stage2_ab={"schedule": {"b_ratio": 1.0}}, training={"max_steps": 100000})
    cpu = ("--cpu", "--learner-procs", "2", "--engine", "hf", "--grace-s", "2")
    run = start_launch(config, *cpu)

    def workers_recorded() -> bool:  # torchrun's workers run in sessions of their own
        procs = run.pids()["processes"] if (run.launch_dir / "pids.json").exists() else []
        return len(procs) == 2 and len(procs[1]["descendants"]) >= 2

    run.wait_for(workers_recorded, 300, "recorded torchrun workers")
    record = run.pids()
    processes = [p for entry in record["processes"] for p in [entry, *entry["descendants"]]]
    try:
        assert all(process_alive(p["pid"], p["create_time"]) for p in record["processes"])
        run.process.send_signal(signal.SIGKILL)
        run.process.wait(timeout=10)
        _assert_gone(processes, "the processes of a SIGKILLed launch")
    finally:  # never leave a tree behind, whatever failed
        stop_trees(processes, grace_s=1.0, say=print)
    watchdog_log = (run.launch_dir / "watchdog.log").read_text()
    assert f"launcher pid {run.process.pid} exited without stopping its processes" in watchdog_log

    second = start_launch(config, "--cpu", "--servers-only", "--engine", "hf")
    second.wait_for(lambda: "started server-0" in second.output(), 120, "a started server")
    assert f"the launch that wrote it (pid {run.process.pid}) is gone" in second.output()
    second.process.send_signal(signal.SIGTERM)
    assert second.wait(60) == 0, second.output()[-4000:]
    assert previous_launch(second.launch_dir / "pids.json").running == []


# ------------------------------------------------------------------------------------ helpers
def _kill_stand_in(
    tmp_path: Path, scripts: list[str], *, with_watchdog: bool, wait_for: str = "up"
) -> list[dict[str, Any]]:
    """Run the stand-in launcher with ``scripts`` as children, wait until they are up, SIGKILL it."""
    stand_in = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(tmp_path), "1" if with_watchdog else "0", *scripts],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    records: list[dict[str, Any]] = []
    try:
        assert stand_in.stdout is not None
        records = json.loads(stand_in.stdout.readline())
        assert len(records) == len(scripts), "the stand-in launcher failed"
        _wait_until(
            lambda: wait_for in (tmp_path / "server-0.log").read_text(), f"{wait_for!r} in server-0.log"
        )
        stand_in.send_signal(signal.SIGKILL)
        assert stand_in.wait(timeout=10) == -signal.SIGKILL
        return records
    except BaseException:
        stop_trees(records, grace_s=0.5, say=print)
        raise
    finally:
        stand_in.kill()
        stand_in.wait()


def _assert_gone(records: list[dict[str, Any]], what: str) -> None:
    """Every recorded process, every descendant found before the kill and every member of their
    process groups is gone within :data:`GONE_WITHIN_S`; leftovers are stopped before failing."""
    groups = {r["pgid"] for r in records}

    def left() -> list[str]:
        alive = [f"pid {r['pid']}" for r in records if process_alive(r["pid"], r["create_time"])]
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"pid {proc.pid} in group {os.getpgid(proc.pid)}")
            except (OSError, psutil.Error):
                continue
        return alive

    deadline = time.monotonic() + GONE_WITHIN_S
    while (remaining := left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if remaining:
        stop_trees(records, grace_s=0.5, say=print)
        pytest.fail(f"{what} still run {GONE_WITHIN_S:.0f}s after the kill: {', '.join(remaining)}")


def _wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except (OSError, psutil.Error):
            pass  # not there yet
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f}s"
        time.sleep(0.1)


def _sleeper() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


def _write_record(
    path: Path,
    launcher: subprocess.Popen[bytes],
    *,
    processes: list[subprocess.Popen[bytes]],
    finished: bool = False,
) -> None:
    """A launch record as ``write_pids`` writes it, naming ``launcher`` and ``processes`` (as servers)."""

    def entry(index: int, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        created = psutil.Process(proc.pid).create_time()
        return {
            "name": f"server-{index}",
            "pid": proc.pid,
            "pgid": proc.pid,
            "create_time": created,
            "log": "-",
            "descendants": [],
        }

    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "launcher": launcher.pid,
        "launcher_create_time": psutil.Process(launcher.pid).create_time(),
        "finished": finished,
        "processes": [entry(i, p) for i, p in enumerate(processes)],
    }
    path.write_text(json.dumps(record))
