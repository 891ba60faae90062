"""The decoding settings a run uses, worked out once from its config.

Owns: :class:`Decoding` (one rollout call's settings; every backend and the server protocol use it),
:func:`rollout_decoding` (``custom.extra.rollout_matching.decoding`` with its ``max_new_tokens``) and
:func:`eval_decoding` (``eval.decoding``, default greedy, never the rollout decoding, with
``eval.max_new_tokens`` or else the rollout's budget). ``config.resolved`` puts both into the resolved
run; the builders take them from there. Leaves out: how a backend applies them (``rollout``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollmatch.config.schema import RollmatchConfig


@dataclass(frozen=True)
class Decoding:
    """Decoding settings of one rollout call; greedy iff ``temperature == 0``."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    max_new_tokens: int = 512

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def rollout_decoding(cfg: RollmatchConfig) -> Decoding:
    """The rollouts' :class:`Decoding`: ``custom.extra.rollout_matching.decoding`` and ``max_new_tokens``."""
    rm = cfg.rollout
    return Decoding(
        temperature=rm.decoding.temperature,
        top_p=rm.decoding.top_p,
        top_k=rm.decoding.top_k,
        repetition_penalty=rm.decoding.repetition_penalty,
        max_new_tokens=rm.max_new_tokens,
    )


def eval_decoding(cfg: RollmatchConfig) -> Decoding:
    """The evaluation's :class:`Decoding`: ``eval.decoding`` (default greedy, never the rollout
    decoding) with ``eval.max_new_tokens`` (default: the rollout's ``max_new_tokens``)."""
    settings = cfg.eval.decoding
    return Decoding(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        repetition_penalty=settings.repetition_penalty,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
    )
