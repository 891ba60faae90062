"""DDP lock-step in ``micro`` mode: with several ranks every micro-step runs exactly one forward/backward
on every rank, whatever the rows the step's rollouts fill (2 thread ranks, a tiny real model, HF rollouts).

A step whose segments fill fewer rows than micro-steps pads with zero-weight rows; one that fills more
trains one row per micro-step and carries the rest, failing with a clear error once the carry buffer
would overflow (on every rank at once)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from resolved_runs import producer
from thread_ranks import ThreadRanks, on_ranks

from rollmatch.rollout.hf import HFBackend
from rollmatch.training.channel_modes import WindowRows
from rollmatch.training.rows import RowPlanner
from rollmatch.training.step import ABSchedule, StepPlanner


@pytest.fixture
def tiny(stage2_tiny: SimpleNamespace) -> SimpleNamespace:
    model, encoder = stage2_tiny.model, stage2_tiny.encoder
    backend = HFBackend(
        model, encoder.tokenizer, eos_token_id=encoder.eos_token_id, pad_token_id=encoder.pad_token_id
    )
    rollouts = producer(stage2_tiny, model, backend, 4)
    return SimpleNamespace(rollouts=rollouts, records=stage2_tiny.records, encoder=encoder)


def micro_planner(
    tiny: SimpleNamespace,
    collectives: ThreadRanks,
    *,
    row_tokens: int,
    carry: int,
    max_carry_age_steps: int | None = None,
) -> StepPlanner:
    rows = RowPlanner(
        packing=True,
        packing_length=row_tokens,
        carry_limit=carry,
        pad_token_id=tiny.encoder.pad_token_id,
        one_row_per_micro_step=collectives.world_size > 1,  # as the trainer builds it
        max_carry_age_steps=max_carry_age_steps,
    )
    return StepPlanner(
        schedule=ABSchedule(1.0),
        channel_a=None,
        channel_b=WindowRows(tiny.rollouts.produce, rows),
        sync=None,
        collectives=collectives,
        report_ab=False,
    )


def passes_per_micro_step(plan: Any) -> list[int]:
    return [sum(1 for _ in micro.passes(plan.total_weight)) for micro in plan.micro_steps]


def test_fewer_rows_than_micro_steps_pad_every_micro_step_to_one_pass(tiny) -> None:
    """Three micro-steps of one record each: their rollouts share one packed row on each rank."""

    def plan(collectives: ThreadRanks) -> list[int]:
        records = tiny.records[collectives.rank :: 2]
        steps = micro_planner(tiny, collectives, row_tokens=8192, carry=16)
        return passes_per_micro_step(steps.plan([records[0:1], records[1:2], records[2:3]], 0))

    assert on_ranks(2, plan) == [[1, 1, 1], [1, 1, 1]]


def test_more_rows_than_micro_steps_train_one_per_micro_step_and_carry_the_rest(tiny) -> None:
    """One micro-step of three records whose rollouts do not share a row: one row per step, the rest
    waits; once the carry buffer would overflow every rank fails naming the keys."""
    lengths = [s.length for s in tiny.rollouts.produce(tiny.records[:6], 0).segments]
    row_tokens = max(lengths)  # no two rollouts share a row

    def plan(collectives: ThreadRanks) -> tuple[list[list[int]], str]:
        records = tiny.records[collectives.rank :: 2]
        steps = micro_planner(tiny, collectives, row_tokens=row_tokens, carry=4)
        counts = [passes_per_micro_step(steps.plan([records[0:3]], step)) for step in range(2)]
        try:  # 3 more rollouts, one row: 2 + 2 + 2 would wait, more than the carry's 4
            steps.plan([records[0:3]], 2)
        except Exception as exc:
            return counts, f"{type(exc).__name__}: {exc}"
        return counts, "no error"

    outcomes = on_ranks(2, plan)
    for counts, error in outcomes:
        assert counts == [[1], [1]]
        assert "training.carry_buffer_size" in error and "one per micro-step with several ranks" in error, (
            error
        )


def test_carried_rollouts_older_than_max_carry_age_steps_are_dropped_and_counted(tiny) -> None:
    """Two ranks, one micro-step of three records whose rollouts do not share a row: each step trains one
    row and carries the rest, oldest first. With ``max_carry_age_steps: 1`` a segment carried into a second
    later step is dropped (per rank: step 0's last one at step 2, step 1's two left at step 3), counted in ``stage2_ab/micro/carry_dropped_stale``, and no
    trained segment is older than one step (``stage2_ab/micro/carry_age_max``)."""
    lengths = [s.length for s in tiny.rollouts.produce(tiny.records[:6], 0).segments]
    row_tokens = max(lengths)  # no two rollouts share a row

    def plan(collectives: ThreadRanks) -> list[tuple[float, float]]:
        records = tiny.records[collectives.rank :: 2]
        steps = micro_planner(tiny, collectives, row_tokens=row_tokens, carry=16, max_carry_age_steps=1)
        seen = []
        for step in range(4):
            planned = steps.plan([records[0:3]], step)
            seen.append(
                (
                    planned.sums["stage2_ab/micro/carry_dropped_stale"],
                    planned.gauges["stage2_ab/micro/carry_age_max"],
                )
            )
        return seen

    for seen in on_ranks(2, plan):  # sums over both ranks, the gauge's max over them
        assert seen == [(0, 0.0), (0, 1.0), (2, 1.0), (4, 1.0)], seen
