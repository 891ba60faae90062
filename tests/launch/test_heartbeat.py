"""The nodes' heartbeat on real sockets (127.0.0.1, free ports): a node that stops beating, never
joins, fails, or hosts a hub that vanishes is named by the others within the timeout; a node that
finished is never lost; the hub refuses strangers and garbage and keeps answering.

The heartbeats judge liveness on a :class:`FakeClock` the test moves itself: a node is late only when
the test moved the clock past its timeout, never because the machine was slow, and each test checks
both sides of the timeout (not named just before it, named just after it). The test waits for the
nodes' reports (:func:`wait_beats`) in real time, bounded far above what they need."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import LaunchError
from rollmatch.launch.heartbeat import EXIT_PREEMPTED, STALE_S, NodeHeartbeat, report_mac
from rollmatch.launch.layout import Layout
from rollmatch.launch.plan import LaunchPlan, free_ports
from rollmatch.launch.supervisor import run_plan

# Real sockets and threads in this process, judged on a clock the test holds: the unit tier, except
# the servers-only node's run (run_plan: tests/conftest.py marks it integration).
TIMEOUT_S = 1.0  # on the fake clock; it also sets the beat interval (0.2 s of real time)
# Real-time bound on waits for reports and for a detection once the clock passed the timeout: a report
# takes one beat interval (0.2 s) idle, so 30 s is 150x that. With the clock held, a node that is not
# late is never named however long a report takes.
WAIT_S = 30.0
HOSTS = ["127.0.0.1", "127.0.0.1"]


class FakeClock:
    """A monotonic clock that moves only when the test moves it (``advance``)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def wait_beats(*nodes: NodeHeartbeat, count: int = 2) -> None:
    """Wait until each node made ``count`` more reports (answered or not); with 2, at least one was
    made entirely after this call, so it saw any clock move made before it."""
    targets = [(node, node.beats + count) for node in nodes]
    deadline = time.monotonic() + WAIT_S
    for node, target in targets:
        while node.beats < target:
            assert time.monotonic() < deadline, f"node {node.node_rank} made no report within {WAIT_S}s"
            time.sleep(0.02)


@pytest.fixture
def beat(clock: FakeClock) -> Iterator[Callable[..., NodeHeartbeat]]:
    """Start a node's heartbeat on the test's port and clock; every one is stopped at the end."""
    port = free_ports(1)[0]
    started: list[NodeHeartbeat] = []

    def start(
        rank: int, *, key: str | None = None, join_timeout_s: float = 30.0, run: bool = True
    ) -> NodeHeartbeat:
        node = NodeHeartbeat(
            node_rank=rank,
            hosts=HOSTS,
            port=port,
            timeout_s=TIMEOUT_S,
            join_timeout_s=join_timeout_s,
            key=key,
            clock=clock,
        )
        if run:
            node.start()
            started.append(node)
        return node

    yield start
    for node in started:
        if node._stop.is_set() and node._hub is None:
            continue
        silence(node)
        if node._hub is not None:
            node._hub.shutdown()
            node._hub.server_close()


def silence(node: NodeHeartbeat) -> None:
    """What SIGKILL does to a launcher's heartbeat: it stops, with no last report."""
    node._stop.set()
    if node._thread is not None:
        node._thread.join(timeout=5)


def wait_problem(node: NodeHeartbeat) -> str:
    problem = node.wait_for_problem(WAIT_S)
    assert problem is not None, f"no problem seen within {WAIT_S}s"
    return problem


def pass_time(clock: FakeClock, seconds: float, *nodes: NodeHeartbeat) -> None:
    """Move the clock ``seconds`` in steps of half a timeout, each step seen by every node's reports
    (live nodes keep reporting as time passes, as they would on a real clock)."""
    steps = max(1, round(seconds / (TIMEOUT_S / 2)))
    for _ in range(steps):
        clock.advance(seconds / steps)
        wait_beats(*nodes)


