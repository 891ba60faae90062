"""The GRPO loss on inline inputs: a tiny batch equals a hand computation, clipping and the dual clip pick
the documented branch, the KL term, the ratio histogram's quantiles, and one gradient step on a real
tiny model raises the probability of the better sample of a group and lowers the other's."""

from __future__ import annotations

import math

import pytest
import torch

from rollmatch.detection.rewards import group_advantages
from rollmatch.training.grpo_loss import (
    GrpoSettings,
    grpo_loss_sum,
    ratio_quantiles,
    token_logprobs,
)

# is_correction "none": every ratio is taken against the behaviour log-prob (the staleness path)
SETTINGS = GrpoSettings(clip_eps=0.2, clip_eps_high=0.3, max_ratio=3.0, is_correction="none")


def test_loss_of_a_tiny_batch_equals_a_hand_computation() -> None:
    # one row of 5 positions: position 0 never trained, position 2 weight 0
    current = torch.tensor([[0.0, math.log(0.5), math.log(0.2), math.log(0.9), math.log(0.1)]])
    behaviour = torch.tensor([[0.0, math.log(0.5), math.log(0.4), math.log(0.6), math.log(0.01)]])
    advantages = torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0]])
    weights = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]])
    loss_sum, stats = grpo_loss_sum(current, behaviour, advantages, weights, SETTINGS)
    # t1: r 1, A 1 -> -1. t3: r 1.5 > 1.3, A 1 -> clipped -1.3. t4: r 10, A -1 -> min(-10, -1.2) = -10,
    # dual clip max(-10, 3 * -1) = -3 -> loss +3.
    assert float(loss_sum) == pytest.approx(-1.0 - 1.3 + 3.0, rel=1e-6)
    assert stats["grpo/tokens"] == 3 and stats["grpo/clipped_tokens"] == 1
    assert stats["grpo/dual_clipped_tokens"] == 1
    assert stats["grpo/ratio_sum"] == pytest.approx(1.0 + 1.5 + 10.0, rel=1e-6)


def test_the_step_normaliser_is_per_token_over_rows() -> None:
    # two rows (two micro-steps), 1 and 3 trained tokens: the step loss is the sum over 4 tokens / 4
    rows = [
        (torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 2.0]])),
        (torch.tensor([[0.0, -1.0, -1.0, -1.0]]), torch.tensor([[0.0, -1.0, -1.0, -1.0]])),
    ]
    sums = [
        grpo_loss_sum(lp, lp.clone(), adv, (adv != 0).float(), SETTINGS)[0] for lp, adv in rows
    ]  # ratio 1: loss_t = -A
    assert float(sum(sums)) / 4 == pytest.approx((-2.0 + 3.0) / 4, rel=1e-12)


def test_importance_ratio_is_one_for_fresh_rollouts() -> None:
    logprobs = torch.log(torch.tensor([[0.3, 0.2, 0.7, 0.05]]))
    _, stats = grpo_loss_sum(
        logprobs, logprobs.clone(), torch.ones_like(logprobs), torch.ones_like(logprobs), SETTINGS
    )
    assert stats["grpo/ratio_sum"] == pytest.approx(3.0, rel=1e-12) and stats["grpo/clipped_tokens"] == 0
    assert ratio_quantiles(stats) == pytest.approx([1.0, 1.0, 1.0], rel=1e-3)


def test_kl_to_the_reference_is_the_k3_estimator() -> None:
    current = torch.log(torch.tensor([[0.5, 0.5, 0.25]]))
    reference = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    settings = GrpoSettings(kl_coef=0.1, is_correction="none")
    zero = torch.zeros_like(current)
    loss_sum, stats = grpo_loss_sum(
        current, current.clone(), zero, torch.ones_like(current), settings, reference
    )
    delta = math.log(2.0)  # reference - current at the last token
    k3 = math.exp(delta) - delta - 1.0
    assert stats["grpo/kl_sum"] == pytest.approx(k3, rel=1e-6)
    assert float(loss_sum) == pytest.approx(0.1 * k3, rel=1e-6)


def test_ratio_quantiles_follow_the_histogram() -> None:
    log_ratios = torch.tensor([[0.0] + [-0.3] * 10 + [0.0] * 80 + [0.3] * 10])
    behaviour = -log_ratios  # current 0
    _, stats = grpo_loss_sum(
        torch.zeros_like(log_ratios),
        behaviour,
        torch.ones_like(log_ratios),
        torch.ones_like(log_ratios),
        SETTINGS,
    )
    p05, p50, p95 = ratio_quantiles(stats)
    assert 0.6 < p05 < math.exp(-0.2) and p50 == pytest.approx(1.0, abs=1e-3) and math.exp(0.2) < p95 < 1.7


def test_a_gradient_step_raises_the_better_sample_and_lowers_the_other(loaded_tiny) -> None:
    model, _ = loaded_tiny
    torch.manual_seed(0)
    prompt = torch.randint(10, 200, (6,))
    samples = [torch.randint(10, 200, (5,)) for _ in range(2)]
    advantages = group_advantages([1.0, 0.0])  # sample 0 rewarded more

    def sample_logprob() -> list[float]:
        with torch.no_grad():
            return [float(row_logprobs(model, prompt, s).sum()) for s in samples]

    before = sample_logprob()
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for sample, advantage in zip(samples, advantages, strict=True):
        logprobs = row_logprobs(model, prompt, sample)
        adv = torch.full_like(logprobs, advantage)
        loss_sum, _ = grpo_loss_sum(logprobs, logprobs.detach(), adv, torch.ones_like(logprobs), SETTINGS)
        total = total + loss_sum
    (total / 10).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    after = sample_logprob()
    try:
        assert after[0] > before[0] and after[1] < before[1], (before, after)
    finally:
        with torch.no_grad():  # undo the step: the session model is shared
            for p in model.parameters():
                if p.grad is not None:
                    p += 0.05 * p.grad
        model.zero_grad(set_to_none=True)


def row_logprobs(model: torch.nn.Module, prompt: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``sample``'s tokens after ``prompt`` (text only), shape (len(sample),)."""
    ids = torch.cat([prompt, sample])[None]
    trained = torch.zeros_like(ids, dtype=torch.bool)
    trained[0, prompt.shape[0] :] = True
    logits = model(input_ids=ids, use_cache=False).logits
    return token_logprobs(logits, ids, trained)[0, prompt.shape[0] :]
