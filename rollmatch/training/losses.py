"""Token-weighted cross-entropy for teacher-forced detection targets.

Owns: the weighted CE *sum* of a batch (:func:`weighted_ce_sum`), per-segment sums of a packed
row (:func:`per_segment_ce`) and the optimizer-step normalisation (:func:`normalize_step_loss`).
Leaves out: where the weights come from (``detection.targets``: prompt 0, prefix
``loss.prefix_weight``, appended tail 1 / ``loss.desc_weight``) and the cross-rank sum of weights
(the trainer, through ``rollmatch.collectives``).

The optimizer-step loss is ``sum(w * ce) / sum(w)`` over all micro-steps and ranks of the step, so
each micro-step contributes its *sum* divided by the step's total weight; packing, gradient
accumulation and world size then leave the gradient unchanged.

The false-positive unlikelihood term (``loss.fp_unlikelihood_weight``) adds ``sum(u * ul)`` with
``ul = -log(1 - p(token))`` to the same sum, and is divided by the same ``sum(w)`` of CE weights: ``u``
is a weight relative to one supervised token, so turning the term on never rescales the CE of the
step (it would if ``u`` joined the denominator), and the sum stays exact under packing.

``weights[..., t]`` weights predicting token ``t`` from the logits at ``t - 1``; position 0 has no
prediction. Only positions with a non-zero weight are gathered before the float32 log-softmax, so
the float32 copy of the logits stays as small as the trained part of the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from rollmatch.errors import PackingError
from rollmatch.training.coord_loss import CoordLoss


def weighted_ce_sum(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    weights: torch.Tensor,
    coord: CoordLoss | None = None,
    unlikelihood: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_t weights[t] * CE(logits[t-1], input_ids[t])`` over ``t >= 1``, in float32.

    With ``unlikelihood`` (shaped like ``weights``) it adds ``sum_t unlikelihood[t] * -log(1 -
    p(input_ids[t]))`` (:func:`unlikelihood_sum`). With ``coord`` (``custom.object_format:
    coord_tokens``) a position whose target is a coordinate token uses the coordinate loss instead of
    CE, plus the optional box geometry term
    (``training.coord_loss``). Shapes: ``logits`` (B, L, V) or (L, V); ``input_ids`` and ``weights``
    (B, L) or (L,). Returns a 0-dim float32 tensor (0 with a graph when no position has weight).
    """
    if logits.dim() == 2:
        logits, input_ids, weights = logits[None], input_ids[None], weights[None]
    if logits.shape[:2] != input_ids.shape or input_ids.shape != weights.shape:
        raise PackingError(
            f"loss shapes disagree: logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)}, "
            f"weights {tuple(weights.shape)}; logits must be (B, L, V) for (B, L) ids and weights"
        )
    total = _ce_sum(logits, input_ids, weights, coord)
    if unlikelihood is not None:
        flags = unlikelihood[None] if unlikelihood.dim() == 1 else unlikelihood
        total = total + unlikelihood_sum(logits, input_ids, flags)
    return total


