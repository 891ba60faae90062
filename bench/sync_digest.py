"""Cost of the weight-sync checksum per MiB. Prints ONE JSON object.

``keyed_mib_per_s``: :func:`rollmatch.sync.digest.bucket_checksum` (keyed BLAKE3 tree, leaves in its
thread pool) over one ``--bucket-mb`` bucket; ``hmac_sha256_tree_mib_per_s``: the same tree with
HMAC-SHA256 leaves (the construction before keyed BLAKE3), same pool; ``word_sum_mib_per_s``: the
unkeyed sum of 64-bit words that checksums used before keys (its cost floor: one pass over memory);
``sha256_one_core_mib_per_s``, ``blake2b_keyed_one_core_mib_per_s`` and
``blake3_keyed_one_core_mib_per_s``: one hash over the whole buffer, one thread. Best of
``--repeats`` (other processes on a shared machine only add time); the 1-minute load average is
printed beside them.

Run: ``.venv/bin/python bench/sync_digest.py [--bucket-mb 64] [--repeats 7]`` (seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from blake3 import blake3

from rollmatch.sync.digest import LEAF_BYTES, bucket_checksum, leaf_spans, new_digest_key
from rollmatch.sync.weights import TensorMeta

# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--bucket-mb 1 --repeats 1"
SMOKE_KEYS = (
    "keyed_mib_per_s",
    "hmac_sha256_tree_mib_per_s",
    "word_sum_mib_per_s",
    "sha256_one_core_mib_per_s",
)
_HMAC_POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))


def _hmac_sha256_tree(key: bytes, data: memoryview) -> bytes:
    """The leaves of the HMAC-SHA256 tree (``sync.digest`` before keyed BLAKE3), in the same kind of pool."""

    def leaf(span: tuple[int, int]) -> bytes:
        start, end = span
        mac = hmac.new(key, b"leaf" + struct.pack(">QQ", start // LEAF_BYTES, end - start), hashlib.sha256)
        mac.update(data[start:end])
        return mac.digest()

    return hmac.new(key, b"".join(_HMAC_POOL.map(leaf, leaf_spans(len(data)))), hashlib.sha256).digest()


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
        "hmac_sha256_tree_mib_per_s": lambda: _hmac_sha256_tree(key, data),
        "word_sum_mib_per_s": lambda: int(flat.view(torch.int64).sum()),
        "sha256_one_core_mib_per_s": lambda: hashlib.sha256(data).digest(),
        "blake2b_keyed_one_core_mib_per_s": lambda: hashlib.blake2b(data, key=key).digest(),
        "blake3_keyed_one_core_mib_per_s": lambda: blake3(data, key=key).digest(),
    }
    result: dict[str, object] = {
        "bucket_mb": args.bucket_mb,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    for name, fn in paths.items():
        result[name] = round(args.bucket_mb / _best(fn, args.repeats))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
