"""Rollout-server hammer: adversarial inputs against a real server while a prober times ``/health/``.

Prints ONE JSON object::

    {"bound_health_s": 0.5, "ok": true, "server_peak_rss_mib": M, "bound_rss_mib": B,
     "cases": {"redos": {"requests": n, "statuses": {"422": n}, "health_probes": p,
                         "health_max_s": x, "health_p99_s": y, "health_failures": 0,
                         "rss_after_mib": r, "seconds": s}, ...},
     "engine": "hf", "model": {...}}

One real ``rollmatch serve`` process (a tiny random Qwen2.5-VL; ``--engine hf`` by default) on
127.0.0.1. Each case runs ``--workers`` client threads in a bounded loop (``--requests`` calls per
worker, and at most ``--case-seconds``), while a prober thread sends ``GET /health/`` every 50 ms
(5 s timeout; a failed probe counts as a failure and as a 5 s latency). ``ok`` is true when every
probe of every case answered 200 within ``--bound-health-s`` and the server's peak RSS (VmHWM)
stayed under ``--bound-rss-mib``; the script exits 1 otherwise.

Cases (``--cases``; the registry :data:`CASES` takes more, e.g. the engine's own):
- ``redos``: unterminated ``\\"`` escape strings, with and without a megabyte of ``[``;
- ``tiny_values``: 8 MB of tiny requests and 8 MB of prompt ids;
- ``invalid_values``: a million prompt ids of ``-1``, 300k unknown keys, a million numbers as images
  (one validation error per value before fail-fast validation);
- ``image_containers``: a TIFF with a 3M-entry strip table, a JPEG with 1M empty APP0 segments and
  a progressive JPEG of 2,000 scans (container bombs that pass every pixel check);
- ``chunked_uploads``: a 1-byte-chunked upload for 2 s (refused with 411 and closed at once);
- ``big_sync``: 8 MiB ``peft_config`` bodies with and without the sync lease;
- ``padded_images``: a 1x1 PNG padded with 40 MiB (53 MiB of base64, within ``--max-body-bytes``);
- ``reset_storm``: ``/reset_prefix_cache/`` from every worker at once, with a good call in flight;
- ``disconnecting_clients``: good calls whose client closes the socket before the answer.

Run: ``.venv/bin/python bench/server_hammer.py [--cases redos big_sync ...] [--workers 4]
[--requests 6] [--case-seconds 20] [--scale 1.0]`` (about 2 minutes on 2 CPU cores);
``--server-src DIR`` runs the server from another source tree (``git archive`` of an older commit)
for a before / after comparison.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ONE_THREAD, free_port, start_server

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.models.tiny import TinySize, build_tiny_model
from rollmatch.server import adversarial

PROBE_EVERY_S = 0.05
PROBE_TIMEOUT_S = 5.0
LEASE_HEADER = "X-Rollmatch-Sync-Lease"
JSON = {"content-type": "application/json"}


@functools.cache
def _body(name: str, *sizes: int) -> bytes:
    """Each adversarial body built once (the hammer's own CPU stays off the measurement)."""
    return getattr(adversarial, name)(*sizes)


@dataclass
class Target:
    """The server under the hammer, as the cases see it."""

    url: str
    lease: str
    scale: float
    good_body: bytes

    def post(self, path: str, body: bytes, *, leased: bool = False, timeout: float = 60.0) -> int:
        headers = {**JSON, **({LEASE_HEADER: self.lease} if leased else {})}
        try:
            return requests.post(f"{self.url}{path}", data=body, headers=headers, timeout=timeout).status_code
        except requests.RequestException:
            return 0  # no answer (connection closed by the server)


Case = Callable[[Target], list[int]]  # one round of one worker: the statuses it saw


# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
# --report-only: the smoke run checks that every case runs and reports, not how busy the machine is (the
# /health/ bound is a wall-clock figure; the attack tests in tests/server hold the bounds that matter).
SMOKE_ARGS = "--workers 1 --requests 1 --case-seconds 2 --scale 0.02 --report-only"
SMOKE_KEYS = ("ok", "cases", "server_peak_rss_mib", "bound_health_s")


def _redos(target: Target) -> list[int]:
    return [
        target.post("/infer/", _body("redos_escapes", 16_000)),
        target.post("/infer/", _body("redos_escapes_then_brackets", 300, int((1 << 20) * target.scale))),
    ]


def _tiny_values(target: Target) -> list[int]:
    size = int((8 << 20) * target.scale)
    return [
        target.post("/infer/", _body("many_tiny_requests", size)),
        target.post("/infer/", _body("many_prompt_ids", size)),
    ]


def _invalid_values(target: Target) -> list[int]:
    return [
        target.post("/infer/", _body("invalid_prompt_ids", int(1_048_000 * target.scale))),
        target.post("/infer/", _body("unknown_keys", int(300_000 * target.scale))),
        target.post("/infer/", _body("non_string_images", int(1_000_000 * target.scale))),
    ]


def _image_containers(target: Target) -> list[int]:
    return [
        target.post("/infer/", _body("tiff_strip_table", int(3_000_000 * target.scale))),
        target.post("/infer/", _body("jpeg_many_segments", int(1_000_000 * target.scale))),
        target.post("/infer/", _body("jpeg_many_scans", 2_000)),
    ]


def _chunked_uploads(target: Target) -> list[int]:
    """1-byte chunks (one 64 KiB send of framing after another, 2 s at most), without and with the
    key's absence mattering: the answer must come at once and the server must close the socket."""
    host, port = target.url.removeprefix("http://").split(":")
    head = (
        f"POST /infer/ HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    piece = b"1\r\nx\r\n" * 10_000
    statuses = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        started = time.monotonic()
        try:
            while time.monotonic() - started < 2.0:
                sock.sendall(piece)
        except OSError:
            pass  # closed by the server: what it should do
        try:
            answer = sock.recv(64)
            statuses.append(int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/1.1 ") else 0)
        except OSError:
            statuses.append(0)
    return statuses


def _big_sync(target: Target) -> list[int]:
    body = _body("big_peft_config", int((8 << 20) * target.scale))
    return [
        target.post("/update_adapter_flattened_param/", body),
        target.post("/update_adapter_flattened_param/", body, leased=True),
    ]


def _padded_images(target: Target) -> list[int]:
    return [
        target.post("/infer/", _body("padded_png", int((40 << 20) * target.scale)))
    ]  # within --max-body-bytes


def _reset_storm(target: Target) -> list[int]:
    statuses: list[int] = []
    call = threading.Thread(target=lambda: statuses.append(target.post("/infer/", target.good_body)))
    call.start()
    statuses += [target.post("/reset_prefix_cache/", b"", timeout=120) for _ in range(5)]
    call.join(timeout=120)
    return statuses


def _disconnecting_clients(target: Target) -> list[int]:
    host, port = target.url.removeprefix("http://").split(":")
    head = (
        f"POST /infer/ HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(target.good_body)}\r\n\r\n"
    ).encode()
    for _ in range(4):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head + target.good_body)
            time.sleep(0.05)  # gone before the answer
    return [target.post("/infer/", target.good_body)]


CASES: dict[str, Case] = {
    "redos": _redos,
    "tiny_values": _tiny_values,
    "invalid_values": _invalid_values,
    "image_containers": _image_containers,
    "chunked_uploads": _chunked_uploads,
    "big_sync": _big_sync,
    "padded_images": _padded_images,
    "reset_storm": _reset_storm,
    "disconnecting_clients": _disconnecting_clients,
}


class Prober:
    """``bench/health_prober.py`` in its own process (the hammer's threads cannot delay it) until
    :meth:`stop`; then ``latencies`` (seconds) and ``failures``."""

    def __init__(self, url: str):
        self.latencies: list[float] = []
        self.failures = 0
        command = [sys.executable, str(Path(__file__).resolve().parent / "health_prober.py"), url]
        command += ["--every-s", str(PROBE_EVERY_S), "--timeout-s", str(PROBE_TIMEOUT_S)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != b"ready":
            raise RuntimeError("the /health/ prober did not start")

    def stop(self) -> None:
        out, _ = self._process.communicate(b"", timeout=PROBE_TIMEOUT_S + 30)  # stdin closed: stop
        result = json.loads(out)
        self.latencies, self.failures = result["latencies"], result["failures"]


def run_case(name: str, case: Case, target: Target, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    prober = Prober(target.url)
    statuses: dict[str, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + args.case_seconds
    started = time.monotonic()

    def worker() -> None:
        for _ in range(args.requests):
            if time.monotonic() > deadline:
                return
            for status in case(target):
                with lock:
                    statuses[str(status)] = statuses.get(str(status), 0) + 1

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=args.case_seconds + 180)
    prober.stop()
    latencies = sorted(prober.latencies) or [PROBE_TIMEOUT_S]
    return {
        "requests": sum(statuses.values()),
        "statuses": statuses,
        "health_probes": len(prober.latencies),
        "health_max_s": round(latencies[-1], 4),
        "health_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4),
        "health_failures": prober.failures,
        "rss_after_mib": round(_rss_mib(pid, "VmRSS"), 1),
        "seconds": round(time.monotonic() - started, 2),
    }


def _rss_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _good_body() -> bytes:
    from PIL import Image

    from rollmatch.protocol import to_base64

    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (120, 60, 30)).save(buffer, format="PNG")
    request = {
        "messages": [{"role": "user", "content": "<image>find"}],
        "images": [to_base64(buffer.getvalue())],
    }
    return json.dumps({"infer_requests": [request] * 2, "request_config": {"max_tokens": 16}}).encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="rounds per worker and case")
    parser.add_argument("--case-seconds", type=float, default=20.0, help="no new round after this")
    parser.add_argument("--scale", type=float, default=1.0, help="size of the large bodies (1: as measured)")
    parser.add_argument("--bound-health-s", type=float, default=0.5)
    parser.add_argument("--bound-rss-mib", type=float, default=2048.0)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="exit 0 whatever `ok` says (the JSON still carries it)",
    )
    parser.add_argument(
        "--server-src",
        default=None,
        help="run the server from this source tree (PYTHONPATH), e.g. an older commit",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="server-hammer-") as tmp:
        size = TinySize()
        model_dir = build_tiny_model("qwen2_5_vl", Path(tmp) / "model", size=size)
        port = free_port()
        env = {**ONE_THREAD, **({"PYTHONPATH": args.server_src} if args.server_src else {})}
        cwd = Path(args.server_src) if args.server_src else None
        process = start_server(
            model_dir, port, Path(tmp) / "server.log", engine=args.engine, env=env, cwd=cwd
        )
        try:
            url = f"http://127.0.0.1:{port}"
            init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "timeout_s": 3600.0}
            lease = requests.post(f"{url}/init_communicator/", json=init, timeout=30).json()["lease"]
            target = Target(url, lease, args.scale, _good_body())
            cases = {name: run_case(name, CASES[name], target, args, process.pid) for name in args.cases}
            peak = _rss_mib(process.pid, "VmHWM")
            requests.post(f"{url}/close_communicator/", headers={LEASE_HEADER: lease}, timeout=30)
        finally:
            process.terminate()
            process.wait(timeout=30)
    ok = peak < args.bound_rss_mib and all(
        c["health_max_s"] <= args.bound_health_s and c["health_failures"] == 0 for c in cases.values()
    )
    result = {
        "ok": ok,
        "bound_health_s": args.bound_health_s,
        "bound_rss_mib": args.bound_rss_mib,
        "server_peak_rss_mib": round(peak, 1),
        "cases": cases,
        "engine": args.engine,
        "model": asdict(size),
        "workers": args.workers,
        "requests_per_worker": args.requests,
        "scale": args.scale,
    }
    print(json.dumps(result))
    return 0 if ok or args.report_only else 1


if __name__ == "__main__":
    raise SystemExit(main())
