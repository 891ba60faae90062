"""How rollouts spread over rollout servers: the seed's rule (default) vs opt-in ``rotate_servers``.

Prints ONE JSON object::

    {"seed_rule": {"rollouts_per_server": [..], "max_over_mean": R, "wall_s": T},
     "rotate_servers": {...}, "servers": S, "actors": K, "calls_per_actor": C, "requests_per_call": b, ...}

``S`` real ``rollmatch serve`` processes (HF engine, a tiny random Qwen2.5-VL) on 127.0.0.1; ``K``
clients built the way async actors build theirs (:class:`~rollmatch.rollout.client.ServerBackend`,
``first_server`` = the actor's rank) each make ``C`` calls of ``b`` raccoon requests at once (threads
released together), first under the seed's rule, then with ``rotate_servers``. Small calls (``b < S``)
are what async actors send: under the seed's rule chunk ``i`` always goes to server ``i``, so the
servers past ``b`` get nothing; rotation spreads them.

- ``rollouts_per_server``: rollouts each server answered (from each rollout's provenance), server order.
- ``max_over_mean``: the busiest server's count over the mean (1.0: an even split).
- ``wall_s``: wall time until the last actor's last call returned.

Run: ``.venv/bin/python bench/server_distribution.py [--servers 3] [--actors 2] [--calls 6]
[--requests 1] [--max-new-tokens 8]`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import free_port, start_server
from tiny_size_flags import add_size_flags, size_from

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.collectives import LocalCollectives
from rollmatch.config.schema import DataConfig
from rollmatch.data.convert import from_voc
from rollmatch.data.prompts import PromptEncoder
from rollmatch.models.tiny import build_tiny_model
from rollmatch.rollout.client import ServerBackend, ServerConnection
from rollmatch.rollout.types import Decoding

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
BENCH_SIZE = {"text_layers": 1, "text_hidden": 64, "text_intermediate": 128}
SMOKE_ARGS = "--servers 2 --actors 1 --calls 2 --max-new-tokens 2"
SMOKE_KEYS = ("seed_rule", "rotate_servers", "servers", "actors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--actors", type=int, default=2, help="clients at once, one per learner rank")
    parser.add_argument("--calls", type=int, default=6, help="calls per actor")
    parser.add_argument("--requests", type=int, default=1, help="requests per call (an actor's small call)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    add_size_flags(parser, **BENCH_SIZE)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=2, sort_keys=True))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model_dir = build_tiny_model("qwen2_5_vl", tmp / "model", size=size_from(args))
    encoder = PromptEncoder.from_pretrained(str(model_dir), DataConfig(coord_frame="norm1000"))
    records = from_voc(args.data / "raccoon")[: args.requests]
    requests_ = [encoder.encode(record).to_request() for record in records]
    decoding = Decoding(max_new_tokens=args.max_new_tokens)
    servers, urls = [], []
    try:
        for index in range(args.servers):
            port = free_port()
            servers.append(start_server(model_dir, port, tmp / f"server{index}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        results = {
            name: measure(urls, args, requests_, decoding, rotate)
            for name, rotate in (("seed_rule", False), ("rotate_servers", True))
        }
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)
    return {
        **results,
        "servers": args.servers,
        "actors": args.actors,
        "calls_per_actor": args.calls,
        "requests_per_call": args.requests,
        "max_new_tokens": args.max_new_tokens,
    }


def measure(
    urls: list[str], args: argparse.Namespace, requests_: list[Any], decoding: Decoding, rotate: bool
) -> dict[str, Any]:
    clients = [
        ServerBackend(
            [ServerConnection(url, 1, timeout_s=60.0, infer_timeout_s=600.0) for url in urls],
            collectives=LocalCollectives(),
            tokenizer=None,
            rotate_servers=rotate,
            first_server=rank,
        )
        for rank in range(args.actors)
    ]
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    gate = threading.Barrier(args.actors + 1)

    def actor(client: ServerBackend) -> None:
        gate.wait()
        for call in range(args.calls):
            rollouts = client.generate(requests_, decoding, seed=call)
            with lock:
                counts.update(r.provenance.server for r in rollouts)

    threads = [threading.Thread(target=actor, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    gate.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - started
    for client in clients:
        for connection in client.connections:
            connection.close()
    per_server = [counts[url] for url in urls]
    mean = sum(per_server) / len(per_server)
    return {
        "rollouts_per_server": per_server,
        "max_over_mean": round(max(per_server) / mean, 3),
        "wall_s": round(wall_s, 3),
    }


if __name__ == "__main__":
    main()
