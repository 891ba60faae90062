"""GRPO over rollout servers: the sampled tokens' log-probs travel over the wire and equal the learner's
recomputation on the weights it pushed, and a 2-rank async learner (gloo, real server) runs GRPO steps.

Tolerance of the log-prob check (relative, per token): 1e-4 — the HF engine runs the same float32
weights as the learner, so only a wrong prompt, tokenisation or weight sync can open a larger gap.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_async_learner import async_config, step_metrics, train_to_the_end
from transformers import AutoModelForImageTextToText

from rollmatch.collectives import LocalCollectives
from rollmatch.config.resolved import resolve_run_on_this_machine
from rollmatch.rollout.client import ServerBackend
from rollmatch.rollout.types import Decoding
from rollmatch.training.grpo_loss import recompute_logprobs

pytestmark = pytest.mark.heavy
TOLERANCE = 1e-4


def worst_gap(
    model: torch.nn.Module, requests: list[Any], rollouts: list[Any], temperature: float = 0.7
) -> float:
    worst = 0.0
    for request, rollout in zip(requests, rollouts, strict=True):
        ids, values = list(rollout.response_token_ids), list(rollout.response_logprobs)
        if rollout.stop_logprob is not None:
            ids.append(rollout.stop_token_id)
            values.append(rollout.stop_logprob)
        learner = recompute_logprobs(model, request, ids, temperature)
        worst = max([worst, *(abs(e - v) / max(1.0, abs(v)) for e, v in zip(values, learner, strict=True))])
    return worst


def test_server_logprobs_equal_the_learners_on_the_pushed_weights(
    hf_sync_server: Any,
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    prompt_encoder: Any,
    raccoon_requests: list[Any],
    free_port: Callable[[], int],
) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pristine = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    cfg = server_config(servers=[{"base_url": hf_sync_server.url, "group_port": free_port()}])
    backend = ServerBackend.connect(
        resolve_run_on_this_machine(cfg),
        model=model,
        tokenizer=prompt_encoder.tokenizer,
        collectives=LocalCollectives(),
        processor=prompt_encoder.processor,
    )
    try:
        backend.sync_weights(model, 41)
        rollouts = backend.generate(raccoon_requests, Decoding(temperature=0.7, max_new_tokens=10), seed=3)
    finally:
        backend.close()
    assert all(r.weight_version == 41 and r.response_logprobs is not None for r in rollouts)
    assert worst_gap(model, raccoon_requests, rollouts) <= TOLERANCE  # the sampling temperature's
    assert worst_gap(model, raccoon_requests, rollouts, temperature=1.0) > 1e-2  # not temperature 1's
    assert worst_gap(pristine, raccoon_requests, rollouts) > 1e-2  # the weights before the push differ


def test_async_learner_runs_grpo_steps_on_two_ranks(
    hf_sync_server: Any, tiny_model_dir: Path, tmp_path: Path, free_port: Callable[[], int]
) -> None:
    from rollmatch.data.shapes import generate_shapes

    shapes = generate_shapes(tmp_path / "shapes", n_train=24, n_val=1, size=112, seed=3)
    out = tmp_path / "out"
    steps = 3
    config = async_config(
        tiny_model_dir, shapes, out, hf_sync_server.url, free_port(), max_steps=steps, max_wait_s=30.0
    )
    rollout = config["custom"]["extra"]["rollout_matching"]
    rollout.update({"rollouts_per_record": 2, "decoding": {"temperature": 1.0}})
    config["loss"] = {"objective": "grpo"}
    train_to_the_end(config, tmp_path, "grpo")
    logged = step_metrics(out)
    assert len(logged) == steps
    assert all(h["stage2_ab/step_kind_b"] == 1.0 for h in logged)  # every step waited for its packs
    for line in logged:
        assert "grpo/reward_mean" in line or "grpo/clip_frac" in line, line
    trained = [h for h in logged if "grpo/ratio_mean" in h]
    assert trained, "no GRPO loss ran"
    # packs are at most version_window (2) syncs stale at lr 1e-3: the ratio stays near 1 and is recorded
    assert all(0.5 < h["grpo/ratio_p05"] <= h["grpo/ratio_p50"] <= h["grpo/ratio_p95"] < 2.0 for h in trained)
    for rank in (0, 1):
        counts = json.loads((out / "async" / f"rank{rank}.json").read_text())
        assert counts["balance"] == 0 and counts["rollouts"]["balance"] == 0, counts
        assert counts["actor_failure"] is None
