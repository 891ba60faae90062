"""Weight-sync and rollout-server benchmark. Prints ONE JSON object.

1. ``transaction_over_raw_broadcast``: seconds per MB of a full weight update through the
   transaction (announce -> buckets -> finish with per-bucket keyed checksums verified by the
   receiver) divided by a raw broadcast of the same buckets over the same gloo group (target
   <= 1.25). The transaction sends each digest leaf of a bucket as soon as packing wrote it (its
   own pipelining); the raw paths pack a bucket with the same ``flatten_buckets`` and then
   broadcast it, whole or leaf by leaf. The receiver is a separate process (rank 0 of a private TCPStore + gloo group,
   trainer = rank 1); its control messages travel over a pipe, so the number isolates the
   transaction's own cost. Every path flattens the same synthetic tensors into the same buckets;
   each round runs every path once, in an order rotated each round (round 0 warms up). Reported:
   best round per path (``transaction_over_raw_broadcast``), the per-round ratio's median, min and
   max (``..._rounds``), the same against the buckets broadcast in digest-leaf pieces as the
   transaction sends them (``transaction_over_raw_leaf_broadcasts``: the digest and control
   messages alone), one side's digest of the whole payload with no transfer beside it
   (``one_side_digest_seconds_per_mb``) and the 1-minute load average before and after.
2. ``server_full_sync_seconds_per_mb``: end to end against a real ``rollmatch serve`` process
   (HTTP, gloo, checksums and loading into the engine) for the tiny model; informational.
3. ``infer_http_over_inprocess``: one batch of rollouts (``--requests``, default 8) through
   ``POST /infer/`` vs the same engine class called in this process on the same prompts, per
   ``--image-wire`` (how the client sends images; ``infer_http_over_inprocess_<wire>``). Every
   round uses new photographs and runs every path on them, in an order rotated each round; round
   0 warms up. Ratios are paired per round: ``infer.wires.<wire>.http_over_inprocess`` gives their
   median, min and max (``best_of``: best HTTP round over best in-process round). Where the time
   goes, medians over rounds: ``client_seconds`` (``encode_images``, ``serialize_json``,
   ``round_trip``, of which ``transfer_and_http`` is not spent in a server phase, ``parse_reply``,
   ``client_other``) and ``server_seconds`` (the server's ``Server-Timing`` phases: ``receive``,
   ``parse`` = JSON parse + validation, ``prepare`` = caps and id checks, ``decode`` = images,
   ``engine`` = the engine call incl. the HF processor, ``outputs``, ``respond`` = reply JSON).
   For a wire that changes the images, ``http_over_inprocess_same_images`` compares with the
   in-process engine given the images the server decoded (the transport's cost alone). With the
   tiny model generation is cheap, so these ratios are upper bounds on the HTTP share.

Run: ``.venv/bin/python bench/weight_sync.py [--payload-mb 256] [--engine hf|vllm] [--threads 1]
[--skip-transaction]`` (a few minutes on 2 cores; ``--threads 1`` on a shared machine, docs/performance.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.resolved import resolve_run_on_this_machine
from rollmatch.protocol import FinishUpdateBody, UpdateFlattenedParamsBody, WireModel
from rollmatch.sync.digest import bucket_checksum, leaf_spans
from rollmatch.sync.transaction import UpdateReceiver, push_update
from rollmatch.sync.transport import GroupTransport
from rollmatch.sync.weights import flatten_buckets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import free_port, start_server  # bench scripts share the server helper

IMAGE_WIRES = ("png", "resized_bmp")
RACCOON = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "raccoon" / "images"
MB = 1 << 20
DIGEST_KEY = bytes(range(32))  # the key /init_communicator/ would hand out (fixed: a benchmark)
MAX_ENGINE_STEPS = 10_000  # an in-process batch that needs more steps than this is stuck
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--payload-mb 1 --bucket-mb 1 --requests 1 --max-new-tokens 2 --repeats 1 --threads 1"
SMOKE_KEYS = (
    "transaction_over_raw_broadcast",
    "server_full_sync_seconds_per_mb",
    "infer_http_over_inprocess",
)


# ------------------------------------------------------------------------- 1. transaction vs raw
def _synthetic_weights(payload_mb: int) -> list[tuple[str, torch.Tensor]]:
    """Tensors shaped like a transformer's: large matrices plus many small vectors."""
    generator = torch.Generator().manual_seed(0)
    named, total, layer = [], 0, 0
    while total < payload_mb * MB:
        for kind, shape in (("qkv", (1536, 512)), ("o", (512, 512)), ("mlp", (2048, 512)), ("norm", (512,))):
            tensor = torch.randn(shape, generator=generator)
            named.append((f"model.layers.{layer}.{kind}.weight", tensor))
            total += tensor.numel() * 4
        layer += 1
    return named


