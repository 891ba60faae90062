"""Node liveness across a multi-node launch: each `rollmatch launch` learns, within
``launch.nodes.heartbeat_timeout_s``, that another node was lost or failed, and names it.

Owns :class:`NodeHeartbeat`. Node 0's launcher hosts a small hub (one TCP listener at
``hosts[0]:heartbeat port``); every launcher, node 0's included, reports to it a few times per timeout
whether it is alive or done (with its exit code) and gets back the hub's view: each node's state and
the seconds since its last report, on the hub's clock (so the machines' clocks never need to agree).
Seen from a node, another node is **lost** when it stopped reporting for the timeout, **never joined**
when it did not report within ``launch.nodes.join_timeout_s``, and **failed** when it reported done
with a non-zero code; node 0 is lost when its hub stops answering for the timeout. A node that
reported done with 0 is never lost. Node 0 keeps the hub up after its own end until every node has
reported done or is lost (at most one timeout), so the others learn how it ended.

Reports are signed when the launch has an API key: an HMAC-SHA256, keyed with it, over the node, its
state, its code and the report's wall-clock time; the key itself never crosses the network. The hub
refuses a report whose signature does not match (a stranger cannot fake one), whose time is more than
:data:`STALE_S` from the hub's clock, or not later than the last report it took from that node (a
captured report replayed, e.g. a forged ``done, code 1`` that would stop every node). The hub answers
every line, malformed ones included (bad JSON, too deep, wrong types), with an error, never a traceback.
Every socket operation has a timeout; the hub answers one line per connection and refuses lines over
:data:`_MAX_LINE` bytes. Liveness is judged on one monotonic clock (``clock``, ``time.monotonic`` unless
given: a test passes a clock it moves itself, so a late heartbeat is one the test made late, never a
slow machine); waits on the caller's behalf (:meth:`NodeHeartbeat.wait_for_problem`) are real time. A node that reports done with :data:`EXIT_PREEMPTED` stopped on the warning
signal with a complete checkpoint: that is not a failure.
Leaves out: what a lost node means for this node's processes (``launch.supervisor`` stops them).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rollmatch.errors import ConfigProblem, LaunchError

log = logging.getLogger(__name__)
PORT_KEY = "launch.nodes.heartbeat_port"
TIMEOUT_KEY = "launch.nodes.heartbeat_timeout_s"
JOIN_KEY = "launch.nodes.join_timeout_s"
_MAX_LINE = 4096
STALE_S = 300.0  # how far a report's time may be from the hub's clock (the nodes' clocks run NTP)
EXIT_PREEMPTED = 5  # a launch stopped on the warning signal with a complete checkpoint (launch.supervisor)


def report_mac(key: str, node: object, state: object, code: object, sent_at: object) -> str:
    """The HMAC-SHA256 (hex) of one report under the launch key."""
    body = json.dumps([node, state, code, sent_at], separators=(",", ":"))
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class NodeReport:
    """One node as the hub last heard of it."""

    state: str  # "alive" | "done"
    code: int | None  # the launcher's exit code once done
    age_s: float  # seconds since the report, on the hub's clock

    def lost(self, timeout_s: float) -> bool:
        """Still alive by its last report, but silent for longer than ``timeout_s``."""
        return self.state == "alive" and self.age_s > timeout_s


@dataclass(frozen=True)
class _Heard:
    """A node's last accepted report, as the hub keeps it (``heard_at``: the hub's liveness clock)."""

    state: str
    code: int | None
    heard_at: float


class _Hub(socketserver.ThreadingTCPServer):
    """Node 0's listener: records each node's last report and answers with every node's."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        node_count: int,
        key: str | None,
        io_timeout_s: float,
        clock: Callable[[], float],
    ):
        self.node_count = node_count
        self.clock = clock
        self.key = key
        self.io_timeout_s = io_timeout_s
        self.lock = threading.Lock()
        self.reports: dict[int, _Heard] = {}
        self.sent_at: dict[int, float] = {}  # each node's last accepted report time (its clock)
        super().__init__(address, _HubHandler)

    def record(
        self, node: int, state: str, code: int | None, sent_at: float
    ) -> list[NodeReport | None] | str:
        """Keep ``node``'s report (a done report is final) and return every node's; a report not later
        than the last one taken from ``node`` is a replay: the reason it is refused."""
        with self.lock:
            last = self.sent_at.get(node)
            if last is not None and sent_at <= last:
                return f"replayed report: node {node} already reported at {last:.6f}, this one says {sent_at:.6f}"
            self.sent_at[node] = sent_at
            heard = self.reports.get(node)
            if heard is None or heard.state != "done":
                self.reports[node] = _Heard(state, code, self.clock())
        return self.view()

    def view(self) -> list[NodeReport | None]:
        now = self.clock()
        with self.lock:
            return [
                None
                if (r := self.reports.get(n)) is None
                else NodeReport(r.state, r.code, round(now - r.heard_at, 3))
                for n in range(self.node_count)
            ]


