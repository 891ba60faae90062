"""Tools of the attack tests: a ``/health/`` prober, a server's RSS, and a raw-socket sender that
streams an attack body while a reader thread records the answer and when the server closed.

Every attack goes to 127.0.0.1 only, and is bounded in bytes and seconds.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests

PROBE_EVERY_S = 0.05
PROBE_TIMEOUT_S = 5.0


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid`` now, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@dataclass
class HealthRecord:
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    peak_rss_mib: float = 0.0

    @property
    def worst_s(self) -> float:
        return max(self.latencies, default=0.0)


@contextmanager
def health_watch(url: str, pid: int) -> Iterator[HealthRecord]:
    """Probe ``url/health/`` every 50 ms (a new connection each time) and sample the server's RSS
    while the block runs; a probe that fails counts as a failure and as a 5 s latency."""
    record = HealthRecord(peak_rss_mib=rss_mib(pid))
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                ok = requests.get(f"{url}/health/", timeout=PROBE_TIMEOUT_S).status_code == 200
            except requests.RequestException:
                ok = False
            record.latencies.append(time.monotonic() - started if ok else PROBE_TIMEOUT_S)
            record.failures += not ok
            record.peak_rss_mib = max(record.peak_rss_mib, rss_mib(pid))
            stop.wait(PROBE_EVERY_S)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        yield record
    finally:
        stop.set()
        thread.join(timeout=PROBE_TIMEOUT_S + 1)


@dataclass
class AttackResult:
    answer: bytes = b""
    answered_after_s: float | None = None
    closed_after_s: float | None = None
    sent_bytes: int = 0

    @property
    def status(self) -> int | None:
        parts = self.answer.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def attack(
    url: str, head: bytes, more: Callable[[int], bytes | None], *, seconds: float, stop_on_close: bool = True
) -> AttackResult:
    """Send ``head``, then ``more(i)`` (``None``: stop sending) for at most ``seconds``, while a
    reader thread records the first answer bytes and when the server closed the connection."""
    host, port = url.removeprefix("http://").split(":")
    result = AttackResult()
    started = time.monotonic()
    sock = socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S)
    closed = threading.Event()

    def read() -> None:
        sock.settimeout(seconds + 2)
        try:
            while True:
                data = sock.recv(65536)
                if data and result.answered_after_s is None:
                    result.answered_after_s = time.monotonic() - started
                result.answer += data[: max(0, 4096 - len(result.answer))]
                if not data:
                    break
        except OSError:
            pass
        result.closed_after_s = time.monotonic() - started
        closed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        sock.sendall(head)
        result.sent_bytes += len(head)
        index = 0
        while time.monotonic() - started < seconds and not (stop_on_close and closed.is_set()):
            piece = more(index)
            if piece is None:
                break
            sock.sendall(piece)
            result.sent_bytes += len(piece)
            index += 1
        closed.wait(max(0.0, seconds - (time.monotonic() - started)))
    except OSError:
        closed.wait(2.0)  # the server closed (reset) the connection; the reader records when
    finally:
        sock.close()
        reader.join(timeout=seconds + 3)
    return result


def one_byte_chunks(total_bytes: int, block: int = 64 << 10) -> Callable[[int], bytes | None]:
    """A chunked body of 1-byte chunks, ``block`` bytes of framing per send, ``total_bytes`` at most."""
    piece = (b"1\r\nx\r\n" * (block // 6))[:block]
    return lambda i: piece if (i + 1) * len(piece) <= total_bytes else None


def filler(total_bytes: int, block: int = 64 << 10) -> Callable[[int], bytes | None]:
    """Plain body bytes (spaces), ``block`` per send, ``total_bytes`` at most."""
    piece = b" " * block
    return lambda i: piece if (i + 1) * block <= total_bytes else None


def assert_bounded(
    record: HealthRecord, rss_before_mib: float, what: str, *, rss_bound_mib: float = 300
) -> None:
    """The attack bounds: every ``/health/`` answered within 1 s, RSS growth within the bound."""
    assert record.latencies, f"{what}: no /health/ probe ran"
    assert record.failures == 0 and record.worst_s < 1.0, (what, record.worst_s, record.failures)
    grown = record.peak_rss_mib - rss_before_mib
    assert grown <= rss_bound_mib, f"{what}: server RSS grew {grown:.0f} MiB"


def http_head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "", ""]
    return "\r\n".join(lines).encode()


def wait_until_read(server_port: int, clients: list[socket.socket], timeout_s: float = 60.0) -> None:
    """Return once the server process has read every byte these client sockets sent (the server side
    of each connection shows an empty receive queue in ``/proc/net/tcp``): a gate on what the server
    has seen, where a test would otherwise sleep and hope it got there."""
    ports = {sock.getsockname()[1] for sock in clients}
    deadline = time.monotonic() + timeout_s
    while True:
        unread: dict[int, int] = {}
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if local_port == server_port and remote_port in ports:
                unread[remote_port] = int(fields[4].split(":")[1], 16)
        if len(unread) == len(ports) and not any(unread.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the server had not read what {len(ports)} clients sent within {timeout_s} s: {unread}"
            )
        time.sleep(0.01)