def _pieces(flat: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """A bucket's broadcasts in a raw round: the whole bucket, or one per digest leaf (as the
    transaction sends it)."""
    if kind == "raw":
        return [flat]
    return [flat[a:b] for a, b in leaf_spans(int(flat.numel()))]


def _receiver_main(port: int, conn: Connection) -> None:
    """Rank 0 of the group: answers raw receives and transaction messages sent over the pipe."""
    transport = GroupTransport(host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=120)
    receiver = UpdateReceiver(transport, source_rank=1, digest_key=DIGEST_KEY)
    while True:
        kind, payload = conn.recv()
        if kind in ("raw", "raw_leaves"):
            buffers = [torch.empty(n, dtype=torch.uint8) for n in payload]
            transfers = [transport.broadcast_async(p, src=1) for b in buffers for p in _pieces(b, kind)]
            for transfer in transfers:
                transfer.wait("raw receive")
            conn.send({})
        elif kind == "/update_flattened_params/":
            body = UpdateFlattenedParamsBody.model_validate(payload)
            receiver.receive_bucket(body.transaction, body.metadatas)  # type: ignore[arg-type]
            conn.send({})
        elif kind == "/finish_weight_update/":
            verified = receiver.finish(FinishUpdateBody.model_validate(payload))
            conn.send(verified.reply.model_dump())
            # Freed after the reply, as a raw receive frees its buffers after its reply (unmapping
            # 128 MB took ~9 ms here: freed before the reply, it was timed for the transaction only).
            del verified
        else:
            receiver.close()
            transport.close()
            return


class PipeChannel:
    """The transaction's control channel over a pipe (HTTP in production)."""

    url = "pipe://receiver"

    def __init__(self, conn: Connection):
        self.conn = conn

    def post(self, path: str, body: WireModel | None, phase: str) -> dict[str, Any]:
        self.conn.send((path, None if body is None else body.model_dump(mode="json")))
        return self.conn.recv()


def bench_transaction(payload_mb: int, bucket_mb: int, repeats: int) -> dict[str, Any]:
    named = _synthetic_weights(payload_mb)
    buckets = list(flatten_buckets(named, bucket_mb * MB))  # for the sizes and the digest-alone timing
    sizes = [b.num_bytes for b in buckets]
    total_mb = sum(sizes) / MB
    port = free_port()
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_receiver_main, args=(port, child), daemon=True)
    process.start()
    transport = GroupTransport(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=120)
    channel = PipeChannel(parent)
    load_before = os.getloadavg()

    def raw(kind: str) -> None:
        """The same buckets (flattened here, as the transaction does), whole or as digest-leaf pieces."""
        parent.send((kind, sizes))
        transfers = [
            transport.broadcast_async(piece, src=1)
            for b in flatten_buckets(named, bucket_mb * MB)
            for piece in _pieces(b.flat, kind)
        ]
        for transfer in transfers:
            transfer.wait(f"{kind} send")
        parent.recv()

    def transaction(version: int) -> None:
        push_update(
            [(channel, transport)],
            named,
            version=version,
            mode="full",
            digest_key=DIGEST_KEY,
            bucket_bytes=bucket_mb * MB,
        )

    seconds: dict[str, list[float]] = {"raw": [], "raw_leaves": [], "transaction": []}
    for round_ in range(repeats + 1):  # round 0 warms every path up
        steps = [
            ("raw", lambda: raw("raw")),
            ("raw_leaves", lambda: raw("raw_leaves")),
            ("transaction", functools.partial(transaction, round_)),
        ]
        shift = round_ % len(steps)  # rotated: no path always runs right after another
        for name, step in steps[shift:] + steps[:shift]:
            start = time.perf_counter()
            step()
            if round_:
                seconds[name].append(time.perf_counter() - start)
    parent.send(("stop", None))
    process.join(timeout=60)
    transport.close()
    digest_s = []  # one side's digest alone (this process, its pool), no transfer beside it
    for _ in range(3):
        start = time.perf_counter()
        for bucket in buckets:
            bucket_checksum(DIGEST_KEY, bucket.metas, bucket.flat)
        digest_s.append(time.perf_counter() - start)
    txn = seconds["transaction"]
    # Best-of-N per path: other processes on the machine only ever add time, so minima are the least
    # disturbed estimates; per-round ratios (paired: same round, adjacent in time) give median and spread.
    return {
        "transaction_over_raw_broadcast": round(min(txn) / min(seconds["raw"]), 3),
        "transaction_over_raw_broadcast_median_round": round(
            statistics.median(t / r for t, r in zip(txn, seconds["raw"], strict=True)), 3
        ),
        "transaction_over_raw_broadcast_rounds": _spread(
            [t / r for t, r in zip(txn, seconds["raw"], strict=True)]
        ),
        # Against the same bytes sent the way the transaction sends them (one broadcast per digest
        # leaf): what the digest and the control messages alone add.
        "transaction_over_raw_leaf_broadcasts": round(min(txn) / min(seconds["raw_leaves"]), 3),
        "transaction_over_raw_leaf_broadcasts_rounds": _spread(
            [t / r for t, r in zip(txn, seconds["raw_leaves"], strict=True)]
        ),
        "raw_broadcast_seconds_per_mb": round(min(seconds["raw"]) / total_mb, 6),
        "raw_leaf_broadcasts_seconds_per_mb": round(min(seconds["raw_leaves"]) / total_mb, 6),
        "transaction_seconds_per_mb": round(min(txn) / total_mb, 6),
        "one_side_digest_seconds_per_mb": round(min(digest_s) / total_mb, 6),
        "payload_mb": round(total_mb, 1),
        "bucket_mb": bucket_mb,
        "num_buckets": len(sizes),
        "timed_rounds": repeats,
        "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }


# ------------------------------------------------------------------------------ 2-3. real server
def _start_server(model_dir: Path, engine: str, threads: int | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log_path = model_dir.parent / "server.log"
    return start_server(
        model_dir, port, log_path, engine=engine, env=env, timeout_s=300
    ), f"http://127.0.0.1:{port}"


def bench_server(args: argparse.Namespace) -> dict[str, Any]:
    """Weight sync through a real server, then paired rounds of /infer/ over HTTP vs in process."""
    from rollmatch.collectives import LocalCollectives
    from rollmatch.config.schema import DataConfig
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.models.tiny import build_tiny_model
    from rollmatch.rollout.client import ServerBackend
    from rollmatch.rollout.types import Decoding
    from rollmatch.server.engines import build_engine

    model_dir = build_tiny_model("qwen2_5_vl", Path(tempfile.mkdtemp(prefix="bench-sync-")) / "model")
    encoder = PromptEncoder.from_pretrained(model_dir, DataConfig(coord_frame="norm1000"))
    decoding = Decoding(max_new_tokens=args.max_new_tokens)
    rounds = _photo_rounds(encoder, args.requests, args.repeats + 1)  # new photographs every round
    process, url = _start_server(model_dir, args.engine, args.threads)
    try:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        backends = {
            wire: ServerBackend.connect(
                resolve_run_on_this_machine(_server_config(model_dir, url, wire)),
                model=model,
                tokenizer=encoder.tokenizer,
                collectives=LocalCollectives(),
                processor=encoder.processor,
            )
            for wire in args.image_wire
        }
        sync = _bench_server_sync(next(iter(backends.values())), model, args.repeats)
        local = build_engine(args.engine, str(model_dir), dtype="float32", max_model_len=4096)
        samples = _paired_infer_rounds(backends, local, rounds, decoding, process.pid)
        opened = {wire: _connections_opened(backend) for wire, backend in backends.items()}
        local.close()
        for backend in backends.values():
            backend.close()
    finally:
        process.terminate()
        process.wait(timeout=60)
    infer = _infer_summary(samples, args)
    for wire, count in opened.items():  # keep-alive: one connection for every call of a session
        infer["wires"][wire]["connections_opened"] = count
    top = {
        f"infer_http_over_inprocess_{wire}": infer["wires"][wire]["http_over_inprocess"]["median"]
        for wire in args.image_wire
    }
    if "png" in args.image_wire:
        top["infer_http_over_inprocess"] = top["infer_http_over_inprocess_png"]
    return {**sync, **top, "infer": infer}


def _server_config(model_dir: Path, url: str, wire: str) -> Any:
    from rollmatch.config.schema import RollmatchConfig

    server: dict[str, Any] = {"servers": [{"base_url": url, "group_port": free_port()}]}
    if wire != "png":
        server["image_wire"] = wire
    return RollmatchConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            # The frame the server starts with (server_process.start_server: --coord-frame norm1000);
            # the trainer's check refuses a server whose frame differs from data.coord_frame.
            "data": {"coord_frame": "norm1000"},
            "custom": {"extra": {"rollout_matching": {"vllm": {"mode": "server", "server": server}}}},
        }
    )


