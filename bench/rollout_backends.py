"""Rollout backend benchmark: colocated vLLM vs HF ``generate``, where their time goes, and sync cost.

Prints ONE JSON object::

    {"batches": {"8": {"hf": {...}, "vllm_colocate": {...}, "vllm_over_hf_tokens_per_s": X,
                       "greedy_agreement": F}, "32": {...}},
     "model": {...}, "vllm_settings": {...}, "threads": N, "vllm_start_seconds": S,
     "sync_seconds_per_mb": X, "sync_mb": X, "flatten_seconds_per_mb": X, "checksum_seconds_per_mb": X}

Both backends roll out the same prompts (real raccoon photographs from the shared data, encoded by
the trainer's ``PromptEncoder``) with the same tiny random Qwen-VL, batch size, greedy decoding and
``max_new_tokens``; a random model rarely emits EOS, so nearly every rollout runs to
``max_new_tokens`` and the token counts match. The size flags (``--text-hidden``, ``--text-layers``
...) are those of ``rollmatch make-tiny-model``: the 2-layer default measures per-step overhead, a
4-layer width-512 model makes one decode step cost real compute.

Every round rolls out *new* photographs (as training does), so neither engine is timed on a cache hit
of an earlier round; the rounds alternate the engines and the first is a warm-up. Per engine:

- ``tokens_per_s`` / ``seconds``: best round (the machine may be shared; ``*_mean`` beside it);
  ``vllm_over_hf_tokens_per_s`` is the median over rounds of the ratio within each round (the two
  engines ran back to back on the same prompts), ``*_rounds`` lists them, ``*_best`` divides the
  best rounds;
- ``prefill_seconds``: a call with ``max_new_tokens`` 1 (image processing, vision tower, prompt
  forward, one sample); ``decode_ms_per_step`` = (seconds - prefill) / (max_new_tokens - 1);
- ``model_seconds``: time inside the model's forward modules (vision tower, language model, logits),
  measured with forward hooks (``vision_seconds``: the vision tower's part); ``host_seconds`` =
  seconds - model_seconds is everything else (scheduling, input preparation, image processing in
  vLLM, sampling, Python per step). ``--compiled`` vLLM runs past the hooks: its split is null;
- ``cpu_over_wall``: process CPU seconds / wall seconds (about the thread count when nothing else ran);
  ``tokens_per_cpu_s``: tokens per process CPU second, best round. With ``--threads 1`` this counts
  the work each engine does and hardly moves when other processes share the cores.

``sync_seconds_per_mb`` is the wall time of ``VllmColocateBackend.sync_weights`` (merged export +
in-place reload + cache resets) per MB of weights; ``flatten``/``checksum`` time the bucket packing
and digest the server path adds.

Run: ``.venv/bin/python bench/rollout_backends.py [--batch 8 32] [--text-layers 4 --text-hidden 512
--text-intermediate 1536] [--max-new-tokens 64] [--threads N]`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tiny_size_flags import add_size_flags, size_from

import rollmatch  # noqa: F401  (environment workarounds before transformers loads)
from rollmatch.config.schema import DataConfig
from rollmatch.data.convert import from_voc
from rollmatch.data.prompts import PromptEncoder
from rollmatch.models.tiny import build_tiny_model
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout, RolloutRequest
from rollmatch.rollout.vllm_colocate import VllmColocateBackend
from rollmatch.rollout.vllm_engine import VllmEngine
from rollmatch.rollout.vllm_settings import VllmEngineSettings
from rollmatch.sync.digest import bucket_checksum
from rollmatch.sync.weights import flatten_buckets, iter_sync_tensors

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MB = 1 << 20
# Smallest setting (tests/test_benches.py runs it; docs/runbook.md "Benchmarks").
SMOKE_ARGS = "--batch 1 --max-new-tokens 2 --repeats 1 --text-layers 1 --threads 1 --kv-cache-gib 0.1"
SMOKE_KEYS = ("batches", "vllm_start_seconds", "sync_seconds_per_mb", "model")


def main() -> None:
    # vLLM logs to stdout by default; leave stdout to the one JSON object (warnings still reach stderr).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per engine and batch")
    parser.add_argument("--family", default="qwen2_5_vl")
    add_size_flags(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM (default: the project's)")
    parser.add_argument("--compiled", action="store_true", help="vLLM without enforce_eager (CPU: inductor)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument(
        "--vllm-dtype",
        default="float32",
        help="vLLM weights/activations (HF stays float32, the training dtype)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--skip-sync", action="store_true", help="leave out the weight-sync timing")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # before vLLM starts: its CPU worker freezes the count
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(args, Path(tmp)), indent=2, sort_keys=True))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    size = size_from(args)
    model_dir = str(build_tiny_model(args.family, tmp / "model", size=size))
    encoder = PromptEncoder.from_pretrained(model_dir, DataConfig(coord_frame="norm1000"))
    rounds = args.repeats + 1
    records = from_voc(args.data / "raccoon")
    if len(records) < rounds * max(args.batch):
        raise SystemExit(
            f"{len(records)} raccoon records cannot give {rounds} rounds of {max(args.batch)} new ones"
        )
    requests = [encoder.encode(record).to_request() for record in records[: rounds * max(args.batch)]]
    model = _load(model_dir)
    hf = HFBackend(
        model,
        encoder.tokenizer,
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
        batch_size=max(args.batch),
    )
    overrides: dict[str, Any] = {"enforce_eager": not args.compiled, "kv_cache_space_gib": args.kv_cache_gib}
    if args.max_num_seqs:
        overrides["max_num_seqs"] = args.max_num_seqs
    if args.no_prefix_caching:
        overrides["enable_prefix_caching"] = False
    settings = VllmEngineSettings(model_dir, dtype=args.vllm_dtype, max_model_len=2048, **overrides)
    vllm = VllmColocateBackend(VllmEngine(settings), model=model, tokenizer=encoder.tokenizer)
    try:
        start = time.perf_counter()
        vllm.engine.start()
        start_seconds = time.perf_counter() - start
        timers = {"hf": _hf_timer(model), "vllm_colocate": _vllm_timer(vllm.engine)}
        engines = {
            "hf": lambda reqs, decoding: hf.generate(reqs, decoding, seed=0),
            "vllm_colocate": lambda reqs, decoding: vllm.generate(reqs, decoding, seed=0),
        }
        batches = {
            str(batch): compare_engines(engines, timers, requests, batch, args.max_new_tokens, rounds)
            for batch in args.batch
        }
        if args.compiled:  # compiled graphs run past module hooks: no model / host split for vLLM
            for stats in batches.values():
                stats["vllm_colocate"].update(
                    {k: None for k in ("model_seconds", "vision_seconds", "host_seconds", "host_fraction")}
                )
        sync = {} if args.skip_sync else _sync_cost(vllm, model, args.repeats)
    finally:
        vllm.close()
    return {
        "model": {
            "family": args.family,
            "init": "random",
            **asdict(size),
            "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        },
        "max_new_tokens": args.max_new_tokens,
        "rounds": {"timed": args.repeats, "warm_up": 1},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "vllm_settings": {
            k: v for k, v in asdict(settings).items() if k not in ("model_dir", "mm_processor_kwargs")
        },
        "vllm_start_seconds": round(start_seconds, 2),
        "batches": batches,
        **sync,
    }


# ------------------------------------------------------------------------------------- measurement
class HookClock:
    """Wall seconds spent inside the given modules' forwards (outermost call only), via hooks."""

    def __init__(self, modules: Sequence[torch.nn.Module]):
        self.seconds = 0.0
        self._depth = 0
        self._entered = 0.0
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        if self._depth == 0:
            self._entered = time.perf_counter()
        self._depth += 1

    def _exit(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._entered


class ModelTimer:
    """Wall, CPU, model-forward and vision-tower seconds of one call."""

    def __init__(self, model_modules: Sequence[torch.nn.Module], vision: torch.nn.Module):
        self.model = HookClock(model_modules)
        self.vision = HookClock([vision])

    @contextmanager
    def measure(self) -> Iterator[dict[str, float]]:
        """Yields a dict filled on exit with ``seconds``, ``cpu_seconds``, ``model_seconds``, ``vision_seconds``."""
        out: dict[str, float] = {}
        model, vision = self.model.seconds, self.vision.seconds
        wall, cpu = time.perf_counter(), time.process_time()
        yield out
        out["seconds"] = time.perf_counter() - wall
        out["cpu_seconds"] = time.process_time() - cpu
        out["model_seconds"] = self.model.seconds - model
        out["vision_seconds"] = self.vision.seconds - vision


def compare_engines(
    engines: dict[str, Callable[[list[RolloutRequest], Decoding], list[Rollout]]],
    timers: dict[str, ModelTimer],
    requests: Sequence[RolloutRequest],
    batch: int,
    max_new_tokens: int,
    rounds: int,
) -> dict[str, Any]:
    """Rounds of new prompts, engines alternating; round 0 warms up. Full rollouts, then prefill-only."""
    full, prefill = Decoding(max_new_tokens=max_new_tokens), Decoding(max_new_tokens=1)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    prefills: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[Rollout]] = {}
    for round_index in range(rounds):
        chunk = list(requests[round_index * batch : (round_index + 1) * batch])
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            with timers[name].measure() as timed:
                outputs[name] = engines[name](chunk, full)
            timed["tokens"] = sum(len(r.response_token_ids) for r in outputs[name])
            with timers[name].measure() as timed_prefill:
                engines[name](chunk, prefill)
            if round_index:
                runs[name].append(timed)
                prefills[name].append(timed_prefill["seconds"])
    stats = {name: engine_stats(runs[name], prefills[name], batch, max_new_tokens) for name in engines}
    hf, vllm = stats["hf"], stats["vllm_colocate"]
    agreement = sum(
        a.response_token_ids == b.response_token_ids
        for a, b in zip(outputs["hf"], outputs["vllm_colocate"], strict=True)
    ) / len(outputs["hf"])
    # Paired per round (the engines ran back to back on the same prompts): robust to load drifts.
    paired = [
        (v["tokens"] / v["seconds"]) / (h["tokens"] / h["seconds"])
        for h, v in zip(runs["hf"], runs["vllm_colocate"], strict=True)
    ]
    paired_cpu = [
        (v["tokens"] / v["cpu_seconds"]) / (h["tokens"] / h["cpu_seconds"])
        for h, v in zip(runs["hf"], runs["vllm_colocate"], strict=True)
    ]
    return {
        **stats,
        "prompt_tokens_mean": sum(len(r.prompt_token_ids) for r in requests[:batch]) / batch,
        "vllm_over_hf_tokens_per_s": round(statistics.median(paired), 3),
        "vllm_over_hf_tokens_per_s_rounds": [round(r, 3) for r in paired],
        "vllm_over_hf_tokens_per_cpu_s": round(statistics.median(paired_cpu), 3),
        "vllm_over_hf_tokens_per_s_best": round(vllm["tokens_per_s"] / hf["tokens_per_s"], 3),
        "greedy_agreement": agreement,
    }


