"""Running a launch plan: start the servers, wait for ``/health/``, start the learner, watch, tear down.

Owns: :func:`run_plan` and the exit-code contract of ``rollmatch launch``:
- the learner's exit code when it exits (0 on success); a learner ended by signal N gives 128 + N;
- :data:`EXIT_SERVER_FAILED` (3) when a rollout server exits during start-up, is not healthy within
  ``vllm.server.timeout_s``, or dies while the learner runs (the message names it and shows its log);
  with ``launch.restart_servers: N`` a server that exits or stops answering ``/health/`` for
  ``vllm.server.timeout_s`` after start-up is restarted instead (same command: same devices and port),
  after a backoff of ``launch.restart_backoff_s`` (1 s), doubled per restart, at most 30 s, each
  restart logged; after N restarts it is given up (3, named);
  on several nodes a learner node also waits for every other node's servers (``/health/``) first;
- :data:`EXIT_NODE_LOST` (4) on several nodes when another node is lost, never joined, or failed
  (``launch.heartbeat``: the message names the node), whether or not this node's learner failed first;
  a node that runs only servers exits 0 once every learner node finished with 0;
- 128 + N when the launcher itself gets signal N (Ctrl-C: 130, SIGTERM: 143), except ``--servers-only``,
  for which a signal is the normal way to stop (0);
- :data:`EXIT_PREEMPTED` (5) after SIGUSR1, the warning a scheduler sends before it stops the job
  (Slurm's ``--signal=USR1@120``): the launcher forwards it to the learner's ranks, which save a complete
  checkpoint at the end of their current step and stop (``training.preemption``); the servers run until
  then. A learner that finished its run in the meantime (``<output_dir>/final`` written) gives 0. A node
  that runs only servers keeps running until the learner nodes end (0); before the learner started, the
  launch stops at once (5: nothing to save).
Whatever ends the run, every child tree gets SIGTERM, then SIGKILL after the grace period. A launcher
that dies without its teardown (SIGKILL, out of memory) takes its children with it: each gets SIGTERM
from the kernel and the watchdog (``launch.watchdog``, log ``watchdog.log``) stops every tree it was
told about, SIGKILL after the same grace period.
Leaves out: what to start (``launch.plan``) and how children are signalled (``launch.processes``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import requests

from rollmatch.config.load import config_to_yaml
from rollmatch.config.schema import ROLLOUT_KEY
from rollmatch.launch.console import ConsoleMerge
from rollmatch.launch.heartbeat import EXIT_PREEMPTED, NodeHeartbeat
from rollmatch.launch.plan import API_KEY_ENV, LaunchPlan, ProcessSpec
from rollmatch.launch.processes import Child, start_child, terminate_all, write_pids
from rollmatch.launch.watchdog import Watchdog

EXIT_SERVER_FAILED = 3
EXIT_NODE_LOST = 4
PIDS_NAME = "pids.json"
WATCHDOG_LOG = "watchdog.log"
_POLL_S = 0.5
_PROGRESS_EVERY_S = 10.0
_PIDS_EVERY_S = 2.0
_TIMEOUT_KEY = f"{ROLLOUT_KEY}.vllm.server.timeout_s"
# With launch.restart_servers: how often the running servers' /health/ is asked, and how long one answer is
# waited for (a frozen server accepts the connection, then never answers); at most a quarter of
# vllm.server.timeout_s each, so a server silent for the timeout is noticed soon after it, not seconds later.
_HEALTH_EVERY_S = 2.0
_MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Outcome:
    """How the run ended: the launcher's exit code and the line that says why."""

    code: int
    message: str


def run_plan(
    plan: LaunchPlan,
    *,
    grace_s: float,
    pids_name: str = PIDS_NAME,
    heartbeat: NodeHeartbeat | None = None,
) -> int:
    """Write the learner config, run every process of ``plan``, tear everything down; the exit code.
    ``heartbeat``: this node's side of a multi-node launch's heartbeat (started here, before anything)."""
    plan.launch_dir.mkdir(parents=True, exist_ok=True)
    plan.learner_config_path.write_text(config_to_yaml(plan.learner_config))
    if heartbeat is not None:
        heartbeat.start()
    console = ConsoleMerge()
    watchdog = Watchdog(plan.launch_dir / WATCHDOG_LOG, grace_s)
    run = _Run(plan, console, plan.launch_dir / pids_name, watchdog, heartbeat, grace_s=grace_s)
    outcome = Outcome(1, "the launcher failed (see the error above)")
    with _StopSignals() as stop:
        try:
            outcome = run.execute(stop)
        finally:
            run.teardown(grace_s)
            watchdog.close()
            if heartbeat is not None:
                heartbeat.finish(outcome.code)
            console.close()
    console.say(outcome.message)
    return outcome.code


