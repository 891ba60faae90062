"""Every config in configs/ resolves to the JSON recorded before the config's user-facing spellings
(the top-level ``rollout:`` section, one rollout decode batch) were added: the new spellings change
what a user may write, never what a shipped config runs.

``golden/resolved_configs.json`` holds, per config file, what ``rollmatch check-config --json`` printed
for one process at that commit (the config with every default, plus its ``resolved`` values), with the
repository's path written ``<repo>``. Since then one key went and two values came, and
:func:`as_recorded` maps them back: ``stage2_ab.channel_b.rollout_decode_batch_size`` (Channel-B's
records per rollout call) became ``custom.extra.rollout_matching.decode_batch_size`` (null: each
variant's former batch) and ``resolved.rollout_decode_batch_size`` holds the batch in force, which
must be what the old key gave under ``stage2_ab_training`` and a micro-batch (null) under the others.
``check-config`` resolved every config for one process then; it now resolves a server-mode rollout
config for the learner world size its ``launch:`` section gives (what ``train`` runs with under
``rollmatch launch``), so ``world_size`` and the gradient accumulation steps derived from it are
checked against that world size, and every other value against the record. Sections added since
(``loss.noise_objects``, ``eval.noise_label``, ``launch.restart_backoff_s``,
``stage2_ab.channel_b.async.actor_stop_timeout_s``) must hold their defaults in every shipped config
and are left out of the comparison.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollmatch.config.launch_rules import launch_world_size
from rollmatch.config.load import load_config, resolved_json
from rollmatch.config.schema import NoiseObjectsConfig

REPO = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((Path(__file__).parent / "golden" / "resolved_configs.json").read_text(encoding="utf-8"))


def current_json(path: str) -> dict[str, Any]:
    text = json.dumps(resolved_json(load_config(REPO / path)), sort_keys=True)
    return json.loads(text.replace(str(REPO), "<repo>"))


def as_recorded(path: str, current: dict[str, Any]) -> dict[str, Any]:
    """``current`` in the recorded shape: the decode batch back under Channel-B (see the module docstring)."""
    old = json.loads(json.dumps(current))
    assert old["loss"].pop("noise_objects") == NoiseObjectsConfig().model_dump(mode="json")
    assert old["eval"].pop("noise_label") is None
    assert old["launch"].pop("restart_backoff_s") == 1.0
    assert old["stage2_ab"]["channel_b"]["async"].pop("actor_stop_timeout_s") == 10.0
    rollout = old["custom"]["extra"]["rollout_matching"]
    assert rollout.pop("decode_batch_size") is None  # no shipped config sets it: each variant's default
    cfg = load_config(REPO / path)
    world_size = launch_world_size(cfg) or 1
    assert old["resolved"]["world_size"] == world_size
    assert old["resolved"]["gradient_accumulation_steps"] == cfg.training.gradient_accumulation(world_size)
    old["resolved"]["world_size"] = 1
    old["resolved"]["gradient_accumulation_steps"] = cfg.training.gradient_accumulation(1)
    assert old["resolved"].pop("resume_from") is None  # recorded without it (no output_dir exists here)
    batch = old["resolved"].pop("rollout_decode_batch_size")
    if old["custom"]["trainer_variant"] == "stage2_ab_training":
        old["stage2_ab"]["channel_b"]["rollout_decode_batch_size"] = batch
    else:
        assert batch is None  # one rollout call per micro-batch, as before
        old["stage2_ab"]["channel_b"]["rollout_decode_batch_size"] = 2  # the old key's default, unread
    return old


def test_the_golden_covers_every_shipped_config() -> None:
    shipped = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml"))
    assert shipped == sorted(GOLDEN)


@pytest.mark.parametrize("path", sorted(GOLDEN))
def test_a_shipped_config_resolves_as_recorded(path: str) -> None:
    assert as_recorded(path, current_json(path)) == GOLDEN[path]
