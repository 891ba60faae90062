"""``ServerPool`` on its own: chunk failover, the ``min_healthy`` floor and its errors, the sums.

The servers are real sockets on 127.0.0.1: one that answers ``/health/`` and ``/stats/`` like a rollout
server (a tiny HTTP server in a thread), and ports nothing listens on. The calls are the test's own;
only :class:`~rollmatch.errors.ServerDown` is raised to inject a failure.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from local_ports import free_tcp_port

from rollmatch.errors import BackendError, ServerDown
from rollmatch.rollout import server_pool
from rollmatch.rollout.connection import ServerConnection
from rollmatch.rollout.server_pool import ServerPool


def _conn(url: str) -> ServerConnection:
    return ServerConnection(url, 1, timeout_s=2.0, infer_timeout_s=None)


class _Stats(BaseHTTPRequestHandler):
    version = 3
    pushed: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        body = {"status": "ok", "weight_version": self.version}
        if self.path == "/stats/":
            body = {
                "weight_version": self.version,
                "pushes_by_version": self.pushed,
                "failed_pushes": 0,
                "infer_requests": 0,
                "infer_calls": 0,
                "communicator": "none",
            }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stats)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_failed_chunk_goes_once_to_a_healthy_server_and_results_keep_their_order() -> None:
    a, b, c = (_conn(f"http://127.0.0.1:{free_tcp_port()}") for _ in range(3))
    pool = ServerPool([a, b, c], min_healthy=1)
    calls: list[tuple[str, int]] = []

    def call(conn: ServerConnection, chunk: int) -> str:
        calls.append((conn.url, chunk))
        if conn is b:
            raise ServerDown(f"rollout server {b.url}: gone")
        return f"{chunk}@{conn.url}"

    results = pool.run_chunks([(a, 0), (b, 1), (c, 2)], call)
    assert results == [f"0@{a.url}", f"1@{a.url}", f"2@{c.url}"]
    assert sorted(calls) == sorted([(a.url, 0), (b.url, 1), (c.url, 2), (a.url, 1)])  # chunk 1 re-sent once
    assert pool.healthy == [a, c] and pool.is_down(b)
    assert pool.take_sums() == {
        "servers/calls": 1,
        "servers/healthy_sum": 3,
        "servers/failovers": 1,
        "servers/resent_calls": 1,
    }
    assert pool.take_sums() == {}


def test_below_min_healthy_the_error_names_every_down_server_and_the_key() -> None:
    a, b = (_conn(f"http://127.0.0.1:{free_tcp_port()}") for _ in range(2))
    pool = ServerPool([a, b])  # default: every server

    def call(conn: ServerConnection, chunk: int) -> int:
        if conn is b:
            raise ServerDown(f"rollout server {b.url}: connection refused")
        return chunk

    with pytest.raises(BackendError) as caught:
        pool.run_chunks([(a, 0), (b, 1)], call)
    message = str(caught.value)
    assert b.url in message and "connection refused" in message and a.url not in message
    assert (
        "min_healthy = 2" in message
        and "lower custom.extra.rollout_matching.vllm.server.min_healthy" in message
    )


def test_other_errors_are_raised_without_failover() -> None:
    a, b = (_conn(f"http://127.0.0.1:{free_tcp_port()}") for _ in range(2))
    pool = ServerPool([a, b], min_healthy=1)

    def call(conn: ServerConnection, chunk: int) -> int:
        if conn is b:
            raise BackendError(f"rollout server {b.url}: HTTP 422: bad request")  # every server would refuse
        return chunk

    with pytest.raises(BackendError, match="HTTP 422"):
        pool.run_chunks([(a, 0), (b, 1)], call)
    assert pool.healthy == [a, b]


def test_min_healthy_outside_one_to_the_server_count_is_refused() -> None:
    conns = [_conn(f"http://127.0.0.1:{free_tcp_port()}")]
    with pytest.raises(BackendError, match=r"min_healthy is 2 but the run has 1 server"):
        ServerPool(conns, min_healthy=2)


def test_a_down_server_is_readmitted_only_at_a_pushed_version_not_older_than_seen(
    answering_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_pool, "_PROBE_EVERY_S", 0.0)
    back, other = _conn(answering_url), _conn(f"http://127.0.0.1:{free_tcp_port()}")
    pool = ServerPool([back, other], min_healthy=1)
    pool.mark_down(back, "killed")
    _Stats.version, _Stats.pushed = 3, {}  # restarted: serves weights nobody pushed
    assert pool.usable() == [other]
    _Stats.pushed = {"3": 1}
    pool.seen_version(4)  # a newer version was served since
    assert pool.usable() == [other]
    _Stats.version, _Stats.pushed = 4, {"3": 1, "4": 1}
    assert pool.usable() == [back, other]
    assert pool.answering([back, other]) == [back]


def test_a_server_answering_at_an_older_version_than_before_is_marked_down_and_its_chunk_resent() -> None:
    """A restarted process on the same port answers at its model directory's version (0) after the old one
    served 4: its answer is dropped and the chunk goes to another server; a pushed version admits it again."""
    a, b = (_conn(f"http://127.0.0.1:{free_tcp_port()}") for _ in range(2))
    pool = ServerPool([a, b], min_healthy=1)
    served = {a.url: 4, b.url: 4}

    def call(conn: ServerConnection, chunk: int) -> str:
        pool.check_served(conn, [served[conn.url]])
        return f"{chunk}@{conn.url}"

    assert pool.run_chunks([(a, 0), (b, 1)], call) == [f"0@{a.url}", f"1@{b.url}"]
    served[b.url] = 0  # b restarted behind the client's back
    assert pool.run_chunks([(a, 0), (b, 1)], call) == [f"0@{a.url}", f"1@{a.url}"]
    assert pool.is_down(b)
    assert pool.take_sums()["servers/failovers"] == 1
    pool.admit(b, 5)  # the pusher re-synced it at version 5
    served[b.url] = 5
    assert pool.run_chunks([(a, 0), (b, 1)], call) == [f"0@{a.url}", f"1@{b.url}"]
    with pytest.raises(ServerDown, match="answered at weight version 4 after serving 5"):
        pool.check_served(b, [4, 5])


def test_the_learners_push_outcome_drops_the_servers_it_left_out_and_caps_the_floor(
    answering_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor's pool follows the learner's pushes: a server the push left out (its push failed) is down
    for this client too, without counting a second failover; a version above the learner's (a server
    still at an older run's weights) never raises the re-admission floor."""
    monkeypatch.setattr(server_pool, "_PROBE_EVERY_S", 0.0)
    back, other = _conn(answering_url), _conn(f"http://127.0.0.1:{free_tcp_port()}")
    pool = ServerPool([back, other], min_healthy=1)
    pool.learner_pushed(2, [other.url], "left out of the weight push of version 2", count=False)
    assert pool.healthy == [other] and pool.is_down(back)
    assert pool.take_sums()["servers/failovers"] == 0  # the learner's pool counted it
    pool.seen_version(9)  # a reply above the learner's version 2
    _Stats.version, _Stats.pushed = 2, {"2": 1}
    assert pool.usable() == [back, other]  # back at the learner's version: re-admitted
    pool.learner_pushed(3, [back.url, other.url], "unused", count=False)
    assert pool.healthy == [back, other]


