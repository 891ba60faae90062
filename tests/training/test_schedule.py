"""The pure A/B schedule (DESIGN §10) and the step-mode budget arithmetic."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollmatch.errors import ConfigError
from rollmatch.training.channel_b.step_mode import extra_record_indices, rank_share
from rollmatch.training.schedule import (
    b_steps_before,
    fixed_size_chunks,
    is_channel_b,
    realized_b_ratio,
    step_kind,
)


def kinds(b_ratio: float, steps: int) -> str:
    return "".join(step_kind(s, b_ratio) for s in range(steps))


def test_half_alternates_starting_with_a():
    assert kinds(0.5, 4) == "ABAB"


def test_zero_is_always_a_and_one_is_always_b():
    assert kinds(0.0, 50) == "A" * 50
    assert kinds(1.0, 50) == "B" * 50


def test_five_percent_first_b_at_step_19():
    assert kinds(0.05, 19) == "A" * 19
    assert step_kind(19, 0.05) == "B"
    assert [s for s in range(100) if is_channel_b(s, 0.05)] == [19, 39, 59, 79, 99]


def test_decimal_ratio_is_exact_where_float_products_round_down():
    # In binary floating point 100 * 0.29 == 28.999999999999996: a float floor would drop a B step.
    assert 100 * 0.29 < 29
    assert b_steps_before(100, 0.29) == 29
    assert sum(is_channel_b(s, 0.29) for s in range(100)) == 29


@given(st.integers(0, 1000).map(lambda k: k / 1000), st.integers(0, 500))
def test_rule_matches_its_definition_and_counts(b_ratio, step):
    expected = math.floor((step + 1) * b_ratio + 1e-9) > math.floor(step * b_ratio + 1e-9)
    assert is_channel_b(step, b_ratio) == expected
    assert sum(is_channel_b(s, b_ratio) for s in range(step + 1)) == b_steps_before(step + 1, b_ratio)
    assert realized_b_ratio(step, b_ratio) == pytest.approx(b_steps_before(step + 1, b_ratio) / (step + 1))


def test_resumed_schedule_equals_uninterrupted():
    # The rule is a function of the optimizer step alone: a run resumed at step 7 continues identically.
    uninterrupted = kinds(0.3, 20)
    resumed = kinds(0.3, 7) + "".join(step_kind(s, 0.3) for s in range(7, 20))
    assert resumed == uninterrupted


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_out_of_range_ratio_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"stage2_ab\.schedule\.b_ratio"):
        step_kind(0, bad)


def test_fixed_size_chunks_cover_in_order():
    assert fixed_size_chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert fixed_size_chunks(0, 2) == []
    with pytest.raises(ConfigError, match=r"custom\.extra\.rollout_matching\.decode_batch_size"):
        fixed_size_chunks(3, 0)


@given(st.integers(1, 200), st.integers(1, 8))
def test_rank_shares_sum_to_the_budget(total, world):
    shares = [rank_share(total, r, world) for r in range(world)]
    assert sum(shares) == total
    assert max(shares) - min(shares) <= 1


def test_extra_record_stream_is_a_deterministic_permutation_per_pass():
    first = extra_record_indices(0, 10, stride=10, num_records=10, seed=1, rank=0)
    assert sorted(first) == list(range(10))  # one pass visits every record once
    assert first == extra_record_indices(0, 10, stride=10, num_records=10, seed=1, rank=0)
    assert first != extra_record_indices(0, 10, stride=10, num_records=10, seed=1, rank=1)
    # Step 3 reads its own slice of the stream, whatever happened before (resume).
    stream = extra_record_indices(0, 40, stride=40, num_records=10, seed=1, rank=0)
    assert extra_record_indices(3, 4, stride=10, num_records=10, seed=1, rank=0) == stream[30:34]
