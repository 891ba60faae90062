"""The GRPO loss of policy-gradient rows: per-token log-probs, clipped surrogate, dual clip, KL, stats.

Owns :func:`token_logprobs` (the learner's log-prob of each token of a row, computed where a weight is
non-zero), :class:`GrpoSettings` (``loss.grpo``, as the loss reads it), :func:`grpo_loss_sum` (the row's
weighted loss *sum*; the optimizer step divides by its total weight, as for cross-entropy) and
:func:`ratio_quantiles` (quantiles of the importance ratio from the additive histogram sums) and
:func:`recompute_logprobs` (the learner's log-probs of a rollout, to check an engine against).
Leaves out: rewards and advantages (``detection.rewards``), which tokens are trained (the segment's
weights: every sampled response token, the stop token included) and the reference model's forward
(``training.trainer``).

Per trained token t with advantage ``A``, behaviour log-prob ``b`` (the engine that sampled it), current
log-prob ``l`` and ratio ``r = exp(l - b)``::

    s_t = min(r A, clip(r, 1 - eps, 1 + eps_high) A)          PPO's clipped surrogate
    s_t = max(s_t, max_ratio * A)   where A < 0                 dual clip: a stale token's ratio counts at
                                                                most max_ratio (truncated importance ratio)
    loss_t = -s_t + kl_coef * (exp(q - l) - (q - l) - 1)       q: the frozen starting weights' log-prob (k3)

and the step's loss is ``sum(w * loss_t) / sum(w)`` over every trained token of the optimizer step
(all rows, micro-steps and ranks). For a fresh rollout ``r`` is 1 up to the engine's arithmetic, and the
gradient is ``-A * grad l``: a positive advantage raises the token's probability.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import PackingError
from rollmatch.packing.collate import model_inputs, pack_row
from rollmatch.packing.segment import build_segment
from rollmatch.rollout.types import RolloutRequest

# Edges of the log-ratio histogram (``grpo/ratio_hist/<bin>`` sums): symmetric, finer near 0.
_LOG_EDGES = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
LOG_RATIO_EDGES: tuple[float, ...] = (*(-e for e in reversed(_LOG_EDGES)), *_LOG_EDGES)
HIST_PREFIX = "grpo/ratio_hist/"


@dataclass(frozen=True)
class GrpoSettings:
    """What the loss reads of ``loss.grpo``."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    max_ratio: float = 3.0
    kl_coef: float = 0.0

    @property
    def high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The KL reference: a copy of ``model``'s starting weights, in eval mode, never trained.

    Memory: one more copy of the parameters (no gradients, no optimizer state): about a quarter of what
    full fine-tuning with AdamW holds (weights + gradients + two moments).
    """
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def grpo_settings(cfg: RollmatchConfig) -> GrpoSettings:
    grpo = cfg.loss.grpo
    return GrpoSettings(
        clip_eps=grpo.clip_eps,
        clip_eps_high=grpo.clip_eps_high,
        max_ratio=grpo.max_ratio,
        kl_coef=grpo.kl_coef,
    )


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t-1])[input_ids[b, t]]`` where ``trained[b, t]``, else 0.

    Shapes: logits (B, L, V), input_ids and trained (B, L). Float32; only trained positions are gathered
    before the log-softmax, so memory follows the trained tokens.
    """
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    mask = trained[:, 1:].to(logits.device)
    if not bool(mask.any()):
        return out + logits.sum().float() * 0.0  # keep the graph (DDP lock-step)
    chosen = logits[:, :-1, :][mask].float()
    targets = input_ids[:, 1:].to(logits.device)[mask]
    values = torch.log_softmax(chosen, dim=-1).gather(1, targets[:, None])[:, 0]
    shifted = torch.zeros_like(out[:, 1:])
    shifted = shifted.masked_scatter(mask, values)
    return torch.cat([out[:, :1], shifted], dim=1)