def _photo_rounds(encoder: Any, batch: int, rounds: int) -> list[list[Any]]:
    """``rounds`` batches of trainer-encoded requests on distinct real photographs."""
    from rollmatch.data.records import Record

    paths = sorted(RACCOON.glob("raccoon-*.jpg"))
    if len(paths) < batch * rounds:
        raise SystemExit(f"{len(paths)} photographs in {RACCOON} cannot give {rounds} rounds of {batch}")
    return [
        [
            encoder.encode(Record(id=p.stem, images=(str(p),), width=1, height=1)).to_request()
            for p in paths[r * batch : (r + 1) * batch]
        ]
        for r in range(rounds)
    ]


def _bench_server_sync(backend: Any, model: Any, repeats: int) -> dict[str, Any]:
    sync_s, sync_mb = [], 0.0
    for version in range(1, repeats + 2):
        report = backend.sync_weights(model, version)
        sync_s.append(report.seconds)
        sync_mb = report.num_bytes / MB
    return {
        "server_full_sync_seconds_per_mb": round(min(sync_s[1:]) / sync_mb, 6),
        "server_full_sync_mb": round(sync_mb, 2),
    }


def _paired_infer_rounds(
    backends: dict[str, Any], local: Any, rounds: list[list[Any]], decoding: Any, server_pid: int
) -> list[dict[str, Any]]:
    """Every path on the same photographs per round, in an order rotated each round; round 0 warms up."""
    samples = [
        _one_round(backends, local, requests_, decoding, index, server_pid)
        for index, requests_ in enumerate(rounds)
    ]
    return samples[1:]