def test_a_server_whose_pushes_keep_failing_is_retried_after_1_2_4_pushes() -> None:
    conn = _conn(f"http://127.0.0.1:{free_tcp_port()}")
    pool = ServerPool([conn], min_healthy=1)
    pattern = []
    for _ in range(3):
        pool.push_failed(conn)
        skipped = 0
        while not pool.resync_due(conn):
            skipped += 1
        pattern.append(skipped)
    assert pattern == [1, 2, 4]
    pool.admit(conn, 5)  # re-synced: the next failure starts over at one skipped push
    pool.push_failed(conn)
    assert not pool.resync_due(conn) and pool.resync_due(conn)


def test_two_calls_on_one_server_ending_out_of_order_do_not_mark_it_down() -> None:
    """Two re-sent chunks on one server: the one sent first ends last, at the version it started under,
    after the other answered at a version pushed meanwhile. Each is judged against what the server had
    answered when it was sent, so the server stays up; a real restart (older than at sending) still
    marks it down."""
    conn = _conn(f"http://127.0.0.1:{free_tcp_port()}")
    pool = ServerPool([conn], min_healthy=1)
    pool.check_served(conn, [4])
    first_sent, second_sent = pool.served_version(conn), pool.served_version(conn)
    pool.check_served(conn, [5], since=second_sent)  # the later call ends first, after a push to 5
    pool.check_served(conn, [4], since=first_sent)  # the earlier one ends at 4: not a restart
    assert not pool.is_down(conn) and pool.served_version(conn) == 5
    with pytest.raises(ServerDown, match="answered at weight version 0 after serving 5"):
        pool.check_served(conn, [0], since=pool.served_version(conn))


def test_what_an_actor_found_down_reaches_the_pusher_once_and_not_what_the_push_left_out() -> None:
    """The pusher's pool takes in the servers each rank's actor pool found down since the last push
    (named by rank, not counted again), and nothing the last push itself left out."""
    urls = [f"http://127.0.0.1:{free_tcp_port()}" for _ in range(3)]
    pusher = ServerPool([_conn(u) for u in urls], min_healthy=1)
    actor = ServerPool([_conn(u) for u in urls], min_healthy=1)
    for pool in (pusher, actor):  # the last push reached the first two servers only
        pool.learner_pushed(2, urls[:2], "left out of the push", count=False)
    assert pusher.newly_down_in([actor]) == {}  # the push's own verdict is no news
    actor.mark_down(actor.connections[1], "no connection")  # the actor's call failed on server 1
    found = pusher.newly_down_in([actor])
    assert found == {urls[1]: "no connection"}
    pusher.take_in_found_down([{}, found])  # gathered from two ranks: rank 1's actor found it
    assert pusher.is_down(pusher.connections[1]) and not pusher.is_down(pusher.connections[0])
    assert "rank 1's rollout actor: no connection" in pusher.down_servers()[urls[1]]
    assert pusher.take_sums().get("servers/failovers", 0) == 0  # the actor's pool counted it
    assert actor.take_sums()["servers/failovers"] == 1
