"""TRL's names of GRPO settings, accepted where their meaning is rollmatch's.

Owns :data:`TRL_NAMES` (TRL ``GRPOConfig`` name under ``loss.grpo`` -> rollmatch key) and
:func:`translate_trl_names`, which runs on one raw YAML layer before layers merge, like
:mod:`rollmatch.config.legacy`. Both spellings in one layer are a problem (one would silently win);
across layers the later layer wins, as for any key. Leaves out: TRL options rollmatch does not have
(unknown keys stay errors).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from rollmatch.config.schema import ROLLOUT_KEY
from rollmatch.errors import ConfigProblem

TRL_NAMES: dict[str, str] = {
    "loss.grpo.num_generations": f"{ROLLOUT_KEY}.rollouts_per_record",
    "loss.grpo.beta": "loss.grpo.kl_coef",
    "loss.grpo.epsilon": "loss.grpo.clip_eps",
    "loss.grpo.epsilon_high": "loss.grpo.clip_eps_high",
    "loss.grpo.delta": "loss.grpo.max_ratio",
    "loss.grpo.vllm_importance_sampling_mode": "loss.grpo.is_correction",
    "loss.grpo.vllm_importance_sampling_clip_max": "loss.grpo.is_cap",
}


def translate_trl_names(layer: Mapping[str, Any], source: str) -> tuple[dict[str, Any], list[ConfigProblem]]:
    """Move every TRL-named key of ``layer`` to its rollmatch key; a layer that sets both is a problem."""
    data: dict[str, Any] = copy.deepcopy(dict(layer))
    problems: list[ConfigProblem] = []
    for trl, ours in TRL_NAMES.items():
        found, value = _pop(data, trl.split("."))
        if not found:
            continue
        if _get(data, ours.split("."))[0]:
            problems.append(
                ConfigProblem(
                    trl,
                    value,
                    f"is TRL's name of `{ours}`, which {source} also sets; keep only one of them",
                )
            )
            continue
        node = data
        *parents, leaf = ours.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data, problems


def _get(data: Mapping[str, Any], parts: list[str]) -> tuple[bool, Any]:
    node: Any = data
    for part in parts:
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _pop(data: dict[str, Any], parts: list[str]) -> tuple[bool, Any]:
    found, parent = _get(data, parts[:-1])
    if not found or not isinstance(parent, dict) or parts[-1] not in parent:
        return False, None
    return True, parent.pop(parts[-1])
