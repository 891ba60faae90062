"""Rollout data types and the backend protocol shared by every rollout backend.

Owns: :class:`Rollout`, :class:`SyncReport` and the :class:`RolloutBackend` protocol; re-exports
:class:`RolloutRequest`, which lives below rollout in ``rollmatch.data.requests`` because prompt
encoding builds it, and :class:`Decoding`, which lives in ``rollmatch.config.decoding`` because the
resolved run carries the run's decodings. Leaves out: how prompts are encoded
(``rollmatch.data.prompts``) and how a backend is picked from the config
(``rollmatch.rollout.build``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from rollmatch.config.decoding import Decoding
from rollmatch.data.requests import RolloutRequest

__all__ = [
    "Decoding",
    "FinishReason",
    "Rollout",
    "RolloutBackend",
    "RolloutProvenance",
    "RolloutRequest",
    "SyncReport",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class RolloutProvenance:
    """Where a rollout came from: backend name, server URL (if any), seed and decoding."""

    backend: str
    seed: int | None
    decoding: Decoding
    server: str | None = None


@dataclass
class Rollout:
    """One decoded response. ``response_token_ids`` are stop-trimmed (no EOS / stop token)."""

    sample_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    weight_version: int
    provenance: RolloutProvenance
    # Behaviour log-probs: log p(token) under the weights that sampled it, of the distribution it was
    # drawn from (after repetition penalty, temperature, top-k / top-p; vLLM's processed log-probs),
    # which the GRPO learner matches with log_softmax(logits / temperature). One per response token,
    # then, when the rollout stopped on a stop token, that token (not in the stop-trimmed ids) and its
    # log-prob. None: the backend returned none.
    response_logprobs: list[float] | None = None
    stop_token_id: int | None = None
    stop_logprob: float | None = None

    @property
    def hit_max_tokens(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class SyncReport:
    """What one weight push did: bytes sent, seconds taken, the version now served (and, for rollout
    servers, the URLs of the servers that now serve it)."""

    version: int
    num_bytes: int
    seconds: float
    mode: Literal["full", "adapter", "none"]
    servers: tuple[str, ...] = ()


@runtime_checkable
class RolloutBackend(Protocol):
    """Every rollout backend (HF generate, in-process vLLM, HTTP rollout servers)."""

    name: str

    @property
    def weight_version(self) -> int:
        """The weight version the backend currently generates with."""
        ...

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        """Roll out every request (no grad); outputs are in request order."""
        ...

    def sync_weights(self, model: Any, version: int) -> SyncReport:
        """Make the backend generate with ``model``'s current weights, tagged ``version``."""
        ...

    def close(self) -> None:
        """Release engines, sockets and process groups; safe to call twice."""
        ...
