"""Children in their own sessions, recorded pids, and teardown of whole trees (real processes)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from rollmatch.launch.plan import ProcessSpec
from rollmatch.launch.processes import process_alive, start_child, terminate_all, write_pids

# Like torchrun: ignores SIGTERM itself and starts a worker in a session of its own (which ignores it too).
STUBBORN_TREE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('worker up', flush=True); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)
time.sleep(600)
"""


def _spec(tmp_path: Path, name: str, script: str) -> ProcessSpec:
    return ProcessSpec(
        "server",
        int(name[-1]),
        (sys.executable, "-c", script),
        {"X_LAUNCH_TEST": "1"},
        tmp_path / f"{name}.log",
    )


def _wait_for_text(path: Path, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} not in {path}"
        time.sleep(0.1)


def test_a_tree_that_ignores_sigterm_is_killed_after_the_grace_period_and_recorded(tmp_path: Path) -> None:
    child = start_child(_spec(tmp_path, "server-0", STUBBORN_TREE))
    _wait_for_text(child.spec.log_path, "worker up")
    seen: dict[int, list[dict]] = {}
    pids_path = tmp_path / "pids.json"
    write_pids(pids_path, [child], seen)
    record = json.loads(pids_path.read_text())["processes"][0]
    assert record["name"] == "server-0" and record["pgid"] == child.pid
    [worker] = record["descendants"]
    assert worker["pgid"] == worker["pid"] != child.pid  # the worker leads a session of its own

    start = time.monotonic()
    killed = terminate_all([child], grace_s=1.0)
    assert killed == ["server-0"]
    assert time.monotonic() - start < 10.0
    assert child.exit_code() is not None and child.exit_code() < 0
    assert not process_alive(worker["pid"], worker["create_time"])
    assert not process_alive(record["pid"], record["create_time"])


def test_a_child_that_honours_sigterm_stops_within_the_grace_period(tmp_path: Path) -> None:
    child = start_child(_spec(tmp_path, "server-1", "import time; print('up', flush=True); time.sleep(600)"))
    _wait_for_text(child.spec.log_path, "up")
    assert terminate_all([child], grace_s=20.0) == []
    assert child.exit_code() == -15


def test_children_get_the_plan_environment_and_their_own_session(tmp_path: Path) -> None:
    script = "import os; print(os.environ['X_LAUNCH_TEST'], os.getsid(0) == os.getpid(), flush=True)"
    child = start_child(_spec(tmp_path, "server-2", script))
    assert child.process.wait(timeout=30) == 0
    assert child.spec.log_path.read_text().strip() == "1 True"
    assert "1 True" in child.log_tail()


def _wait_signal_delivered(pid: int, timeout_s: float = 30.0) -> None:
    """Wait until the kernel delivered every signal sent to ``pid`` (/proc: nothing in SigPnd or ShdPnd,
    and not exiting) or it died of one (gone, a zombie): not a sleep, which a busy machine may outlast
    before the process is even scheduled."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            flags = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
        except FileNotFoundError:
            return  # gone
        if status["State"].strip()[0] in "ZX":
            return  # died (a zombie until reaped)
        exiting = flags & 0x4  # PF_EXITING: dying of a signal already taken off the pending set
        if not exiting and int(status["SigPnd"], 16) == 0 and int(status["ShdPnd"], 16) == 0:
            return
        assert time.monotonic() < deadline, f"pid {pid}: a signal still pending after {timeout_s}s"
        time.sleep(0.01)


def test_children_and_their_children_survive_the_schedulers_warning_signal(tmp_path: Path) -> None:
    # Slurm may send SIGUSR1 to every process of a step: servers, torchrun and their children ignore it
    # (only the learner's ranks install a handler); without that, its default action kills them.
    grandchild = "import time; print('grandchild up', flush=True); time.sleep(600)"
    script = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(600)"
    child = start_child(_spec(tmp_path, "server-3", script))
    _wait_for_text(child.spec.log_path, "grandchild up")
    tree = [child.process.pid, *(p.pid for p in child.descendants())]
    assert len(tree) == 2
    for pid in tree:
        os.kill(pid, signal.SIGUSR1)
    for pid in tree:
        _wait_signal_delivered(pid)
    assert child.exit_code() is None
    grandchildren = child.descendants()
    assert len(grandchildren) == 1 and grandchildren[0].status() != psutil.STATUS_ZOMBIE
    assert terminate_all([child], grace_s=20.0) == []


def test_the_launcher_idles_after_the_warning_signal() -> None:
    """After SIGUSR1 the supervisor's loops keep polling (the learner still saves its checkpoint): the
    recorded warning stays, but the wake-up event is cleared, so each poll waits again instead of
    returning at once (the loops spun a core on every node)."""
    from rollmatch.launch.supervisor import _StopSignals

    with _StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.warned and stop.received is None
        assert stop.pause(0.01)  # woken by the signal
        assert not stop.event.is_set()  # the next poll waits its full interval
        assert not stop.pause(0.01)  # no new signal: a plain wait
        assert stop.warned  # still recorded: the watch loop acts on it