def unlikelihood_sum(logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_t weights[t] * -log(1 - p(input_ids[t] | logits[t-1]))`` over ``t >= 1``, in float32.

    ``log(1 - p)`` is computed as ``logsumexp`` of the other tokens' logits minus ``logsumexp`` of all,
    exact and with a gradient even where ``p`` rounds to 1. Shapes as in :func:`weighted_ce_sum`.
    """
    if logits.dim() == 2:
        logits, input_ids, weights = logits[None], input_ids[None], weights[None]
    if logits.shape[:2] != input_ids.shape or input_ids.shape != weights.shape:
        raise PackingError(
            f"unlikelihood shapes disagree: logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)}, "
            f"unlikelihood_weights {tuple(weights.shape)}; they must be (B, L, V), (B, L), (B, L)"
        )
    shifted_logits = logits[:, :-1, :]
    target_weights = weights[:, 1:].to(device=logits.device, dtype=torch.float32)
    flagged = target_weights != 0
    if not bool(flagged.any()):
        return shifted_logits.sum().float() * 0.0
    flagged_logits = shifted_logits[flagged].float()
    flagged_targets = input_ids[:, 1:].to(logits.device)[flagged]
    others = flagged_logits.scatter(1, flagged_targets[:, None], float("-inf"))
    log_not_p = torch.logsumexp(others, dim=-1) - torch.logsumexp(flagged_logits, dim=-1)
    return (-log_not_p * target_weights[flagged]).sum()


def _ce_sum(
    logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor, coord: CoordLoss | None
) -> torch.Tensor:
    shifted_logits = logits[:, :-1, :]
    targets = input_ids[:, 1:].to(logits.device)
    target_weights = weights[:, 1:].to(device=logits.device, dtype=torch.float32)
    trained = target_weights != 0
    if not bool(trained.any()):
        # Keep the graph connected so every rank runs the same backward (DDP lock-step).
        return shifted_logits.sum().float() * 0.0
    trained_logits, trained_targets, trained_weights = (
        shifted_logits[trained],
        targets[trained],
        target_weights[trained],
    )
    if coord is None:
        ce = F.cross_entropy(trained_logits.float(), trained_targets, reduction="none")
        return (ce * trained_weights).sum()
    bins = coord.bins_of(trained_targets)
    at_coord = bins >= 0
    total = shifted_logits.sum().float() * 0.0
    if bool((~at_coord).any()):
        ce = F.cross_entropy(trained_logits[~at_coord].float(), trained_targets[~at_coord], reduction="none")
        total = total + (ce * trained_weights[~at_coord]).sum()
    if bool(at_coord.any()):
        losses, p_within = coord.position_losses(trained_logits[at_coord], bins[at_coord])
        total = total + (losses * trained_weights[at_coord]).sum()
        if coord.has_geometry:
            total = total + coord.geometry_sum(p_within, bins[at_coord], trained_weights[at_coord])
    return total


def per_segment_ce(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    weights: torch.Tensor,
    segment_lengths: Sequence[int] | torch.Tensor,
    coord: CoordLoss | None = None,
    unlikelihood: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Weighted CE sum of each segment of one packed row (logits (1, L, V) or (L, V)).

    A segment's first token is never predicted (it would use the previous segment's logits).
    """
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise PackingError(f"per_segment_ce takes one packed row, got batch size {logits.shape[0]}")
        logits, input_ids, weights = logits[0], input_ids[0], weights[0]
        unlikelihood = None if unlikelihood is None else unlikelihood[0]
    lengths = [int(n) for n in segment_lengths]
    if sum(lengths) != input_ids.shape[0]:
        raise PackingError(
            f"segment lengths sum to {sum(lengths)} but the row has {input_ids.shape[0]} tokens; "
            "pass the row's `segment_lengths` from pack_row"
        )
    sums: list[torch.Tensor] = []
    start = 0
    for length in lengths:
        end = start + length
        flags = None if unlikelihood is None else unlikelihood[start:end]
        sums.append(
            weighted_ce_sum(logits[start:end], input_ids[start:end], weights[start:end], coord, flags)
        )
        start = end
    return sums


def normalize_step_loss(ce_sum: torch.Tensor, step_weight_total: float) -> torch.Tensor:
    """A micro-step's contribution to the step loss: its CE sum over the step's total weight.

    ``step_weight_total`` is the summed weight of every micro-step and rank of the optimizer step;
    with DDP (which averages gradients over ranks) multiply the result by the world size.
    """
    if step_weight_total <= 0:
        raise PackingError(
            f"optimizer step has total loss weight {step_weight_total}; a step needs at least one trained "
            "token (check `loss.*` weights and that targets are not empty)"
        )
    return ce_sum / step_weight_total
