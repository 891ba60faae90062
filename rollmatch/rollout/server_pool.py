"""Which rollout servers a client may use now: failover, the ``min_healthy`` floor and re-admission.

Owns: :class:`ServerPool`, one client's view of its servers' health (the learner's backend and every
async actor's client keep one each). A server whose call fails with
:class:`~rollmatch.errors.ServerDown` (no connection, a 5xx, a timeout, ``/health/`` reporting it
stalled or not answering) is marked *down*; :meth:`ServerPool.run_chunks` re-sends that server's
unfinished chunk to a healthy one, at most once per failure, and keeps exactly one result per chunk
(the first call's result never arrived, so nothing is duplicated). While fewer than ``min_healthy``
servers are up the client fails, naming the down servers (``min_healthy`` = every server: the first
failure ends the run, as before failover existed).

Re-admission: a down server is used again only once it answers ``/health/``, its ``/stats/`` show the
version it serves was pushed to it (a restarted server serves the model directory's weights: no
push, not admitted), and that version is not older than the newest this client has seen. A server that
answers at an older version than it answered at before restarted behind the client's back (a call re-sent
on a fresh connection reached the new process): :meth:`check_served` marks it down the same way. The learner's
pusher brings it there: it pushes full weights on fresh groups to every down server that answers
``/health/`` again (``rollout.weight_push``), then :meth:`admit` marks it up at once. Every push outcome
also reaches the async actors' pools (:meth:`learner_pushed`): a server the push left out is down for
them too, and the learner's version caps the versions that raise the re-admission floor. The other way
round, before each push the pusher takes in what every rank's actor found (:meth:`down_servers`): a server
an actor's call found down is down for the pusher too, so it is not pushed to (no failed attempt, no
second push) unless it answers ``/health/`` again, and then it is re-synced like any down server. A server whose
pushes keep failing is re-tried with back-off (:meth:`push_failed`, :meth:`resync_due`). Leaves out: HTTP
(``rollout.connection``), chunking (``rollout.client``) and the weight push itself (``rollout.weight_push``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import requests

from rollmatch.errors import BackendError, ServerDown
from rollmatch.protocol import ServerStats
from rollmatch.rollout.connection import KEY, ServerConnection

log = logging.getLogger(__name__)
T = TypeVar("T")
_PROBE_EVERY_S = 5.0  # how often a down server is asked whether it is back (each probe: <= 2 s)
_PROBE_TIMEOUT_S = 2.0
_MAX_RESYNC_SKIPS = 32  # a server whose pushes keep failing is tried again at most every 33 pushes
MIN_HEALTHY_KEY = f"{KEY}.server.min_healthy"


class ServerPool:
    """One client's servers, each up or down (see the module docstring)."""

    def __init__(self, connections: Sequence[ServerConnection], *, min_healthy: int | None = None):
        self.connections = list(connections)
        total = len(self.connections)
        self.min_healthy = total if min_healthy is None else int(min_healthy)
        if not 1 <= self.min_healthy <= total:
            raise BackendError(
                f"{MIN_HEALTHY_KEY} is {self.min_healthy} but the run has {total} server(s): set it between 1 "
                f"and {total}, or leave it null (every server must stay healthy)"
            )
        self._down: dict[str, str] = {}  # url -> why it went down
        self._next_probe: dict[str, float] = {}
        self._version_floor = 0  # the newest weight version a reply of any server carried
        self._version_ceiling: int | None = None  # the learner's version (None: not told yet)
        self._push_failures: Counter[str] = Counter()  # url -> pushes failed in a row
        self._resync_skips: dict[str, int] = {}  # url -> pushes left before it is tried again
        self._served: dict[str, int] = {}  # url -> the newest weight version a reply of that server carried
        self._sums: Counter[str] = Counter()

    # ------------------------------------------------------------------------------- state
    def is_down(self, conn: ServerConnection) -> bool:
        return conn.url in self._down

    def down_servers(self) -> dict[str, str]:
        """``{url: why}`` of the servers down now (a copy: another thread's client may mark one)."""
        return self._down.copy()

    @property
    def healthy(self) -> list[ServerConnection]:
        """The servers in use now (no probing)."""
        return [c for c in self.connections if c.url not in self._down]

    def mark_down(self, conn: ServerConnection, why: str, *, count: bool = True) -> None:
        """Stop using ``conn`` until it is re-admitted; counts one failover (``count``: False where another
        client's pool already counted this failure)."""
        if conn.url in self._down:
            return
        self._down[conn.url] = why
        self._next_probe[conn.url] = time.monotonic() + _PROBE_EVERY_S
        if count:
            self._sums["servers/failovers"] += 1
        log.warning(
            "rollout server %s marked down (%d of %d servers left): %s",
            conn.url,
            len(self.healthy),
            len(self.connections),
            why,
        )

    def admit(self, conn: ServerConnection, version: int) -> None:
        """``conn`` now serves ``version``, pushed by this run: use it again."""
        self.seen_version(version)
        self._served[conn.url] = int(version)
        self._push_failures.pop(conn.url, None)
        self._resync_skips.pop(conn.url, None)
        if self._down.pop(conn.url, None) is not None:
            log.warning("rollout server %s re-admitted at weight version %d", conn.url, version)

    def seen_version(self, version: int) -> None:
        """A reply carried ``version``; versions above the learner's (a server still at a version of a run
        the learner resumed behind) never raise the re-admission floor."""
        version = int(version)
        if self._version_ceiling is not None and version > self._version_ceiling:
            return
        self._version_floor = max(self._version_floor, version)

    def learner_pushed(self, version: int, servers: Sequence[str], why: str, *, count: bool) -> None:
        """The learner's push of ``version`` reached exactly ``servers`` (urls): those serve it now, every
        other server is down for this client too until a later push re-admits it (an actor's client
        would otherwise keep rolling out on a server the learner can no longer update)."""
        self._version_ceiling = int(version)
        self._version_floor = min(self._version_floor, int(version))
        for conn in self.connections:
            if conn.url in servers:
                self.admit(conn, version)
            else:
                self.mark_down(conn, why, count=count)

    def newly_down_in(self, others: Sequence[ServerPool]) -> dict[str, str]:
        """``{url: why}`` of the servers some of ``others`` (the async actors' pools) found down while this
        pool counts them as up: what they learned since the last push."""
        found: dict[str, str] = {}
        for pool in others:
            for url, why in pool.down_servers().items():
                if url not in self._down:
                    found.setdefault(url, why)
        return found

    def take_in_found_down(self, found_by_rank: Sequence[dict[str, str]]) -> None:
        """The pusher's pool: a server some rank's actor found down (:meth:`newly_down_in`, gathered from
        every rank) is down here too (the actor counted the failover), so the push leaves it out until it
        answers ``/health/`` again and is re-synced."""
        for rank, found in enumerate(found_by_rank):
            for conn in self.connections:
                if conn.url in found:
                    self.mark_down(
                        conn, f"found down by rank {rank}'s rollout actor: {found[conn.url]}", count=False
                    )

    def push_failed(self, conn: ServerConnection) -> None:
        """A push to ``conn`` failed: skip it in the next 1, 2, 4 ... (at most 32) pushes' re-syncs, so a
        server that answers ``/health/`` but cannot take weights does not cost every push a failed
        attempt and a second push."""
        self._push_failures[conn.url] += 1
        self._resync_skips[conn.url] = min(2 ** (self._push_failures[conn.url] - 1), _MAX_RESYNC_SKIPS)

    def resync_due(self, conn: ServerConnection) -> bool:
        """Whether the coming push should try to re-sync the down server ``conn`` (counts one push)."""
        left = self._resync_skips.get(conn.url, 0)
        if left > 0:
            self._resync_skips[conn.url] = left - 1
            return False
        return True

    def served_version(self, conn: ServerConnection) -> int:
        """The newest version ``conn`` answered at so far (0: none yet): a call's ``since``."""
        return self._served.get(conn.url, 0)

    def check_served(
        self, conn: ServerConnection, versions: Sequence[int], *, since: int | None = None
    ) -> None:
        """Raise :class:`ServerDown` when ``conn`` answers at an older weight version than it answered at
        before (``versions``: the newest version behind each answer): one server process only moves
        forward, so another process answers on its port (restarted, serving the model directory's
        weights, not re-synced). Its answer is not used; the chunk goes to a healthy server and the
        pusher re-syncs this one. ``since``: what :meth:`served_version` said when this call was sent;
        only that counts, since calls on one server end in any order (two re-sent chunks: the one that
        ended first may carry a version pushed while the other ran). (A client that never had an answer from that server cannot tell: in
        async mode the version window drops such rollouts as stale; the other modes push before each
        rollout phase through the same client, and that push finds the restart first.)"""
        if not versions:
            return
        served = self._served.get(conn.url, 0)
        before, oldest = (served if since is None else since), min(versions)
        if oldest < before:
            raise ServerDown(
                f"rollout server {conn.url} answered at weight version {oldest} after serving {before}: it "
                "restarted and was not re-synced yet; its answer is dropped"
            )
        self._served[conn.url] = max(served, max(versions))

    def check_enough(self) -> None:
        """Raise, naming every down server, when fewer than ``min_healthy`` are up."""
        if len(self.healthy) >= self.min_healthy:
            return
        down = "; ".join(
            f"{url} ({why})" for url, why in list(self._down.items())
        )  # the learner's thread may update it
        lower = (
            f", or lower {MIN_HEALTHY_KEY} to keep training on the others"
            if len(self.connections) > 1
            else ""
        )
        raise BackendError(
            f"rollout server(s) down: {down}. {len(self.healthy)} of {len(self.connections)} server(s) healthy, "
            f"fewer than {MIN_HEALTHY_KEY} = {self.min_healthy}. Restart them (`launch.restart_servers` does it "
            f"under `rollmatch launch`){lower}"
        )

    def take_sums(self) -> Counter[str]:
        """``servers/*`` sums since the last call: failovers, re-sent calls, and the healthy-server count
        seen by each rollout call (``servers/healthy_sum`` over ``servers/calls``)."""
        sums, self._sums = self._sums, Counter()
        return sums

    # --------------------------------------------------------------------------- rollouts
    def usable(self) -> list[ServerConnection]:
        """The healthy servers after re-admitting those that are back at a pushed version; raises
        below ``min_healthy``."""
        now = time.monotonic()
        for conn in [c for c in self.connections if c.url in self._down]:
            if now < self._next_probe.get(conn.url, 0.0):
                continue
            self._next_probe[conn.url] = now + _PROBE_EVERY_S
            version = self._pushed_version(conn)
            if version is not None and version >= self._version_floor:
                self.admit(conn, version)
        self.check_enough()
        return self.healthy

    def answering(self, among: Sequence[ServerConnection] | None = None) -> list[ServerConnection]:
        """Of ``among`` (default: the down servers, which the pusher re-syncs), those whose ``/health/``
        answers 200."""
        candidates = [c for c in self.connections if c.url in self._down] if among is None else among
        return [c for c in candidates if _health_ok(c)]

    def run_chunks(
        self,
        assigned: Sequence[tuple[ServerConnection, T]],
        call: Callable[[ServerConnection, T], object],
    ) -> list[object]:
        """``call(server, chunk)`` for every pair, in parallel; results in order. A chunk whose server is
        down (:class:`ServerDown`) goes to the next healthy server once per failure; any other error is
        raised once every call ended. Raises below ``min_healthy``."""
        results: dict[int, object] = {}
        pending = [(index, conn, chunk) for index, (conn, chunk) in enumerate(assigned)]
        self._sums["servers/calls"] += 1
        self._sums["servers/healthy_sum"] += len(self.healthy)
        while pending:
            failed: list[tuple[int, T]] = []
            for (index, conn, chunk), outcome in zip(pending, _run_all(pending, call), strict=True):
                if isinstance(outcome, ServerDown):
                    self.mark_down(conn, str(outcome))
                    failed.append((index, chunk))
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    results[index] = outcome
            if not failed:
                break
            self.check_enough()
            healthy = self.healthy
            self._sums["servers/resent_calls"] += len(failed)
            pending = [(index, healthy[n % len(healthy)], chunk) for n, (index, chunk) in enumerate(failed)]
            log.warning(
                "re-sending %d rollout call(s) to %s", len(failed), sorted({c.url for _, c, _ in pending})
            )
        return [results[index] for index in range(len(assigned))]

    def _pushed_version(self, conn: ServerConnection) -> int | None:
        """The version ``conn`` serves if it answers and that version was pushed to it, else None."""
        if not _health_ok(conn):
            return None
        try:
            reply = conn.session.get(f"{conn.url}/stats/", timeout=_PROBE_TIMEOUT_S)
            stats = ServerStats.model_validate(reply.json()) if reply.status_code == 200 else None
        except (requests.RequestException, ValueError):
            return None
        if stats is None or stats.weight_version not in stats.pushes_by_version:
            return None
        return stats.weight_version


def _health_ok(conn: ServerConnection) -> bool:
    try:
        return conn.session.get(f"{conn.url}/health/", timeout=_PROBE_TIMEOUT_S).status_code == 200
    except requests.RequestException:
        return False


def _run_all(
    pending: Sequence[tuple[int, ServerConnection, T]], call: Callable[[ServerConnection, T], object]
) -> list[object]:
    """Each call's result or exception (every call ends before this returns)."""
    if len(pending) == 1:  # one server: no thread to start and hand the answer back from
        _, conn, chunk = pending[0]
        try:
            return [call(conn, chunk)]
        except BaseException as exc:  # handed back to run_chunks, which decides
            return [exc]
    with ThreadPoolExecutor(max_workers=len(pending)) as pool:
        futures = [pool.submit(call, conn, chunk) for _, conn, chunk in pending]
        return [future.exception() or future.result() for future in futures]
