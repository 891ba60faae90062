"""Cost of the weight-sync checksum per MiB. Prints ONE JSON object.

``keyed_mib_per_s``: :func:`rollmatch.sync.digest.bucket_checksum` (HMAC-SHA256 tree, leaves in its
thread pool) over one ``--bucket-mb`` bucket; ``word_sum_mib_per_s``: the unkeyed sum of 64-bit words
that checksums used before (its cost floor: one pass over memory), for comparison;
``sha256_one_core_mib_per_s`` and ``blake2b_keyed_one_core_mib_per_s``: one hash over the whole
buffer, one thread. Best of ``--repeats`` (other processes on a shared machine only add time).

Run: ``.venv/bin/python bench/sync_digest.py [--bucket-mb 64] [--repeats 7]`` (seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable

import torch

from rollmatch.sync.digest import bucket_checksum, new_digest_key
from rollmatch.sync.weights import TensorMeta

# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--bucket-mb 1 --repeats 1"
SMOKE_KEYS = ("keyed_mib_per_s", "word_sum_mib_per_s", "sha256_one_core_mib_per_s")


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    size = args.bucket_mb << 20
    flat = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    metas = [TensorMeta("w", "uint8", (size,), 0, size)]
    key, data = new_digest_key(), memoryview(flat.numpy())
    paths: dict[str, Callable[[], object]] = {
        "keyed_mib_per_s": lambda: bucket_checksum(key, metas, flat),
        "word_sum_mib_per_s": lambda: int(flat.view(torch.int64).sum()),
        "sha256_one_core_mib_per_s": lambda: hashlib.sha256(data).digest(),
        "blake2b_keyed_one_core_mib_per_s": lambda: hashlib.blake2b(data, key=key).digest(),
    }
    result: dict[str, object] = {
        "bucket_mb": args.bucket_mb,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
    }
    for name, fn in paths.items():
        result[name] = round(args.bucket_mb / _best(fn, args.repeats))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
