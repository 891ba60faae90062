"""Older spellings of config keys: accepted with a warning, or rejected naming the new key.

Owns: the table of moved / removed keys, :func:`translate_legacy`, which runs on one raw YAML
layer (a file, a dict or the overrides) before layers are merged, and
:func:`aliased_section_conflicts`, which refuses a config that sets an aliased section in both
spellings in any of its layers (one would silently override the other), naming every location. Leaves out: unknown keys in general (pydantic
``extra=forbid``, turned into problems by :mod:`rollmatch.config.load`) and cross-field rules
(:mod:`rollmatch.config.rules`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from rollmatch.config.schema import ROLLOUT_KEY
from rollmatch.errors import ConfigProblem

_ROLLOUT = ROLLOUT_KEY

# Old dotted key -> why it is gone and what to set instead. Each hit is a problem (never a silent
# translation): these keys changed meaning or location, and a run must not start on a guess.
REJECTED_KEYS: dict[str, str] = {
    f"{_ROLLOUT}.temperature": f"moved to {_ROLLOUT}.decoding.temperature; set it there",
    f"{_ROLLOUT}.top_p": f"moved to {_ROLLOUT}.decoding.top_p; set it there",
    f"{_ROLLOUT}.top_k": f"moved to {_ROLLOUT}.decoding.top_k; set it there",
    f"{_ROLLOUT}.rollout_buffer": (
        "removed: rollouts are never reused across optimizer steps; for buffered, version-tagged "
        "rollouts use stage2_ab.channel_b.mode: async with stage2_ab.channel_b.async.queue_limit "
        "(rollout server mode); delete this key"
    ),
    "stage2_ab.schedule.pattern": (
        "removed: the A/B schedule is set by stage2_ab.schedule.b_ratio (fraction of optimizer steps "
        "on Channel-B, float in [0, 1]); delete `pattern` and set b_ratio"
    ),
}

# Old location of a section or key -> new location; accepted with a DeprecationWarning. In order: a key
# below a moved section is listed by its new section's path.
ALIASED_SECTIONS: dict[str, str] = {
    "custom.extra.stage2_ab": "stage2_ab",
    # One rollout decode batch for every trainer variant (it was Channel-B's alone).
    "stage2_ab.channel_b.rollout_decode_batch_size": f"{_ROLLOUT}.decode_batch_size",
}


def aliased_section_conflicts(layers: Sequence[tuple[str, Mapping[str, Any]]]) -> list[ConfigProblem]:
    """A problem for each aliased section set in both spellings anywhere in ``layers``.

    ``layers`` are ``(source, raw mapping)`` pairs (files of an ``extends`` chain, a dict, the
    overrides). One spelling would silently override the other when the layers merge, so a config
    may use only one; the problem names every location of both.
    """
    problems: list[ConfigProblem] = []
    for old, new in ALIASED_SECTIONS.items():
        old_in = [source for source, layer in layers if _has_path(layer, old.split("."))]
        new_in = [source for source, layer in layers if _has_path(layer, new.split("."))]
        if old_in and new_in:
            problems.append(
                ConfigProblem(
                    old,
                    f"set in {', '.join(old_in)}",
                    f"both `{old}` (deprecated spelling, in {', '.join(old_in)}) and `{new}` (in "
                    f"{', '.join(new_in)}) are set; keep only `{new}` and move these settings into it",
                )
            )
    return problems


def translate_legacy(layer: Mapping[str, Any], source: str) -> tuple[dict[str, Any], list[ConfigProblem]]:
    """Move aliased sections to their new place and pop rejected keys, reporting each one.

    ``source`` names the layer (a file path, ``<dict>`` or ``<overrides>``) in warnings and
    problems. Returns a translated deep copy; the input is not modified.
    """
    data: dict[str, Any] = copy.deepcopy(dict(layer))
    problems: list[ConfigProblem] = []
    for old, new in ALIASED_SECTIONS.items():
        problems.extend(_move_section(data, old, new, source))
    for key, fix in REJECTED_KEYS.items():
        found, value = _pop_path(data, key.split("."))
        if found:
            problems.append(ConfigProblem(key, value, f"{fix} (in {source})"))
    return data, problems


def _move_section(data: dict[str, Any], old: str, new: str, source: str) -> list[ConfigProblem]:
    found, value = _pop_path(data, old.split("."))
    if not found:
        return []
    new_parts = new.split(".")
    if _has_path(data, new_parts):
        return []  # both spellings: reported once, with every location, by aliased_section_conflicts
    where = f"top-level `{new}`" if "." not in new else f"`{new}`"
    warnings.warn(
        f"{source}: `{old}` is deprecated; move that setting to {where}",
        DeprecationWarning,
        stacklevel=2,
    )
    parent = data
    for part in new_parts[:-1]:
        parent = parent.setdefault(part, {})
    parent[new_parts[-1]] = value
    return []


def _pop_path(data: dict[str, Any], parts: list[str]) -> tuple[bool, Any]:
    """Remove ``parts`` from nested mappings; ``(found, value)``. Non-mapping parents: not found."""
    node: Any = data
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    if not isinstance(node, dict) or parts[-1] not in node:
        return False, None
    value = node.pop(parts[-1])
    return True, value


def _has_path(data: dict[str, Any], parts: list[str]) -> bool:
    node: Any = data
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