def _one_round(
    backends: dict[str, Any], local: Any, requests_: list[Any], decoding: Any, shift: int, server_pid: int
) -> dict[str, Any]:
    """Wall and CPU seconds of the in-process engine, of each image wire over HTTP (CPU of this
    process and the server's, with its ``InferTiming``), and of the in-process engine on the images a
    wire delivered (``<wire>_same_images``: the transport alone, for wires that change the images)."""
    from rollmatch.server.prompt_preparer import PreparedPrompt

    sample: dict[str, Any] = {}
    pids = (os.getpid(), server_pid)

    def inprocess(images: list[list[Any]]) -> dict[str, float]:
        prompts = [
            PreparedPrompt(r.sample_id, r.prompt_token_ids, i) for r, i in zip(requests_, images, strict=True)
        ]
        with _Clock(pids) as clock:
            _generate_in_process(local, prompts, decoding)
        return clock.reading

    def over_http(wire: str) -> None:
        backend = backends[wire]
        with _Clock(pids) as clock:
            backend.generate(requests_, decoding, seed=0)
        sample[wire] = {**clock.reading, "timing": backend.last_infer_timings[0]}
        if wire != "png":
            sample[f"{wire}_same_images"] = inprocess(_delivered_images(backend, requests_))

    def trainer_images() -> None:
        sample["inprocess"] = inprocess([list(r.images) for r in requests_])

    steps = [trainer_images, *(functools.partial(over_http, wire) for wire in backends)]
    shift %= len(steps)
    for step in steps[shift:] + steps[:shift]:
        step()
    return sample


def _generate_in_process(engine: Any, prompts: list[Any], decoding: Any) -> None:
    """The server engine's ``add`` / ``step`` loop in this process (the server's scheduler minus HTTP)."""
    pending = {f"local-{index}" for index in range(len(prompts))}
    for index, prompt in enumerate(prompts):
        engine.add(f"local-{index}", prompt, decoding, 0)
    for _ in range(MAX_ENGINE_STEPS):
        pending -= {request_id for request_id, _ in engine.step()}
        if not pending:
            return
    raise RuntimeError(
        f"in-process {engine.name} engine: {len(pending)} requests unfinished after {MAX_ENGINE_STEPS} steps"
    )


class _Clock:
    """Wall seconds of a block and the CPU seconds every thread of the given processes spent in it.

    CPU time comes from ``/proc/<pid>/task/*/schedstat`` (nanoseconds on a core; a thread that ends
    inside the block loses its share). With one thread per process it counts the work done and
    hardly moves when other processes share the cores, unlike wall time.
    """

    def __init__(self, pids: tuple[int, ...]):
        self.pids = pids
        self.reading: dict[str, float] = {}

    def __enter__(self) -> _Clock:
        self._cpu = [_thread_cpu_ns(pid) for pid in self.pids]
        self._start = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        wall = time.perf_counter() - self._start
        spent = [
            sum(ns - before.get(tid, 0) for tid, ns in _thread_cpu_ns(pid).items())
            for pid, before in zip(self.pids, self._cpu, strict=True)
        ]
        self.reading = {"seconds": wall, "cpu_seconds": sum(spent) / 1e9, "cpu_seconds_here": spent[0] / 1e9}


