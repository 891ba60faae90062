"""Full weight sync from one trainer to S rollout servers: seconds vs S. Prints ONE JSON object.

Rank 0 of the learner pushes every full update to every server itself (one private gloo group per
server, ``rollout.weight_push``), so a sync moves S x the model's bytes out of one process and one NIC.
This measures that on loopback: S receiver processes (each rank 0 of its own group with this process,
the transaction's control messages over a pipe, as ``bench/weight_sync.py`` part 1), the same
synthetic weights (``--payload-mb``) pushed through :func:`~rollmatch.sync.transaction.push_update`
to all of them, best of ``--repeats`` rounds after a warm-up, per S in ``--servers``.

``seconds_over_one_server`` near S means the push is serial in the servers (time grows with S x
bytes); near 1 would mean the copies overlap. On loopback the "network" is memory copies and the
receivers' checksums, sharing the machine's cores with the sender, so the numbers bound what one
sender does, not a NIC's bandwidth (docs/performance.md, "Weight sync to several servers").

Run: ``PYTHONPATH=$PWD .venv/bin/python bench/sync_fanout.py [--payload-mb 64] [--servers 1 2 4]``
(about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import torch

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.sync.transaction import push_update
from rollmatch.sync.transport import GroupTransport
from rollmatch.sync.weights import flatten_buckets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import free_port
from weight_sync import DIGEST_KEY, MB, PipeChannel, _receiver_main, _synthetic_weights

# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--payload-mb 1 --bucket-mb 1 --servers 1 2 --repeats 1"
SMOKE_KEYS = ("payload_mb", "servers")


def bench_fanout(named: list[tuple[str, torch.Tensor]], servers: int, bucket_mb: int, repeats: int) -> float:
    """Best seconds of one full push to ``servers`` receivers."""
    ctx = mp.get_context("spawn")
    ports = [free_port() for _ in range(servers)]
    pipes, processes = [], []
    for port in ports:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_receiver_main, args=(port, child), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    transports = [
        GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=120) for port in ports
    ]
    targets = [(PipeChannel(pipe), transport) for pipe, transport in zip(pipes, transports, strict=True)]
    seconds = []
    for round_ in range(repeats + 1):  # round 0 warms up
        start = time.perf_counter()
        push_update(
            targets, named, version=round_, mode="full", bucket_bytes=bucket_mb * MB, digest_key=DIGEST_KEY
        )
        if round_:
            seconds.append(time.perf_counter() - start)
    for pipe, process, transport in zip(pipes, processes, transports, strict=True):
        pipe.send(("stop", None))
        process.join(timeout=60)
        transport.close()
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload-mb", type=int, default=64)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    named = _synthetic_weights(args.payload_mb)
    total_mb = sum(b.num_bytes for b in flatten_buckets(named, args.bucket_mb * MB)) / MB
    rows: dict[str, Any] = {}
    for servers in args.servers:
        seconds = bench_fanout(named, servers, args.bucket_mb, args.repeats)
        rows[str(servers)] = {
            "seconds": round(seconds, 3),
            "mb_per_s_out": round(servers * total_mb / seconds, 1),
        }
    one = rows[str(args.servers[0])]["seconds"] / args.servers[0]
    for row in rows.values():
        row["seconds_over_one_server"] = round(row["seconds"] / one, 2)
    print(
        json.dumps(
            {
                "payload_mb": round(total_mb, 1),
                "bucket_mb": args.bucket_mb,
                "repeats": args.repeats,
                "servers": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
