"""The Stage-2 AB schedule: which channel each optimizer step trains on (pure functions).

Owns: the deterministic A/B rule of DESIGN §10 — optimizer step ``s`` (0-indexed) runs Channel-B iff
``floor((s + 1) * b_ratio) > floor(s * b_ratio)`` — the realized B fraction it implies, and the
split of a decode batch into contiguous rollout calls. Leaves out: the cross-rank agreement on the
kind (rank 0 decides, every rank agrees: ``training.step``) and what each channel does.

The rule spreads B steps evenly (``b_ratio: 0.25`` -> A, A, A, B, A, A, A, B, ...), depends only on
the optimizer-step counter (so a resumed run continues exactly where it stopped) and needs no
state. ``b_ratio`` is evaluated as the exact decimal the config spells (``0.29`` is 29/100, not the
nearest binary float), so ``floor`` never lands one below an integer because of rounding.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal

from rollmatch.errors import ConfigError, ConfigProblem

StepKind = Literal["A", "B"]
_B_RATIO_KEY = "stage2_ab.schedule.b_ratio"


def exact_b_ratio(b_ratio: float) -> Fraction:
    """``b_ratio`` as the exact decimal it was written as; raises :class:`ConfigError` outside [0, 1]."""
    if isinstance(b_ratio, bool) or not 0.0 <= b_ratio <= 1.0:
        raise ConfigError(
            [
                ConfigProblem(
                    _B_RATIO_KEY, b_ratio, "must be a float in [0, 1]: the fraction of Channel-B steps"
                )
            ]
        )
    # repr() of a float is the shortest decimal that round-trips: what the YAML file said.
    return Fraction(repr(float(b_ratio)))


def b_steps_before(step: int, b_ratio: float) -> int:
    """How many of the optimizer steps ``0 .. step-1`` run Channel-B (``floor(step * b_ratio)``)."""
    if step < 0:
        raise ValueError(f"optimizer step must be >= 0, got {step}")
    ratio = exact_b_ratio(b_ratio)
    return (step * ratio.numerator) // ratio.denominator


def is_channel_b(step: int, b_ratio: float) -> bool:
    """True iff optimizer step ``step`` (0-indexed) runs Channel-B."""
    return b_steps_before(step + 1, b_ratio) > b_steps_before(step, b_ratio)


def step_kind(step: int, b_ratio: float) -> StepKind:
    """``"B"`` (rollout matching) or ``"A"`` (GT teacher forcing) for optimizer step ``step``."""
    return "B" if is_channel_b(step, b_ratio) else "A"


def realized_b_ratio(step: int, b_ratio: float) -> float:
    """Fraction of the steps ``0 .. step`` (inclusive) that run Channel-B."""
    return b_steps_before(step + 1, b_ratio) / (step + 1)


def fixed_size_chunks(count: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``range(count)`` in order, each ``chunk_size`` long but the last.

    (Not :func:`rollmatch.rollout.chunking.contiguous_chunks`, which takes a number of chunks.) Used
    to split one step's rollouts into backend calls of
    ``custom.extra.rollout_matching.decode_batch_size`` samples.
    """
    if chunk_size <= 0:
        raise ConfigError(
            [
                ConfigProblem(
                    "custom.extra.rollout_matching.decode_batch_size",
                    chunk_size,
                    "must be >= 1 (samples per rollout call)",
                )
            ]
        )
    return [(start, min(start + chunk_size, count)) for start in range(0, count, chunk_size)]
