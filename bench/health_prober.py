"""A ``/health/`` prober in its own process (the benchmark's threads cannot delay it): prints
``ready``, sends ``GET URL/health/`` every ``--every-s`` until its stdin closes, then prints one JSON
object ``{"latencies": [...], "failures": n}`` (a failed probe counts ``--timeout-s``).

Run by ``bench/server_hammer.py``; by hand: ``python bench/health_prober.py http://127.0.0.1:8000``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--every-s", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    session = requests.Session()
    latencies: list[float] = []
    failures = 0
    print("ready", flush=True)
    while not stop.is_set():
        started = time.monotonic()
        try:
            ok = session.get(f"{args.url}/health/", timeout=args.timeout_s).status_code == 200
        except requests.RequestException:
            ok = False
        took = time.monotonic() - started
        latencies.append(took if ok else args.timeout_s)
        failures += 0 if ok else 1
        stop.wait(max(0.0, args.every_s - took))
    print(json.dumps({"latencies": latencies, "failures": failures}), flush=True)


if __name__ == "__main__":
    main()