def test_a_node_that_stops_beating_is_named_lost_within_the_timeout(beat, clock: FakeClock) -> None:
    host, other = beat(0), beat(1)
    pass_time(clock, TIMEOUT_S * 1.5, host, other)
    assert host.problem() is None and other.problem() is None  # both alive: nobody is lost
    silence(other)
    clock.advance(TIMEOUT_S * 0.9)
    wait_beats(host)
    assert host.problem() is None  # silent, but not yet for the timeout
    clock.advance(TIMEOUT_S * 0.2)  # now past it: named at the host's next report
    problem = wait_problem(host)
    assert problem.startswith("node 1 (127.0.0.1) lost: no heartbeat for")
    assert "launch.nodes.heartbeat_timeout_s=1" in problem


def test_the_hub_vanishing_makes_the_other_nodes_name_node_0(beat, clock: FakeClock) -> None:
    host, other = beat(0), beat(1)
    wait_beats(host, other)
    silence(host)
    assert host._hub is not None
    host._hub.shutdown()
    host._hub.server_close()
    host._hub = None
    clock.advance(TIMEOUT_S * 0.9)
    wait_beats(other)  # its reports fail, but the hub has not been silent for the timeout yet
    assert other.problem() is None
    clock.advance(TIMEOUT_S * 0.2)
    problem = wait_problem(other)
    assert problem.startswith("node 0 (127.0.0.1) lost: its heartbeat hub at 127.0.0.1:")


def test_a_node_that_never_reports_is_named_after_the_join_timeout(beat, clock: FakeClock) -> None:
    host = beat(0, join_timeout_s=1.5)
    clock.advance(1.4)
    wait_beats(host)
    assert host.problem() is None  # not yet: the join timeout is 1.5 s
    clock.advance(0.2)
    problem = wait_problem(host)
    assert problem.startswith(
        "node 1 (127.0.0.1) never joined: no heartbeat within launch.nodes.join_timeout_s=1.5s"
    )


def test_a_failed_node_is_named_and_a_finished_one_is_never_lost(beat, clock: FakeClock) -> None:
    host, other = beat(0), beat(1)
    wait_beats(host, other)
    other.finish(0)
    pass_time(clock, TIMEOUT_S * 3, host)  # long past the timeout: a finished node stays finished
    assert host.problem() is None and host.learners_done([1]) == {1: 0}
    # Everyone is done: the hub closes at once, not after lingering a timeout for the others (the
    # clock is held, so a linger would never end: the thread would still be running).
    closing = threading.Thread(target=host.finish, args=(0,), daemon=True)
    closing.start()
    closing.join(WAIT_S)
    lingered = closing.is_alive()
    clock.advance(TIMEOUT_S * 2)  # lets a lingering finish end before the assertion fails the test
    assert not lingered, "the hub lingered although every node had reported done"


def test_a_node_whose_launcher_failed_is_named_with_its_code(beat) -> None:
    host, other = beat(0), beat(1)
    wait_beats(host, other)
    other.finish(3)
    problem = wait_problem(host)
    assert problem == "node 1 (127.0.0.1) failed: its launcher exited with code 3"
    assert host.learners_done([1]) == {1: 3}


def test_a_report_without_the_launch_key_is_refused(beat, clock: FakeClock) -> None:
    host, stranger = beat(0, key="secret"), beat(1, key="guess")
    wait_beats(host, stranger)
    clock.advance(TIMEOUT_S * 1.1)  # refused for longer than the timeout: the stranger gives up on the hub
    problem = wait_problem(stranger)
    assert "refused this node's report: report not signed with the launch key" in problem
    assert host._hub is not None and host._hub.reports.keys() == {0}  # the stranger was never recorded


GARBAGE = [
    b"not json\n",
    b'{"node": 7, "state": "alive"}\n',
    b'{"node": 1, "state": "dead"}\n',
    b'{"node": 1, "state": "done", "code": "x"}\n',
    b'{"node": true, "state": "alive"}\n',
    b"[1, 2]\n",
    b"x" * 10_000 + b"\n",
    b'{"node": 1, "state": "alive"}',  # no newline: the client hangs up
    b"[" * 4000 + b"\n",  # too deep for the parser (RecursionError)
    b'{"node": 1, "state": "alive", "code": null, "sent_at": true}\n',
]


