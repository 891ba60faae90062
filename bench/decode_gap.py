"""Decode-gap benchmark: how long a running call stops decoding while a burst of image calls arrives.

Prints ONE JSON object::

    {"paths": {"engine_thread": {"max_gap_s": G, "median_step_s": S, "steps": N, ...},
               "prepare_hop": {...}},
     "max_gap_ratio": R, "model": {...}, "arrivals": 64, "images_per_prompt": 4}

One in-process vLLM rollout server (``RolloutServer`` on ``VllmServerEngine``, a tiny random
Qwen2.5-VL, 2 layers by default) decodes one long call (greedy, ``--long-tokens`` new tokens). Once
it runs, ``--arrivals`` calls of one prompt with ``--images`` raccoon photographs each arrive from
16 threads, each doing what the ``/infer/`` route's worker hop does (``prepare``: images decoded,
and in the new path the engine's image processor run) and then ``submit``. The engine's steps are
timed; ``max_gap_s`` is the longest time between the ends of two consecutive steps while the long
call ran and arrivals were being admitted, ``median_step_s`` the typical one.

- ``engine_thread``: the old path (every pending call admitted at once between two steps, vLLM's
  multimodal processor run inside ``add_request`` on the engine thread);
- ``longest_admission_s`` / ``longest_step_s``: the longest time the engine thread spent admitting
  calls between two steps, and the longest engine step (a step prefills what was admitted);
- ``prepare_hop``: the server's path (preprocessing in the prepare hop, at most
  ``ADMIT_PROMPTS_PER_STEP`` prompts admitted between two steps).

Both paths run in one process on the same engine, one after the other (``max_gap_ratio`` =
engine_thread / prepare_hop); absolute seconds move with the machine's load, the ratio less.

Run: ``.venv/bin/python bench/decode_gap.py [--arrivals 64] [--images 4] [--long-tokens 256]``
(about 2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tiny_size_flags import add_size_flags, size_from

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.schema import DataConfig
from rollmatch.data.convert import from_voc
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.models.tiny import build_tiny_model
from rollmatch.protocol import InferBody, InferRequest, RequestConfig, encode_image
from rollmatch.server.limits import ServerLimits
from rollmatch.server.rollout_server import RolloutServer
from rollmatch.server.scheduler import ADMIT_PROMPTS_PER_STEP

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--arrivals 2 --images 1 --long-tokens 8"
SMOKE_KEYS = ("max_gap_ratio", "paths", "admit_prompts_per_step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--arrivals", type=int, default=64, help="calls of one prompt arriving at once")
    parser.add_argument("--images", type=int, default=4, help="images per arriving prompt")
    parser.add_argument("--long-tokens", type=int, default=256, help="new tokens of the running call")
    parser.add_argument("--max-pixels", type=int, default=128 * 28 * 28, help="processor max_pixels")
    add_size_flags(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=2, sort_keys=True))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from rollmatch.server.engines import VllmServerEngine

    size = size_from(args)
    model_dir = build_tiny_model("qwen2_5_vl", tmp / "model", size=size)
    data = DataConfig(coord_frame="norm1000", max_pixels=args.max_pixels)
    encoder = PromptEncoder.from_pretrained(str(model_dir), data)
    photos = [r.images[0] for r in from_voc(args.data / "raccoon")]
    bodies = [
        _body(encoder, photos, i * args.images, args.images, args.long_tokens if i == 0 else 8)
        for i in range(2 * args.arrivals + 2)
    ]
    engine = VllmServerEngine(
        str(model_dir),
        max_model_len=4096,
        pixel_bounds=(None, args.max_pixels),
        max_num_seqs=args.arrivals + 8,
    )
    server = RolloutServer(engine, ServerLimits())
    steps: list[float] = []
    real_step = engine.step

    def timed_step() -> Any:
        out = real_step()
        steps.append(time.perf_counter())
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    step_seconds: list[float] = []
    admit_seconds: list[float] = []
    scheduler = server.scheduler
    real_admit, real_run_step = scheduler._admit_pending, scheduler._step

    def timed(record: list[float], fn: Any) -> Any:
        def run() -> Any:
            started = time.perf_counter()
            try:
                return fn()
            finally:
                record.append(time.perf_counter() - started)

        return run

    scheduler._admit_pending = timed(admit_seconds, real_admit)  # type: ignore[method-assign]
    scheduler._step = timed(step_seconds, real_run_step)  # type: ignore[method-assign]
    try:
        _call(server, bodies[-1])  # warm-up (compiles, allocates)
        results = {}
        for index, (name, old) in enumerate((("engine_thread", True), ("prepare_hop", False))):
            server.preprocess_in_prepare = not old
            server.scheduler.admit_prompts_per_step = None if old else ADMIT_PROMPTS_PER_STEP
            arrivals = bodies[1 + index * args.arrivals : 1 + (index + 1) * args.arrivals]
            step_seconds.clear()
            admit_seconds.clear()
            results[name] = _measure(server, bodies[0], arrivals, steps)
            results[name]["longest_admission_s"] = max(admit_seconds)
            results[name]["longest_step_s"] = max(step_seconds)
    finally:
        server.close()
    return {
        "paths": results,
        "max_gap_ratio": results["engine_thread"]["max_gap_s"] / results["prepare_hop"]["max_gap_s"],
        "model": {"family": "qwen2_5_vl", "init": "random", **asdict(size)},
        "arrivals": args.arrivals,
        "images_per_prompt": args.images,
        "max_pixels": args.max_pixels,
        "long_tokens": args.long_tokens,
        "admit_prompts_per_step": ADMIT_PROMPTS_PER_STEP,
    }


def _measure(
    server: RolloutServer, long_body: InferBody, arrivals: list[InferBody], steps: list[float]
) -> dict[str, Any]:
    long_call = server.prepare(long_body)
    ticket = server.submit(long_call)
    assert ticket is not None
    while server.scheduler.depth()["running_calls"] == 0 or len(steps) < 3:
        time.sleep(0.005)
    time.sleep(0.2)
    first = len(steps)
    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:  # the /infer/ route's worker hops
        tickets = list(pool.map(lambda body: _submit(server, body), arrivals))
    submitted = time.perf_counter() - started
    for arrival in tickets:
        asyncio.run(server.scheduler.wait_async(arrival))
    admitted_at = time.perf_counter()
    long_done = not ticket.done.is_set()
    asyncio.run(server.scheduler.wait_async(ticket))
    window = [t for t in steps[first:] if t <= admitted_at] or steps[first : first + 2]
    times = [steps[first - 1], *window]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "max_gap_s": max(gaps),
        "median_step_s": statistics.median(gaps),
        "steps": len(gaps),
        "submit_seconds": submitted,
        "arrivals_done_seconds": admitted_at - started,
        "long_call_still_running_when_arrivals_done": long_done,
    }


def _submit(server: RolloutServer, body: InferBody) -> Any:
    return server.submit(server.prepare(body))


def _call(server: RolloutServer, body: InferBody) -> None:
    ticket = server.submit(server.prepare(body))
    if ticket is not None:
        asyncio.run(server.scheduler.wait_async(ticket))


def _body(encoder: PromptEncoder, photos: list[str], start: int, images: int, max_tokens: int) -> InferBody:
    chosen = tuple(photos[(start + k) % len(photos)] for k in range(images))
    request = encoder.encode(Record(id=f"gap-{start}", images=chosen, width=1, height=1)).to_request()
    wire = InferRequest(
        prompt_token_ids=list(request.prompt_token_ids),
        images=[encode_image(image) for image in request.images],
        sample_id=request.sample_id,
    )
    config = RequestConfig(max_tokens=max_tokens, temperature=0.0, seed=0)
    return InferBody(infer_requests=[wire], request_config=config)


if __name__ == "__main__":
    main()
