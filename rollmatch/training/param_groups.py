"""Module groups of a Qwen-VL model (vision tower, merger, language model): freezing and per-group
learning rates (``training.freeze``, ``training.lr_multipliers``).

Owns: :func:`module_group` (a parameter name -> its group), :func:`freeze_groups` and
:func:`optimizer_param_groups` (AdamW parameter groups carrying their own ``lr``; HF's LR schedulers
scale each group's initial ``lr``, so the ratio holds through warmup and decay). Leaves out: which
frozen tensors a weight sync skips (``sync.weights``, from ``requires_grad``).

Names are those of the unwrapped HF model (``model.visual.blocks.0...``, ``model.visual.merger...``,
Qwen3-VL's ``model.visual.deepstack_merger_list...``, ``model.language_model...``, ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from torch import nn

from rollmatch.errors import ConfigError, ConfigProblem

Group = Literal["vision_tower", "merger", "language_model"]
GROUPS: tuple[Group, ...] = ("vision_tower", "merger", "language_model")


def module_group(name: str) -> Group:
    """The group of a parameter: under ``visual.`` a ``merger`` or the ``vision_tower``; else the LM."""
    parts = name.split(".")
    if "visual" not in parts:
        return "language_model"
    tail = parts[parts.index("visual") + 1 :]
    return "merger" if tail and "merger" in tail[0] else "vision_tower"


def freeze_groups(model: nn.Module, groups: Iterable[str]) -> dict[str, int]:
    """Set ``requires_grad=False`` on every parameter of ``groups``; returns parameters frozen per group.

    A group that names no parameter of this model is a :class:`ConfigError` (a typo would silently
    train what the user meant to freeze).
    """
    wanted = set(groups)
    counts = dict.fromkeys(sorted(wanted), 0)
    for name, param in model.named_parameters():
        group = module_group(name)
        if group in wanted:
            param.requires_grad_(False)
            counts[group] += param.numel()
    empty = [group for group, n in counts.items() if n == 0]
    if empty:
        raise ConfigError(
            [
                ConfigProblem(
                    "training.freeze", empty, f"no parameter of {type(model).__name__} is in these groups"
                )
            ]
        )
    return counts


def optimizer_param_groups(
    model: nn.Module,
    *,
    learning_rate: float,
    weight_decay: float,
    multipliers: Mapping[str, float],
    no_decay: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """AdamW parameter groups: one per (module group, decay or not) with ``lr = learning_rate x multiplier``.

    Only parameters with ``requires_grad`` are included; ``no_decay`` names parameters without
    weight decay (HF's ``get_decay_parameter_names`` complement). Each group carries its ``name``.
    """
    skip_decay = set(no_decay)
    buckets: dict[tuple[str, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            buckets.setdefault((module_group(name), name not in skip_decay), []).append(param)
    return [
        {
            "name": f"{group}{'' if decay else '/no_decay'}",
            "params": params,
            "lr": learning_rate * float(multipliers.get(group, 1.0)),
            "weight_decay": weight_decay if decay else 0.0,
        }
        for (group, decay), params in sorted(buckets.items())
    ]