class _HubHandler(socketserver.StreamRequestHandler):
    server: _Hub

    def handle(self) -> None:
        self.connection.settimeout(self.server.io_timeout_s)
        try:
            line = self.rfile.readline(_MAX_LINE + 1)
            reply = self._answer(line)
            if len(line) > _MAX_LINE:  # read what is left (bounded) so closing does not reset the reply
                self.rfile.read(_MAX_LINE * 16)
        except (OSError, ValueError, RecursionError) as exc:  # garbage, too deep, a vanished client: answer
            reply = {"ok": False, "error": f"malformed report ({type(exc).__name__}: {str(exc)[:200]})"}
        try:
            self.wfile.write((json.dumps(reply) + "\n").encode())
        except OSError:
            return  # the client is gone; its next report (or its silence) tells the story

    def _answer(self, line: bytes) -> dict[str, Any]:
        if len(line) > _MAX_LINE or not line.endswith(b"\n"):
            return {"ok": False, "error": f"one JSON line of at most {_MAX_LINE} bytes"}
        message = json.loads(line)
        if not isinstance(message, dict):
            return {"ok": False, "error": "send a JSON object"}
        node, state, code = message.get("node"), message.get("state"), message.get("code")
        sent_at, mac = message.get("sent_at"), message.get("mac")
        if type(sent_at) not in (int, float):  # bool is not a time
            return {"ok": False, "error": "sent_at must be the report's time (seconds since the epoch)"}
        key = self.server.key
        if key is not None and not (
            isinstance(mac, str)
            and hmac.compare_digest(mac.encode(), report_mac(key, node, state, code, sent_at).encode())
        ):
            return {"ok": False, "error": "report not signed with the launch key (ROLLMATCH_API_KEY)"}
        if not (type(node) is int and 0 <= node < self.server.node_count):
            return {"ok": False, "error": f"node must be 0..{self.server.node_count - 1}"}
        if state not in ("alive", "done") or not (code is None or type(code) is int):
            return {"ok": False, "error": "state must be alive or done, code an integer or null"}
        skew = sent_at - time.time()
        if abs(skew) > STALE_S:
            return {
                "ok": False,
                "error": f"stale report: its time is {abs(skew):.0f}s {'behind' if skew < 0 else 'ahead of'} "
                f"the hub's clock (more than {STALE_S:g}s: a replayed report, or clocks that differ: run NTP "
                "on every node)",
            }
        nodes = self.server.record(node, state, code, float(sent_at))
        if isinstance(nodes, str):
            return {"ok": False, "error": nodes}
        return {"ok": True, "nodes": [None if r is None else asdict(r) for r in nodes]}