def engine_stats(
    runs: list[dict[str, float]], prefills: list[float], batch: int, max_new_tokens: int
) -> dict[str, float]:
    best = min(runs, key=lambda r: r["seconds"])
    mean_seconds = sum(r["seconds"] for r in runs) / len(runs)
    prefill = min(prefills)
    return {
        "seconds": round(best["seconds"], 3),
        "tokens_per_s": round(best["tokens"] / best["seconds"], 1),
        "tokens_per_s_mean": round(sum(r["tokens"] for r in runs) / len(runs) / mean_seconds, 1),
        "rollouts_per_s": round(batch / best["seconds"], 2),
        "prefill_seconds": round(prefill, 3),
        "decode_ms_per_step": round((best["seconds"] - prefill) * 1e3 / max(max_new_tokens - 1, 1), 2),
        "model_seconds": round(best["model_seconds"], 3),
        "vision_seconds": round(best["vision_seconds"], 3),
        "host_seconds": round(best["seconds"] - best["model_seconds"], 3),
        "host_fraction": round(1 - best["model_seconds"] / best["seconds"], 3),
        "cpu_over_wall": round(best["cpu_seconds"] / best["seconds"], 2),
        "tokens_per_cpu_s": round(max(r["tokens"] / r["cpu_seconds"] for r in runs), 1),
    }