def _thread_cpu_ns(pid: int) -> dict[int, int]:
    on_cpu: dict[int, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                on_cpu[int(task)] = int(stat.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return on_cpu


def _connections_opened(backend: Any) -> int:
    """TCP connections the backend's HTTP sessions opened so far (urllib3 pool counters)."""
    pools = [
        pool
        for conn in backend.connections
        for pool in conn.session.get_adapter(conn.url).poolmanager.pools._container.values()
    ]
    return sum(pool.num_connections for pool in pools)


def _delivered_images(backend: Any, requests_: list[Any]) -> list[list[Any]]:
    from rollmatch.server.media import decode_image

    return [[decode_image(value) for value in backend.image_wire.encode(r)] for r in requests_]


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def _infer_summary(samples: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Medians over rounds; ratios are per round (paired), then median / min / max."""
    median = statistics.median
    inproc = [s["inprocess"]["seconds"] for s in samples]
    inproc_cpu = [s["inprocess"]["cpu_seconds"] for s in samples]
    wires: dict[str, Any] = {}
    for wire in args.image_wire:
        http = [s[wire]["seconds"] for s in samples]
        timings = [s[wire]["timing"] for s in samples]
        client = {
            "encode_images": [t.encode_s for t in timings],
            "serialize_json": [t.serialize_s for t in timings],
            "round_trip": [t.round_trip_s for t in timings],
            "transfer_and_http": [t.transfer_s for t in timings],
            "parse_reply": [t.parse_s for t in timings],
            "client_other": [
                h - t.encode_s - t.serialize_s - t.round_trip_s - t.parse_s
                for h, t in zip(http, timings, strict=True)
            ],
        }
        phases = sorted({name for t in timings for name in t.server_s})
        server = {name: [t.server_s.get(name, 0.0) for t in timings] for name in phases}
        http_cpu = [s[wire]["cpu_seconds"] for s in samples]
        entry: dict[str, Any] = {
            "http_over_inprocess": {
                **_spread([h / i for h, i in zip(http, inproc, strict=True)]),
                "best_of": round(min(http) / min(inproc), 3),
            },
            "http_over_inprocess_cpu": _spread([h / i for h, i in zip(http_cpu, inproc_cpu, strict=True)]),
            "http_cpu_seconds": round(median(http_cpu), 4),
            "http_cpu_seconds_client": round(median(s[wire]["cpu_seconds_here"] for s in samples), 4),
            "http_seconds": round(median(http), 4),
            "client_seconds": {k: round(median(v), 4) for k, v in client.items()},
            "server_seconds": {k: round(median(v), 4) for k, v in server.items()},
            "server_engine_minus_inprocess": round(median(server.get("engine", [0.0])) - median(inproc), 4),
            "request_bytes": timings[-1].request_bytes,
            "reply_bytes": timings[-1].reply_bytes,
        }
        if f"{wire}_same_images" in samples[0]:
            same = [s[f"{wire}_same_images"]["seconds"] for s in samples]
            same_cpu = [s[f"{wire}_same_images"]["cpu_seconds"] for s in samples]
            entry["inprocess_same_images_seconds"] = round(median(same), 4)
            entry["http_over_inprocess_same_images"] = _spread(
                [h / i for h, i in zip(http, same, strict=True)]
            )
            entry["http_over_inprocess_same_images_cpu"] = _spread(
                [h / i for h, i in zip(http_cpu, same_cpu, strict=True)]
            )
        wires[wire] = entry
    return {
        "engine": args.engine,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "rounds": len(samples),
        "inprocess_seconds": round(median(inproc), 4),
        "inprocess_cpu_seconds": round(median(inproc_cpu), 4),
        "wires": wires,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload-mb", type=int, default=256)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--requests", type=int, default=8, help="requests per /infer/ call (the batch)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument(
        "--image-wire",
        nargs="+",
        default=list(IMAGE_WIRES),
        choices=IMAGE_WIRES,
        help="image encodings to time over HTTP (custom.extra.rollout_matching.vllm.server.image_wire)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads here and in the server")
    parser.add_argument("--skip-transaction", action="store_true", help="leave out part 1")
    parser.add_argument("--transaction-only", action="store_true", help="part 1 alone (no server)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if not args.skip_transaction:
        result |= bench_transaction(args.payload_mb, args.bucket_mb, args.repeats)
    if not args.transaction_only:
        result |= bench_server(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