class _StopSignals:
    """SIGINT / SIGTERM / SIGHUP (stop) and SIGUSR1 (the scheduler's warning: checkpoint, then stop) only
    record the signal; the supervisor's loops act on it."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None
        self.warned = False
        self.event = threading.Event()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopSignals:
        for sig in self._SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def pause(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, woken early by a new signal (True). The signal stays recorded in
        ``received`` / ``warned``; the event is cleared, so the loops idle after it instead of spinning."""
        woke = self.event.wait(seconds)
        self.event.clear()
        return woke

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGUSR1:
            self.warned = True
        elif self.received is None:
            self.received = signum
        self.event.set()


class _Run:
    def __init__(
        self,
        plan: LaunchPlan,
        console: ConsoleMerge,
        pids_path: Path,
        watchdog: Watchdog,
        heartbeat: NodeHeartbeat | None = None,
        *,
        grace_s: float = 10.0,
    ):
        self.plan = plan
        self._grace_s = grace_s
        self.heartbeat = heartbeat
        self.console = console
        self.pids_path = pids_path
        self.watchdog = watchdog
        self._watchdog_lost = False
        self.children: list[Child] = []
        self.servers: list[Child] = []
        self._seen: dict[int, list[dict[str, Any]]] = {}
        self._pids_written = 0.0
        self._restarts: dict[str, int] = {}  # server name -> restarts so far
        self._given_up: set[str] = set()  # servers left down: the others still meet vllm.server.min_healthy
        self._answered: dict[str, float] = {}  # server name -> when /health/ last answered 200 (restarts on)
        self._next_health = 0.0
        self._session = requests.Session()

    def execute(self, stop: _StopSignals) -> Outcome:
        for spec in self.plan.servers:
            self.servers.append(self._start(spec))
        failed = self._wait_healthy(stop)
        if failed is not None:
            return failed
        if self.plan.learner is None and self.plan.node_count > 1:
            self.console.say(
                f"rollout server(s) ready: {', '.join(s.url or '' for s in self.plan.servers)}; the learner runs on "
                f"node(s) {list(self.plan.learner_nodes)}: this node stops when they finish"
            )
        elif self.plan.learner is None:
            self.console.say(
                f"rollout server(s) ready: {', '.join(s.url or '' for s in self.plan.servers)}; learner config "
                f"{self.plan.learner_config_path}. Start the learner with `rollmatch launch "
                f"{self.plan.learner_config_path} --learner-only ...` (API key in {self.plan.launch_dir}/api_key). "
                "Ctrl-C stops the servers."
            )
        learner = self._start(self.plan.learner) if self.plan.learner is not None else None
        return self._watch(stop, learner)

    def teardown(self, grace_s: float) -> None:
        if self.children:
            running = [c.spec.name for c in self.children if c.exit_code() is None]
            if running:
                self.console.say(f"stopping {', '.join(running)} (SIGTERM, SIGKILL after {grace_s:.0f}s)")
            self._write_pids()
            killed = terminate_all(self.children, grace_s)
            if killed:
                self.console.say(f"killed after the grace period: {', '.join(killed)}")
        self._write_pids(finished=True)

    # ------------------------------------------------------------------------------------ phases
    def _start(self, spec: ProcessSpec) -> Child:
        child = start_child(spec)
        self._guard({"pid": child.pid, "create_time": child.create_time, "pgid": child.pid})
        self.children.append(child)
        self.console.follow(spec.name, spec.log_path)
        self.console.say(f"started {spec.name} (pid {child.pid}, log {spec.log_path})")
        self._write_pids()
        return child

    def _wait_healthy(self, stop: _StopSignals) -> Outcome | None:
        timeout_s = self.plan.health_timeout_s
        start = time.monotonic()
        next_progress = start + _PROGRESS_EVERY_S
        pending = list(self.servers)
        session = requests.Session()
        key = self.plan.servers[0].env.get(API_KEY_ENV) if self.plan.servers else None
        if key:
            session.headers["Authorization"] = f"Bearer {key}"
        local = {s.url for s in self.plan.servers}
        # On several nodes the learner also needs the other nodes' servers, started by their own launches.
        remote = (
            [e.base_url for e in self.plan.endpoints if e.base_url not in local]
            if self.plan.learner is not None and self.plan.node_count > 1
            else []
        )
        while pending or remote:
            if stop.received is not None:
                return self._signalled(stop.received)
            if stop.warned and self.plan.learner is not None:
                return Outcome(
                    EXIT_PREEMPTED,
                    "received SIGUSR1 (the scheduler's warning) before the learner started: stopped every "
                    "process; nothing was trained, so a requeued run starts where the last one left off",
                )
            if (lost := self._node_lost()) is not None:
                return lost
            for url in list(remote):
                if _healthy(session, url):
                    remote.remove(url)
                    self.console.say(f"remote server {url} healthy after {time.monotonic() - start:.0f}s")
            for child in list(pending):
                if child.exit_code() is not None:
                    return self._server_failed(child, "during start-up, before /health/ answered")
                if _healthy(session, child.spec.url or ""):
                    pending.remove(child)
                    self.console.say(
                        f"{child.spec.name} healthy at {child.spec.url} after {time.monotonic() - start:.0f}s"
                    )
            now = time.monotonic()
            if pending and now - start >= timeout_s:
                names = ", ".join(c.spec.name for c in pending)
                return Outcome(
                    EXIT_SERVER_FAILED,
                    f"{names} not healthy after {timeout_s:.0f}s ({_TIMEOUT_KEY}); raise the timeout for slow "
                    f"model loads. Last lines of {pending[0].spec.log_path}:\n{pending[0].log_tail()}",
                )
            if remote and now - start >= timeout_s:
                return Outcome(
                    EXIT_SERVER_FAILED,
                    f"the other nodes' rollout server(s) {', '.join(remote)} not healthy after {timeout_s:.0f}s "
                    f"({_TIMEOUT_KEY}): check their nodes' launch output, or raise the timeout for slow model loads",
                )
            if (pending or remote) and now >= next_progress:
                next_progress = now + _PROGRESS_EVERY_S
                others = f", {len(remote)} on other nodes not yet" if remote else ""
                self.console.say(
                    f"waiting for rollout servers: {len(self.servers) - len(pending)}/{len(self.servers)} of this "
                    f"node healthy{others} after {now - start:.0f}s (timeout {timeout_s:.0f}s)"
                )
            self._refresh_pids()
            stop.pause(_POLL_S)
        return None

    def _watch(self, stop: _StopSignals, learner: Child | None) -> Outcome:
        started, started_at = time.monotonic(), time.time()
        warned = False
        while True:
            if stop.received is not None:
                return self._signalled(stop.received)
            if stop.warned:  # again every poll: a rank still starting (signal ignored until then) gets it too
                self._warn(learner, say=not warned)
                warned = True
            if (lost := self._node_lost()) is not None:
                return lost
            if learner is None and (done := self._learners_done()) is not None:
                return done
            failed = self._restart_failed_servers(stop, learner)
            if failed is not None:
                return failed
            if learner is not None and (code := learner.exit_code()) is not None:
                if code != 0:  # a server crash that made the learner fail is reported as the cause
                    time.sleep(_POLL_S)
                    dead = next(
                        (
                            s
                            for s in self.servers
                            if s.exit_code() is not None and s.spec.name not in self._given_up
                        ),
                        None,
                    )
                    if dead is not None:
                        return self._server_failed(dead, "while the learner was running")
                elapsed = time.monotonic() - started
                if warned and code == 0 and not self._final_written_since(started_at):
                    return Outcome(
                        EXIT_PREEMPTED,
                        f"learner stopped on the warning signal after {elapsed:.0f}s with a complete checkpoint "
                        f"(log {learner.spec.log_path}): rerun or resubmit to resume (training.resume_from_checkpoint: auto)",
                    )
                status = "finished" if code == 0 else "failed"
                message = f"learner {status} with exit code {code} after {elapsed:.0f}s (log {learner.spec.log_path})"
                if code != 0 and self.heartbeat is not None:
                    # A peer node lost or failed makes this node's ranks fail too, often at once (gloo sees the
                    # connection reset): wait for the heartbeat to say which, so the message names the cause. A
                    # lost peer is named one timeout after its last beat plus one beat interval, later on a
                    # busy machine: wait up to twice the timeout (one was not enough under load).
                    cause = self.heartbeat.wait_for_problem(2 * self.heartbeat.timeout_s)
                    if cause is not None:
                        return Outcome(EXIT_NODE_LOST, f"{cause}; this node's {message}")
                return Outcome(code if code >= 0 else 128 - code, message)
            self._refresh_pids()
            stop.pause(_POLL_S)

    def _restart_failed_servers(self, stop: _StopSignals, learner: Child | None) -> Outcome | None:
        """Restart each server that exited or stopped answering ``/health/`` while restarts are left
        (``launch.restart_servers``); the outcome that ends the launch when one is out of restarts."""
        when = "while the learner was running" if learner else "after start-up"
        if self.plan.restart_servers and learner is not None and learner.exit_code() is not None:
            return None  # the learner ended (its exit code tells how): no server is needed any more
        for index, child in enumerate(self.servers):
            if child.spec.name in self._given_up:
                continue
            why = self._server_problem(child)
            if why is None:
                continue
            used = self._restarts.get(child.spec.name, 0)
            if used >= self.plan.restart_servers:
                if self._spare(child, why, used, when):
                    continue
                if used == 0:
                    return self._server_failed(child, when)
                return Outcome(
                    EXIT_SERVER_FAILED,
                    f"rollout server {child.spec.name} ({child.spec.url}) {why} {when}, after {used} restart(s): "
                    f"given up (launch.restart_servers = {self.plan.restart_servers}). Last lines of "
                    f"{child.spec.log_path}:\n{child.log_tail()}",
                )
            if child.exit_code() is None:  # not answering: stop it before starting it again on its port
                terminate_all([child], self._grace_s)
            backoff_s = min(self.plan.restart_backoff_s * 2.0**used, _MAX_BACKOFF_S)
            self.console.say(
                f"rollout server {child.spec.name} ({child.spec.url}) {why}: restarting it in {backoff_s:g}s on "
                f"the same devices and port (restart {used + 1} of {self.plan.restart_servers}). Last lines of "
                f"{child.spec.log_path}:\n{child.log_tail(5)}"
            )
            if stop.pause(backoff_s) and (stop.received is not None or stop.warned):
                return None  # the watch loop acts on the signal
            self._restarts[child.spec.name] = used + 1
            log = child.spec.log_path  # kept: why it died; the restart writes a fresh one
            with contextlib.suppress(OSError):
                log.rename(log.with_name(f"{log.stem}.before-restart-{used + 1}{log.suffix}"))
            self.servers[index] = self._start(child.spec)
            self._answered[child.spec.name] = time.monotonic()  # it gets the start-up timeout to answer
        return None

    def _spare(self, child: Child, why: str, used: int, when: str) -> bool:
        """Leave ``child`` down (out of restarts) when the other servers still meet
        ``vllm.server.min_healthy``: the learner trains on without it (its pool dropped it), so the launch
        goes on. False (the launch ends) with ``min_healthy`` null, or when too few would be left."""
        floor = self.plan.learner_config.rollout.vllm.server.min_healthy
        total = max(len(self.plan.endpoints), len(self.servers))
        left = total - len(self._given_up) - 1
        if floor is None or left < floor:
            return False
        self._given_up.add(child.spec.name)
        if child.exit_code() is None:
            terminate_all([child], self._grace_s)
        self.console.say(
            f"rollout server {child.spec.name} ({child.spec.url}) {why} {when}, after {used} restart(s) "
            f"(launch.restart_servers = {self.plan.restart_servers}): left down; the learner trains on with "
            f"{left} of {total} server(s) (vllm.server.min_healthy = {floor}). Last lines of "
            f"{child.spec.log_path}:\n{child.log_tail(5)}"
        )
        return True

    def _server_problem(self, child: Child) -> str | None:
        """Why ``child`` needs a restart: it exited, or (restarts on) ``/health/`` has not answered 200
        for ``vllm.server.timeout_s``; None while it serves."""
        code = child.exit_code()
        if code is not None:
            return f"exited with code {code}"
        if self.plan.restart_servers == 0:
            return None
        now = time.monotonic()
        name = child.spec.name
        self._answered.setdefault(name, now)
        every_s = min(_HEALTH_EVERY_S, self.plan.health_timeout_s / 4)
        if now >= self._next_health:
            if _healthy(self._session, child.spec.url or "", timeout_s=every_s):
                self._answered[name] = now
            if child is self.servers[-1]:
                self._next_health = now + every_s
            now = time.monotonic()  # after the probe, which may have waited its whole timeout
        silent_s = now - self._answered[name]
        if silent_s > self.plan.health_timeout_s:
            return f"did not answer /health/ for {silent_s:.0f}s ({_TIMEOUT_KEY})"
        return None

    def _warn(self, learner: Child | None, *, say: bool) -> None:
        """SIGUSR1 to torchrun's ranks (its direct children), which save a checkpoint at the end of the
        current step and stop; torchrun itself ignores it (``launch.processes``). Sent on every poll until
        the learner exits: ranks handle it from process start, but one still starting (before
        ``rollmatch train`` installed its handler, the signal is ignored) must get it once it can."""
        if learner is None:
            if not say:
                return
            self.console.say(
                "received SIGUSR1 (the scheduler's warning): the learner nodes save a checkpoint and stop; "
                "this node's servers run until they do"
            )
            return
        try:
            ranks = psutil.Process(learner.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            ranks = []  # torchrun exited meanwhile: its exit code tells the rest
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGUSR1)
            except psutil.Error:
                continue  # exited meanwhile
        if not say:
            return
        self.console.say(
            "received SIGUSR1 (the scheduler's warning): forwarded to the learner, which saves a complete "
            "checkpoint at the end of its current step and stops"
        )

    def _final_written_since(self, since: float) -> bool:
        """The learner wrote ``<output_dir>/final`` (its run ended) after ``since`` (wall clock)."""
        final = Path(self.plan.learner_config.training.output_dir) / "final" / "config.json"
        try:
            return final.stat().st_mtime >= since
        except OSError:
            return False

    # ------------------------------------------------------------------------------------ outcomes
    def _node_lost(self) -> Outcome | None:
        problem = self.heartbeat.problem() if self.heartbeat is not None else None
        if problem is None:
            return None
        return Outcome(EXIT_NODE_LOST, f"{problem}: stopping this node's processes")

    def _learners_done(self) -> Outcome | None:
        """A node that runs only servers ends with the run: once every learner node reported done."""
        if self.heartbeat is None:
            return None
        nodes = list(self.plan.learner_nodes)
        codes = self.heartbeat.learners_done(nodes)
        if codes is None or any(code not in (0, EXIT_PREEMPTED) for code in codes.values()):
            return None  # still running, or failed: a failed node is the heartbeat's problem (_node_lost)
        how = "stopped with a checkpoint on the warning signal" if any(codes.values()) else "finished"
        return Outcome(0, f"the learner {how} on node(s) {nodes}: stopping this node's servers")

    def _server_failed(self, child: Child, when: str) -> Outcome:
        return Outcome(
            EXIT_SERVER_FAILED,
            f"rollout server {child.spec.name} (pid {child.pid}, {child.spec.url}) exited with code "
            f"{child.exit_code()} {when}. Last lines of {child.spec.log_path}:\n{child.log_tail()}",
        )

    def _signalled(self, signum: int) -> Outcome:
        name = signal.Signals(signum).name
        code = 0 if self.plan.learner is None else 128 + signum
        return Outcome(code, f"received {name}: stopped every process")

    def _refresh_pids(self) -> None:
        if time.monotonic() - self._pids_written >= _PIDS_EVERY_S:
            self._write_pids()

    def _write_pids(self, *, finished: bool = False) -> None:
        write_pids(self.pids_path, self.children, self._seen, finished=finished)
        self._pids_written = time.monotonic()
        for descendants in self._seen.values():
            for record in descendants:
                self._guard(record)

    def _guard(self, record: dict[str, Any]) -> None:
        if self.watchdog.guard(record) or self._watchdog_lost:
            return
        self._watchdog_lost = True
        self.console.say(
            f"the watchdog (pid {self.watchdog.process.pid}) exited (see {self.watchdog.log_path}): if this "
            "launcher is killed with SIGKILL, its children get SIGTERM but nothing makes sure they stop"
        )


def _healthy(session: requests.Session, url: str, *, timeout_s: float = 2.0) -> bool:
    try:
        return session.get(f"{url}/health/", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False  # not listening yet
