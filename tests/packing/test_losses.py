"""Weighted CE: shift convention, float32 math, per-segment sums, step normalisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollmatch.errors import PackingError
from rollmatch.training.losses import normalize_step_loss, per_segment_ce, weighted_ce_sum


def reference_sum(logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position by position: weights[t] * CE(logits[t - 1], input_ids[t])."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(input_ids.shape[0]):
        for t in range(1, input_ids.shape[1]):
            log_probs = F.log_softmax(logits[b, t - 1].double(), dim=-1)
            total = total - weights[b, t].double() * log_probs[input_ids[b, t]]
    return total


def random_batch(seed: int, batch: int = 2, length: int = 9, vocab: int = 13) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen) * 3
    input_ids = torch.randint(0, vocab, (batch, length), generator=gen)
    weights = torch.rand(batch, length, generator=gen) * (torch.rand(batch, length, generator=gen) > 0.3)
    return logits, input_ids, weights


def test_matches_position_by_position_reference() -> None:
    logits, input_ids, weights = random_batch(0)
    expected = reference_sum(logits, input_ids, weights)
    assert float(weighted_ce_sum(logits, input_ids, weights)) == pytest.approx(float(expected), rel=1e-6)
    # Unbatched inputs are one row.
    single = weighted_ce_sum(logits[0], input_ids[0], weights[0])
    assert float(single) == pytest.approx(
        float(reference_sum(logits[:1], input_ids[:1], weights[:1])), rel=1e-6
    )
    # Position 0 is never predicted: its weight does not matter.
    weights[:, 0] = 123.0
    assert float(weighted_ce_sum(logits, input_ids, weights)) == pytest.approx(float(expected), rel=1e-6)


def test_low_precision_logits_are_reduced_in_float32() -> None:
    logits, input_ids, weights = random_batch(1)
    result = weighted_ce_sum(logits.bfloat16(), input_ids, weights)
    assert result.dtype == torch.float32
    expected = reference_sum(logits.bfloat16().float(), input_ids, weights)
    assert float(result) == pytest.approx(float(expected), rel=1e-5)


def test_all_zero_weights_give_zero_with_a_graph() -> None:
    logits, input_ids, _ = random_batch(2)
    logits.requires_grad_(True)
    loss = weighted_ce_sum(logits, input_ids, torch.zeros_like(input_ids, dtype=torch.float32))
    loss.backward()
    assert float(loss.detach()) == 0.0 and logits.grad is not None and float(logits.grad.abs().sum()) == 0.0


def test_per_segment_sums_add_up_to_the_row() -> None:
    logits, input_ids, weights = random_batch(3, batch=1, length=12)
    lengths = [5, 4, 3]
    for start in (0, 5, 9):
        weights[0, start] = 0.0  # pack_row zeroes each segment's first token
    parts = per_segment_ce(logits, input_ids, weights, lengths)
    assert len(parts) == 3
    assert float(sum(parts)) == pytest.approx(float(weighted_ce_sum(logits, input_ids, weights)), rel=1e-6)
    assert float(parts[1]) == pytest.approx(
        float(reference_sum(logits[:, 5:9], input_ids[:, 5:9], weights[:, 5:9]))
    )


def test_shape_and_normalisation_errors() -> None:
    logits, input_ids, weights = random_batch(4)
    with pytest.raises(PackingError, match="loss shapes disagree"):
        weighted_ce_sum(logits, input_ids[:, :-1], weights[:, :-1])
    with pytest.raises(PackingError, match="segment lengths sum to 5 but the row has 9"):
        per_segment_ce(logits[:1], input_ids[:1], weights[:1], [2, 3])
    with pytest.raises(PackingError, match="one packed row"):
        per_segment_ce(logits, input_ids, weights, [9])
    with pytest.raises(PackingError, match="total loss weight 0"):
        normalize_step_loss(torch.tensor(1.0), 0.0)
    assert float(normalize_step_loss(torch.tensor(6.0), 4.0)) == 1.5


def reference_unlikelihood(
    logits: torch.Tensor, input_ids: torch.Tensor, flags: torch.Tensor
) -> torch.Tensor:
    """Position by position: flags[t] * -log(1 - softmax(logits[t - 1])[input_ids[t]])."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(input_ids.shape[0]):
        for t in range(1, input_ids.shape[1]):
            p = F.softmax(logits[b, t - 1].double(), dim=-1)[input_ids[b, t]]
            total = total - flags[b, t].double() * torch.log1p(-p)
    return total


def test_unlikelihood_term_adds_minus_log_one_minus_p_at_flagged_positions() -> None:
    logits, input_ids, weights = random_batch(3)
    flags = torch.zeros_like(weights)
    flags[0, 2], flags[1, 5], flags[1, 0] = 0.5, 2.0, 9.0  # position 0 is never predicted
    with_ul = weighted_ce_sum(logits, input_ids, weights, unlikelihood=flags)
    expected = reference_sum(logits, input_ids, weights) + reference_unlikelihood(logits, input_ids, flags)
    assert float(with_ul) == pytest.approx(float(expected), rel=1e-6)
    # flags alone, no CE weight anywhere: the term is still there (and differentiable)
    logits.requires_grad_(True)
    alone = weighted_ce_sum(logits, input_ids, torch.zeros_like(weights), unlikelihood=flags)
    expected_alone = reference_unlikelihood(logits.detach(), input_ids, flags)
    assert float(alone.detach()) == pytest.approx(float(expected_alone), rel=1e-6)
    alone.backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0


def test_unlikelihood_of_a_near_certain_token_stays_finite_with_a_gradient() -> None:
    logits = torch.zeros(1, 2, 5)
    logits[0, 0, 3] = 60.0  # p(token 3) = 1 - 4e-26: 1 - p rounds to 0 in float32
    logits.requires_grad_(True)
    input_ids = torch.tensor([[0, 3]])
    flags = torch.tensor([[0.0, 1.0]])
    loss = weighted_ce_sum(logits, input_ids, torch.zeros_like(flags), unlikelihood=flags)
    assert float(loss.detach()) == pytest.approx(60.0 - torch.log(torch.tensor(4.0)).item(), rel=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and float(logits.grad[0, 0, 3]) > 0  # pushes the logit down


def test_per_segment_sums_carry_the_unlikelihood_term() -> None:
    logits, input_ids, weights = random_batch(4, batch=1, length=10)
    flags = torch.zeros_like(weights)
    flags[0, 3], flags[0, 8] = 1.0, 0.5
    parts = per_segment_ce(logits, input_ids, weights, [4, 6], unlikelihood=flags)
    whole = weighted_ce_sum(logits, input_ids, weights, unlikelihood=flags)
    # the row's second segment starts at 4: position 4 is not predicted by per-segment sums
    first = weighted_ce_sum(logits[:, :4], input_ids[:, :4], weights[:, :4], unlikelihood=flags[:, :4])
    assert float(parts[0]) == pytest.approx(float(first), rel=1e-6)
    assert float(sum(parts)) <= float(whole) + 1e-6 * abs(float(whole))