def test_the_hub_answers_garbage_with_an_error_and_keeps_serving(beat) -> None:
    host = beat(0)
    for line in GARBAGE:
        with socket.create_connection(("127.0.0.1", host.port), timeout=5) as conn:
            conn.sendall(line)
            conn.shutdown(socket.SHUT_WR)
            reply = json.loads(conn.makefile("rb").readline())
        assert reply["ok"] is False and reply["error"], line[:40]
    assert host._hub is not None and 1 not in host._hub.reports
    wait_beats(host, beat(1))
    assert host._hub.reports.keys() == {0, 1} and host.problem() is None


def send(port: int, report: dict[str, object]) -> dict[str, object]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall((json.dumps(report) + "\n").encode())
        return json.loads(conn.makefile("rb").readline())


def test_reports_are_signed_and_a_replayed_or_forged_one_is_refused(beat) -> None:
    host = beat(0, key="secret")
    other = beat(1, key="secret")
    wait_beats(host, other)
    assert host._hub is not None and host._hub.reports.keys() == {0, 1}
    # the key never travels: what a node sends is a signature over node, state, code and time
    sent = host._hub.sent_at[1]
    # a forged "done, code 1" for node 1 (the old form: the key in cleartext, or no signature at all)
    for forged in ({"key": "secret"}, {"mac": "0" * 64}):
        reply = send(host.port, {"node": 1, "state": "done", "code": 1, "sent_at": time.time(), **forged})
        assert reply == {"ok": False, "error": "report not signed with the launch key (ROLLMATCH_API_KEY)"}
    # a captured genuine report, replayed
    old = {"node": 1, "state": "done", "code": 1, "sent_at": sent}
    reply = send(host.port, {**old, "mac": report_mac("secret", 1, "done", 1, sent)})
    assert reply["ok"] is False and str(reply["error"]).startswith("replayed report: node 1 already reported")
    stale = time.time() - STALE_S - 60
    reply = send(host.port, {**old, "sent_at": stale, "mac": report_mac("secret", 1, "done", 1, stale)})
    assert reply["ok"] is False and re.match(r"stale report: its time is 3\d\ds behind", str(reply["error"]))
    wait_beats(host, other)
    assert host._hub.reports[1].state == "alive" and host.problem() is None  # nothing stopped the run


def test_a_taken_hub_port_is_refused_naming_the_key(beat) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        node = NodeHeartbeat(
            node_rank=0, hosts=HOSTS, port=taken.getsockname()[1], timeout_s=1, join_timeout_s=1, key=None
        )
        with pytest.raises(LaunchError, match=r"launch\.nodes\.heartbeat_port"):
            node.start()


def servers_only_plan(tmp_path: Path) -> LaunchPlan:
    """Node 0 of two, running only (here: no) servers; node 1 runs the learner."""
    return LaunchPlan(
        servers=(),
        learner=None,
        endpoints=(),
        learner_config=RollmatchConfig(),
        learner_config_path=tmp_path / "learner.yaml",
        launch_dir=tmp_path,
        health_timeout_s=10,
        layout=Layout(
            on_cpu=True, server_devices=(), learner_devices=(), learner_procs=0, tensor_parallel_size=1
        ),
        engine="hf",
        node_rank=0,
        node_count=2,
        learner_nodes=(1,),
    )


# 5: the learner nodes stopped on the warning signal with a checkpoint: not a failure, the job requeues
# The clock is held, so only the learner node's report can end the run (a node that ended on the join
# timeout instead, 30 s, would never end: the test's own timeout fails it).
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("learner_code", "launch_code"), [(0, 0), (1, 4), (EXIT_PREEMPTED, 0)])
def test_a_servers_only_node_ends_with_the_learner_nodes(
    beat, tmp_path: Path, learner_code: int, launch_code: int
) -> None:
    host, learner = beat(0, run=False), beat(1)
    running_before_the_learner_ended: list[bool] = []

    def learner_node() -> None:
        deadline = time.monotonic() + WAIT_S
        while host.beats < 2 and time.monotonic() < deadline:  # run_plan started the host's heartbeat
            time.sleep(0.02)
        wait_beats(learner)
        running_before_the_learner_ended.append(
            host.beats >= 2 and host.problem() is None and not host._stop.is_set()
        )
        learner.finish(learner_code)

    threading.Thread(target=learner_node, daemon=True).start()
    assert run_plan(servers_only_plan(tmp_path), grace_s=1, heartbeat=host) == launch_code
    assert running_before_the_learner_ended == [True]  # the learner node still ran: so did the servers