def _hf_timer(model: torch.nn.Module) -> ModelTimer:
    """The HF model's decoder stack (vision tower inside) and LM head."""
    return ModelTimer([model.model, model.lm_head], vision=model.model.visual)


def _vllm_timer(engine: VllmEngine) -> ModelTimer:
    """Hooks on the in-process vLLM model: vision tower, decoder layers and logits."""
    found: list[ModelTimer] = []

    def collect(worker: Any) -> None:
        model = getattr(worker, "worker", worker).model_runner.model
        decoder = model.language_model.model
        # vLLM calls the decoder stack past nn.Module hooks (its compile wrapper), so time its parts.
        parts = [decoder.embed_tokens, *decoder.layers, decoder.norm]
        found.append(ModelTimer([model.visual, *parts, model.language_model.logits_processor], model.visual))

    # A bench-only reach into the engine: the in-process executor runs ``collect`` here, on the live worker.
    engine._llm.collective_rpc(collect)
    return found[0]


def _load(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _sync_cost(backend: VllmColocateBackend, model: torch.nn.Module, repeats: int) -> dict[str, float]:
    reports = [backend.sync_weights(model, version) for version in range(1, repeats + 1)]
    megabytes = reports[0].num_bytes / MB
    named = list(iter_sync_tensors(model, "full"))
    start = time.perf_counter()
    buckets = list(flatten_buckets(named))
    flatten_s = time.perf_counter() - start
    start = time.perf_counter()
    for bucket in buckets:
        bucket_checksum(bytes(32), bucket.metas, bucket.flat)
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
