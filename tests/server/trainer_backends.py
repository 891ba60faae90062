"""The trainer's server client as the learner builds it (resolved run, prompt encoder's tokenizer and
processor, one process), for the tests that talk to real rollout servers."""

from __future__ import annotations

from typing import Any

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