def grpo_loss_sum(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    settings: GrpoSettings,
    reference_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Counter[str]]:
    """The weighted loss sum of one row (every tensor (B, L) or (L,)) and its additive stats.

    Stats: ``grpo/tokens``, ``grpo/clipped_tokens`` (the clipped branch was taken: no gradient),
    ``grpo/dual_clipped_tokens``, ``grpo/ratio_sum``, ``grpo/kl_sum`` and the log-ratio histogram.
    """
    if not (logprobs.shape == behaviour_logprobs.shape == advantages.shape == weights.shape):
        raise PackingError(
            f"GRPO loss shapes disagree: logprobs {tuple(logprobs.shape)}, behaviour {tuple(behaviour_logprobs.shape)}, "
            f"advantages {tuple(advantages.shape)}, weights {tuple(weights.shape)}"
        )
    device = logprobs.device
    w = weights.to(device=device, dtype=torch.float32)
    trained = w != 0
    trained[..., 0] = False  # position 0 is never predicted
    b = behaviour_logprobs.to(device=device, dtype=torch.float32)
    adv = advantages.to(device=device, dtype=torch.float32)
    log_ratio = torch.where(trained, logprobs - b, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - settings.clip_eps, 1.0 + settings.high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    dual = (adv < 0) & (surrogate < settings.max_ratio * adv)
    surrogate = torch.where(dual, settings.max_ratio * adv, surrogate)
    per_token = -surrogate
    kl = torch.zeros_like(per_token)
    if reference_logprobs is not None and settings.kl_coef > 0:
        delta = reference_logprobs.to(device=device, dtype=torch.float32) - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + settings.kl_coef * kl
    w = torch.where(trained, w, torch.zeros_like(w))
    loss_sum = (per_token * w).sum()
    stats: Counter[str] = Counter()
    with torch.no_grad():
        took_clip = ((adv > 0) & (ratio > 1.0 + settings.high)) | (
            (adv < 0) & (ratio < 1.0 - settings.clip_eps)
        )
        stats["grpo/tokens"] = float(trained.sum())
        stats["grpo/clipped_tokens"] = float((took_clip & trained).sum())
        stats["grpo/dual_clipped_tokens"] = float((dual & trained).sum())
        stats["grpo/ratio_sum"] = float(ratio[trained].sum())
        stats["grpo/kl_sum"] = float(kl[trained].sum())
        edges = torch.tensor(LOG_RATIO_EDGES, dtype=torch.float32, device=device)
        bins = torch.bucketize(log_ratio[trained].detach(), edges)
        for index, count in zip(*torch.unique(bins, return_counts=True), strict=True):
            stats[f"{HIST_PREFIX}{int(index):02d}"] = float(count)
    return loss_sum, stats


def ratio_quantiles(
    sums: Mapping[str, float], quantiles: tuple[float, ...] = (0.05, 0.5, 0.95)
) -> list[float]:
    """Quantiles of the importance ratio from the histogram sums (linear within a bin on the log scale;
    the open end bins are reported at their inner edge)."""
    counts = [float(sums.get(f"{HIST_PREFIX}{i:02d}", 0.0)) for i in range(len(LOG_RATIO_EDGES) + 1)]
    total = sum(counts)
    if total <= 0:
        return []
    lows = (LOG_RATIO_EDGES[0], *LOG_RATIO_EDGES)
    highs = (*LOG_RATIO_EDGES, LOG_RATIO_EDGES[-1])
    out = []
    for q in quantiles:
        target, seen = q * total, 0.0
        for count, low, high in zip(counts, lows, highs, strict=True):
            if count and seen + count >= target:
                out.append(math.exp(low + (high - low) * (target - seen) / count))
                break
            seen += count
        else:
            out.append(math.exp(highs[-1]))
    return out


def recompute_logprobs(
    model: torch.nn.Module, request: RolloutRequest, token_ids: Sequence[int]
) -> list[float]:
    """The learner's log-probs of ``token_ids`` after ``request``'s prompt: one packed segment through the
    training forward, as a GRPO row is trained (checks engines and weight sync against the learner)."""
    segment = build_segment(
        model,
        sample_id=request.sample_id,
        prompt_ids=request.prompt_token_ids,
        response_ids=list(token_ids),
        response_weights=[1.0] * len(token_ids),
        pixel_values=request.pixel_values,
        image_grid_thw=request.image_grid_thw,
        prompt_mm_token_type_ids=request.mm_token_type_ids or [0] * len(request.prompt_token_ids),
        max_length=len(request.prompt_token_ids) + len(token_ids),
    )
    batch = pack_row([segment])
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
    values = token_logprobs(logits, batch["input_ids"], batch["weights"] != 0)[0]
    return values[len(request.prompt_token_ids) :].tolist()
