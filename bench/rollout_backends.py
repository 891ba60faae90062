"""Rollout backend benchmark: colocated vLLM vs HF ``generate``, and the cost of a full weight sync.

Prints ONE JSON object::

    {"hf": {"rollouts_per_s", "tokens_per_s", "seconds"}, "vllm_colocate": {...},
     "vllm_over_hf_tokens_per_s": X, "vllm_over_hf_rollouts_per_s": X, "greedy_agreement": F,
     "sync_seconds_per_mb": X, "sync_mb": X, "flatten_seconds_per_mb": X, "checksum_seconds_per_mb": X, ...}

Both backends roll out the same prompts (real raccoon photographs from the shared data, encoded
by the trainer's ``PromptEncoder``) with the same tiny random Qwen2.5-VL, batch size, greedy
decoding and ``max_new_tokens``; a random model rarely emits EOS, so nearly every rollout runs
to ``max_new_tokens`` and the token counts match. One warm-up call per backend, then the mean of
``--repeats`` timed calls. ``greedy_agreement`` is the fraction of rollouts whose token ids are
identical across the two backends. ``sync_seconds_per_mb`` is the wall time of
``VllmColocateBackend.sync_weights`` (merged export + in-place reload + cache resets) per MB of
weights; ``flatten``/``checksum`` time the bucket packing and digest the server path adds.

Run: ``.venv/bin/python bench/rollout_backends.py [--data DIR] [--batch 8] [--max-new-tokens 64]``
(about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.schema import DataConfig
from rollmatch.data.convert import from_voc
from rollmatch.data.prompts import PromptEncoder
from rollmatch.models.tiny import build_tiny_model
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout
from rollmatch.rollout.vllm_colocate import VllmColocateBackend
from rollmatch.rollout.vllm_engine import VllmEngine
from rollmatch.rollout.vllm_settings import VllmEngineSettings
from rollmatch.sync.transaction import bucket_checksum
from rollmatch.sync.weights import flatten_buckets, iter_sync_tensors

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MB = 1 << 20


def main() -> None:
    # vLLM logs to stdout by default; leave stdout to the one JSON object (warnings still reach stderr).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", default="qwen2_5_vl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=2, sort_keys=True))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model_dir = str(build_tiny_model(args.family, tmp / "model"))
    encoder = PromptEncoder.from_pretrained(model_dir, DataConfig())
    records = from_voc(args.data / "raccoon")[: args.batch]
    requests = [encoder.encode(record).to_request() for record in records]
    model = _load(model_dir)
    decoding = Decoding(max_new_tokens=args.max_new_tokens)

    hf = HFBackend(
        model,
        encoder.tokenizer,
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
        batch_size=args.batch,
    )
    settings = VllmEngineSettings(
        model_dir, dtype="float32", max_model_len=2048, enforce_eager=True, kv_cache_space_gib=0.5
    )
    vllm = VllmColocateBackend(VllmEngine(settings), model=model, tokenizer=encoder.tokenizer)
    try:
        hf_stats, hf_rollouts = _throughput(lambda: hf.generate(requests, decoding, seed=0), args.repeats)
        vllm_stats, vllm_rollouts = _throughput(
            lambda: vllm.generate(requests, decoding, seed=0), args.repeats
        )
        sync = _sync_cost(vllm, model, args.repeats)
    finally:
        vllm.close()
    agreement = sum(
        a.response_token_ids == b.response_token_ids for a, b in zip(hf_rollouts, vllm_rollouts, strict=True)
    ) / len(requests)
    return {
        "model": f"tiny {args.family} (random init)",
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens_mean": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "hf": hf_stats,
        "vllm_colocate": vllm_stats,
        "vllm_over_hf_tokens_per_s": vllm_stats["tokens_per_s"] / hf_stats["tokens_per_s"],
        "vllm_over_hf_rollouts_per_s": vllm_stats["rollouts_per_s"] / hf_stats["rollouts_per_s"],
        "greedy_agreement": agreement,
        **sync,
    }


def _load(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _throughput(call: Callable[[], list[Rollout]], repeats: int) -> tuple[dict[str, float], list[Rollout]]:
    rollouts = call()  # warm-up (first-call allocations, vLLM's lazy start)
    start = time.perf_counter()
    tokens = 0
    for _ in range(repeats):
        rollouts = call()
        tokens += sum(len(r.response_token_ids) for r in rollouts)
    seconds = (time.perf_counter() - start) / repeats
    return {
        "seconds": seconds,
        "rollouts_per_s": len(rollouts) / seconds,
        "tokens_per_s": tokens / repeats / seconds,
    }, rollouts


def _sync_cost(backend: VllmColocateBackend, model: torch.nn.Module, repeats: int) -> dict[str, float]:
    reports = [backend.sync_weights(model, version) for version in range(1, repeats + 1)]
    megabytes = reports[0].num_bytes / MB
    named = list(iter_sync_tensors(model, "full"))
    start = time.perf_counter()
    buckets = list(flatten_buckets(named))
    flatten_s = time.perf_counter() - start
    start = time.perf_counter()
    for bucket in buckets:
        bucket_checksum(bucket.metas, bucket.flat)
    checksum_s = time.perf_counter() - start
    return {
        "sync_mb": megabytes,
        "sync_seconds": sum(r.seconds for r in reports) / repeats,
        "sync_seconds_per_mb": sum(r.seconds for r in reports) / repeats / megabytes,
        "sync_buckets": len(buckets),
        "flatten_seconds_per_mb": flatten_s / megabytes,
        "checksum_seconds_per_mb": checksum_s / megabytes,
    }


if __name__ == "__main__":
    main()
