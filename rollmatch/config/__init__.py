"""The run configuration: typed schema, YAML loading (``extends:``, overrides) and fail-fast rules.

``load_config(path, overrides)`` is the one way a run reads its config (keys and values checked); it
raises one :class:`~rollmatch.errors.ConfigError` listing every problem. ``resolve_run(cfg,
world_size=..., device_count=..., device_type=...)`` is the one way to a run: every rule checked,
static and runtime, ``auto`` values resolved; ``check-config`` and ``train`` both take it and
builders take the :class:`ResolvedRun`. A config may spell ``custom.extra.rollout_matching`` as a
top-level ``rollout:`` section (``config.spelling``).
"""

from rollmatch.config.load import config_to_json, config_to_yaml, load_config, load_config_dict
from rollmatch.config.resolved import ResolvedRun, resolve_run
from rollmatch.config.rollout_rules import resolve_sync_mode
from rollmatch.config.rules import check_config, check_run, check_runtime
from rollmatch.config.schema import RollmatchConfig
from rollmatch.config.server_rules import resolve_servers

__all__ = [
    "ResolvedRun",
    "RollmatchConfig",
    "check_config",
    "check_run",
    "check_runtime",
    "config_to_json",
    "config_to_yaml",
    "load_config",
    "load_config_dict",
    "resolve_run",
    "resolve_servers",
    "resolve_sync_mode",
]
