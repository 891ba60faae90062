"""The trainer's server client as the learner builds it (resolved run, prompt encoder's tokenizer and
processor, one process), for the tests that talk to real rollout servers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText

from rollmatch.collectives import LocalCollectives
from rollmatch.config.resolved import resolve_run_on_this_machine
from rollmatch.rollout.client import ServerBackend


def connect_backend(cfg: Any, prompt_encoder: Any, model: Any = None) -> ServerBackend:
    return ServerBackend.connect(
        resolve_run_on_this_machine(cfg),
        model=model,
        tokenizer=prompt_encoder.tokenizer,
        collectives=LocalCollectives(),
        processor=prompt_encoder.processor,
    )


def two_hf_servers_backend(
    start_server: Callable[..., Any],
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    prompt_encoder: Any,
    free_port: Callable[[], int],
) -> tuple[Any, Any, Any, ServerBackend]:
    """Two HF-engine servers of the tiny model, the learner's float32 copy of it and a client connected
    to both (20 s timeout, ``min_healthy`` 1): ``(first, second, model, backend)``."""
    first, second = (
        start_server(tiny_model_dir, "--engine", "hf"),
        start_server(tiny_model_dir, "--engine", "hf"),
    )
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = server_config(
        servers=[{"base_url": s.url, "group_port": free_port()} for s in (first, second)],
        timeout_s=20.0,
        min_healthy=1,
    )
    return first, second, model, connect_backend(cfg, prompt_encoder, model)