class NodeHeartbeat:
    """This node's side of the heartbeat (node 0 also hosts the hub); see the module docstring.
    ``clock``: the monotonic clock ages, the join timeout and the hub's silence are judged on."""

    def __init__(
        self,
        *,
        node_rank: int,
        hosts: list[str],
        port: int,
        timeout_s: float,
        join_timeout_s: float,
        key: str | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.node_rank = node_rank
        self.clock = clock
        self.hosts = hosts
        self.port = port
        self.timeout_s = timeout_s
        self.join_timeout_s = join_timeout_s
        self.key = key
        self.interval_s = min(max(timeout_s / 5, 0.2), 2.0)
        self._hub: _Hub | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._view: list[NodeReport | None] = [None] * len(hosts)
        self._problem: str | None = None
        self._started = 0.0
        self._last_answer = 0.0
        self._sent_at = 0.0
        self._beats = 0

    @property
    def beats(self) -> int:
        """How many heartbeat reports this node has made so far, answered or not (each one judged the
        others if the hub answered)."""
        with self._lock:
            return self._beats

    @property
    def hub_address(self) -> str:
        return f"{self.hosts[0]}:{self.port}"

    def node_name(self, rank: int) -> str:
        return f"node {rank} ({self.hosts[rank]})"

    def start(self) -> None:
        """Node 0: open the hub (a taken port is refused, naming the key); every node: start reporting."""
        self._started = self._last_answer = self.clock()
        if self.node_rank == 0:
            try:
                self._hub = _Hub(
                    (self.hosts[0], self.port), len(self.hosts), self.key, self.interval_s * 2, self.clock
                )
            except OSError as exc:
                raise LaunchError(
                    [
                        ConfigProblem(
                            PORT_KEY,
                            self.port,
                            f"node 0 cannot listen at {self.hub_address} for the nodes' heartbeat ({exc}); "
                            "choose a free port (default: the rendezvous port + 1)",
                        )
                    ]
                ) from exc
            threading.Thread(
                target=self._hub.serve_forever, name="rollmatch-heartbeat-hub", daemon=True
            ).start()
        self._thread = threading.Thread(target=self._run, name="rollmatch-heartbeat", daemon=True)
        self._thread.start()

    def problem(self) -> str | None:
        """Why this node must stop (another node lost, never joined, or failed), or None."""
        with self._lock:
            return self._problem

    def learners_done(self, learner_nodes: list[int]) -> dict[int, int] | None:
        """The exit codes of ``learner_nodes`` once every one of them reported done, else None."""
        with self._lock:
            reports = [self._view[r] for r in learner_nodes]
        if all(r is not None and r.state == "done" for r in reports):
            return {
                n: r.code if r is not None and r.code is not None else 1
                for n, r in zip(learner_nodes, reports, strict=True)
            }
        return None

    def wait_for_problem(self, timeout_s: float) -> str | None:
        """Block up to ``timeout_s`` for a problem to show (after this node's learner failed: did a peer
        go first?); returns it or None."""
        deadline = time.monotonic() + timeout_s
        while (found := self.problem()) is None and time.monotonic() < deadline:
            self._stop.wait(self.interval_s)
        return found

    def finish(self, code: int) -> None:
        """Report done with ``code``; node 0 keeps the hub up until every node is done or lost (at most
        one timeout), then closes it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s * 4)
        try:
            self._exchange("done", code)
        except OSError as exc:  # the hub is gone: the others learn it from its silence
            log.warning(
                "could not report this node's end to the heartbeat hub at %s: %s", self.hub_address, exc
            )
        if self._hub is None:
            return
        deadline = self.clock() + self.timeout_s
        while self.clock() < deadline and not self._everyone_done_or_lost():
            time.sleep(self.interval_s)
        self._hub.shutdown()
        self._hub.server_close()

    # ------------------------------------------------------------------------------------ private
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._exchange("alive", None)
            except OSError as exc:
                silent = self.clock() - self._last_answer
                if silent > self.timeout_s and not self._seen_done(0):
                    self._set_problem(
                        f"{self.node_name(0)} lost: its heartbeat hub at {self.hub_address} has not answered for "
                        f"{silent:.0f}s ({TIMEOUT_KEY}={self.timeout_s:g}; last error: {exc}); its launcher was "
                        "killed or the network between the nodes failed"
                    )
            with self._lock:
                self._beats += 1
            self._stop.wait(self.interval_s)

    def _exchange(self, state: str, code: int | None) -> None:
        """One report and the view it returns (raises OSError when the hub cannot be reached or refuses)."""
        with self._lock:  # strictly later than this node's last report: the hub refuses replays
            self._sent_at = sent_at = max(time.time(), self._sent_at + 1e-6)
        report = {"node": self.node_rank, "state": state, "code": code, "sent_at": sent_at}
        if self.key is not None:
            report["mac"] = report_mac(self.key, self.node_rank, state, code, sent_at)
        message = json.dumps(report) + "\n"
        with socket.create_connection((self.hosts[0], self.port), timeout=self.interval_s * 2) as conn:
            conn.settimeout(self.interval_s * 2)
            conn.sendall(message.encode())
            reply_line = conn.makefile("rb").readline(_MAX_LINE * 4)
        try:
            reply = json.loads(reply_line)
        except ValueError as exc:
            raise OSError(f"the heartbeat hub answered {reply_line[:200]!r}") from exc
        if not reply.get("ok"):
            raise OSError(f"the heartbeat hub refused this node's report: {reply.get('error')}")
        view = [
            None if r is None else NodeReport(r["state"], r["code"], float(r["age_s"]))
            for r in reply["nodes"]
        ]
        self._last_answer = self.clock()
        with self._lock:
            self._view = view
        self._judge(view)

    def _judge(self, view: list[NodeReport | None]) -> None:
        since_start = self.clock() - self._started
        for rank, report in enumerate(view):
            if rank == self.node_rank:
                continue
            if report is None:
                if since_start > self.join_timeout_s:
                    self._set_problem(
                        f"{self.node_name(rank)} never joined: no heartbeat within {JOIN_KEY}={self.join_timeout_s:g}s "
                        f"(its `rollmatch launch` did not start, or cannot reach node 0 at {self.hub_address})"
                    )
            elif report.lost(self.timeout_s):
                self._set_problem(
                    f"{self.node_name(rank)} lost: no heartbeat for {report.age_s:.0f}s ({TIMEOUT_KEY}="
                    f"{self.timeout_s:g}); its launcher was killed or its network failed"
                )
            elif report.state == "done" and report.code not in (0, EXIT_PREEMPTED):
                self._set_problem(
                    f"{self.node_name(rank)} failed: its launcher exited with code {report.code}"
                )

    def _set_problem(self, message: str) -> None:
        with self._lock:
            if self._problem is None:
                self._problem = message

    def _seen_done(self, rank: int) -> bool:
        with self._lock:
            report = self._view[rank]
        return report is not None and report.state == "done"

    def _everyone_done_or_lost(self) -> bool:
        assert self._hub is not None
        return all(
            report is not None and (report.state == "done" or report.lost(self.timeout_s))
            for rank, report in enumerate(self._hub.view())
            if rank != self.node_rank
        )
