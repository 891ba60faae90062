"""The GRPO loss of policy-gradient rows: per-token log-probs, clipped surrogate, dual clip, KL, stats.

Owns :func:`token_logprobs` (the learner's log-prob of each token of a row, computed where a weight is
non-zero), :class:`GrpoSettings` (``loss.grpo``, as the loss reads it), :func:`grpo_loss_sum` (the row's
weighted loss *sum*; the optimizer step divides by its total weight, as for cross-entropy) and
:func:`ratio_quantiles` (quantiles of the importance ratio from the additive histogram sums) and
:func:`recompute_logprobs` (the learner's log-probs of a rollout, to check an engine against).
Leaves out: rewards and advantages (``detection.rewards``), which tokens are trained (the segment's
weights: every sampled response token, the stop token included) and the reference model's forward
(``training.trainer``).

Per trained token t with advantage ``A``, engine (behaviour) log-prob ``b``, learner log-prob ``l``
(``log_softmax(logits / T)`` at the sampling temperature) and lag (optimizer steps since the weights
that sampled it)::

    old = l.detach() if fresh and is_correction != none else b
    r   = exp(clamp(l - old, -20, 20))                            staleness ratio (1 for a fresh token)
    s_t = min(r A, clip(r, 1 - eps, 1 + eps_high) A)             PPO's clipped surrogate
    s_t = max(s_t, max_ratio * A)   where A < 0                   dual clip (verl's clip_ratio_c): no gradient
    w_t = min(exp(l - b), is_cap)   fresh tokens (token_truncate; TRL's engine/learner correction), else 1
    loss_t = -s_t * w_t + kl_coef * (exp(q - l) - (q - l) - 1)   q: the frozen starting weights' log-prob (k3)

and the step's loss is ``sum(w * loss_t) / N`` over every trained token of the optimizer step (all rows,
micro-steps and ranks), the token weights ``w`` and ``N`` set by ``loss_type``
(``grpo_targets.policy_token_weights``). On a fresh rollout the gradient is ``-A * w_t * grad l``.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

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
# Bound of every log-ratio before ``exp`` (verl's): a token the learner finds far likelier than the engine
# did cannot turn into inf and a NaN gradient.
LOG_RATIO_CLAMP = 20.0
IsCorrection = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass(frozen=True)
class GrpoSettings:
    """What the loss reads of ``loss.grpo``."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    max_ratio: float = 3.0
    kl_coef: float = 0.0
    # The rollouts' sampling temperature: the learner's logits are divided by it, so its log-probs are
    # those of the distribution the behaviour log-probs come from.
    temperature: float = 1.0
    # The engine/learner correction of fresh tokens (TRL's vllm_importance_sampling_mode) and its cap.
    is_correction: IsCorrection = "token_truncate"
    is_cap: float = 3.0

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
        temperature=cfg.rollout.decoding.temperature,
        is_correction=grpo.is_correction,
        is_cap=grpo.is_cap,
    )


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, trained: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]`` where ``trained[b, t]``,
    else 0: the log-prob under the sampling distribution (TRL and verl divide the logits alike).

    Shapes: logits (B, L, V), input_ids and trained (B, L). Float32; only trained positions are gathered
    before the log-softmax, so memory follows the trained tokens.
    """
    if not temperature > 0:
        raise ValueError(f"token_logprobs needs a temperature > 0, got {temperature}")
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    mask = trained[:, 1:].to(logits.device)
    if not bool(mask.any()):
        return out + logits.sum().float() * 0.0  # keep the graph (DDP lock-step)
    chosen = logits[:, :-1, :][mask].float()
    if temperature != 1.0:
        chosen = chosen / temperature
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
    lag: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Counter[str]]:
    """The weighted loss sum of one row (every tensor (B, L) or (L,)) and its additive stats.

    ``lag`` (per token, optimizer steps between the weights that sampled the token and the weights
    training it; None: every token fresh) decides which tokens get the engine/learner correction;
    ``sequence_ids`` (per token, the rollout it belongs to within its row; None: one per row) groups the
    tokens of ``sequence_*`` corrections. Stats: ``grpo/tokens``, ``grpo/clipped_tokens`` (the clipped
    branch was taken: no gradient), ``grpo/dual_clipped_tokens``, ``grpo/ratio_sum``, ``grpo/kl_sum``,
    ``grpo/is_tokens`` / ``is_ratio_sum`` / ``is_capped_tokens`` (the correction's tokens, its ratio before
    the cap and how many it capped or masked), ``grpo/lag_sum``, ``grpo/stale_tokens`` and the log-ratio
    histogram.
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
    lag = torch.zeros_like(w) if lag is None else lag.to(device=device, dtype=torch.float32)
    fresh = trained & (lag == 0)
    correct = settings.is_correction != "none"
    # The staleness ratio's denominator: the learner at the sampling weights. For a fresh token under the
    # correction that is the learner now (TRL's ``old_per_token_logps`` with one update per generation); a
    # stale token's learner log-prob at its sampling weights is not kept, so the engine's stands in.
    old = torch.where(fresh, logprobs.detach(), b) if correct else b
    log_ratio = torch.where(trained, (logprobs - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - settings.clip_eps, 1.0 + settings.high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    dual = (adv < 0) & (surrogate < settings.max_ratio * adv)
    surrogate = torch.where(dual, settings.max_ratio * adv, surrogate)
    is_weight, is_ratio = _engine_correction(logprobs.detach() - b, fresh, settings, sequence_ids)
    per_token = -surrogate * is_weight
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
        corrected = fresh if correct else torch.zeros_like(fresh)
        stats["grpo/tokens"] = float(trained.sum())
        stats["grpo/clipped_tokens"] = float((took_clip & trained).sum())
        stats["grpo/dual_clipped_tokens"] = float((dual & trained).sum())
        stats["grpo/ratio_sum"] = float(ratio[trained].sum())
        stats["grpo/kl_sum"] = float(kl[trained].sum())
        stats["grpo/lag_sum"] = float(lag[trained].sum())
        stats["grpo/stale_tokens"] = float((trained & ~fresh).sum())
        stats["grpo/is_tokens"] = float(corrected.sum())
        stats["grpo/is_ratio_sum"] = float(is_ratio[corrected].sum())
        stats["grpo/is_capped_tokens"] = float((corrected & (is_ratio > settings.is_cap)).sum())
        edges = torch.tensor(LOG_RATIO_EDGES, dtype=torch.float32, device=device)
        bins = torch.bucketize(log_ratio[trained].detach(), edges)
        for index, count in zip(*torch.unique(bins, return_counts=True), strict=True):
            stats[f"{HIST_PREFIX}{int(index):02d}"] = float(count)
    return loss_sum, stats


def _engine_correction(
    log_gap: torch.Tensor, fresh: torch.Tensor, settings: GrpoSettings, sequence_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, ratio)`` per token of the engine/learner correction (TRL's
    ``vllm_importance_sampling_correction``): ``ratio = exp(learner - engine log-prob)`` of each fresh token
    (``token_*``) or of its whole rollout (``sequence_*``: the product over the rollout's fresh tokens);
    ``*_truncate`` weighs the token by ``min(ratio, is_cap)``, ``*_mask`` by ``ratio``, or 0 above the cap.
    Other tokens weigh 1. No gradient flows through the weight."""
    ones = torch.ones_like(log_gap)
    mode = settings.is_correction
    if mode == "none":
        return ones, ones
    gap = torch.where(fresh, log_gap, 0.0)
    if mode.startswith("sequence"):
        gap = _sequence_sums(gap, sequence_ids)
    ratio = torch.exp(gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode.endswith("truncate"):
        weight = ratio.clamp(max=settings.is_cap)
    else:
        weight = torch.where(ratio > settings.is_cap, 0.0, ratio)
    return torch.where(fresh, weight, ones), ratio


def _sequence_sums(values: torch.Tensor, sequence_ids: torch.Tensor | None) -> torch.Tensor:
    """Each token's value replaced by the sum over its rollout (same row, same ``sequence_ids``)."""
    rows = values.reshape(-1, values.shape[-1])
    if sequence_ids is None:
        return rows.sum(-1, keepdim=True).expand_as(rows).reshape(values.shape)
    ids = sequence_ids.to(device=values.device).reshape(rows.shape).long()
    width = int(ids.max()) + 1 if ids.numel() else 1
    flat = ids + torch.arange(rows.shape[0], device=values.device)[:, None] * width
    sums = torch.zeros(rows.shape[0] * width, dtype=values.dtype, device=values.device)
    sums.index_add_(0, flat.reshape(-1), rows.reshape(-1))
    return sums[flat].reshape(values.shape)


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
    model: torch.nn.Module, request: RolloutRequest, token_ids: Sequence[int], temperature: float = 1.0
) -> list[float]:
    """The learner's log-probs of ``token_ids`` after ``request``'s prompt at ``temperature``: one packed
    segment through the training forward, as a GRPO row is trained (checks engines and weight sync
    against the learner)."""
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
    values = token_logprobs(logits, batch["input_ids"], batch["weights"] != 0, temperature)[0]
    return values[len(request.prompt_token_ids) :].tolist()
