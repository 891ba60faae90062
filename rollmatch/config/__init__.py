"""The run configuration: typed schema, YAML loading (``extends:``, overrides) and fail-fast rules.

``load_config(path, overrides)`` is the one way a run reads its config; it raises one
:class:`~rollmatch.errors.ConfigError` listing every problem. Once the launch is known the run is
resolved once (``config.resolved.resolve_run(cfg, world_size=..., device_count=...,
device_type=...)``: runtime rules checked, ``auto`` values resolved) and builders take that.
"""

from rollmatch.config.load import config_to_json, config_to_yaml, load_config, load_config_dict
from rollmatch.config.resolved import ResolvedRun, resolve_run
from rollmatch.config.rules import (
    check_config,
    check_runtime,
    resolve_servers,
    resolve_sync_mode,
    validate_runtime,
)
from rollmatch.config.schema import RollmatchConfig

__all__ = [
    "ResolvedRun",
    "RollmatchConfig",
    "check_config",
    "check_runtime",
    "config_to_json",
    "config_to_yaml",
    "load_config",
    "load_config_dict",
    "resolve_run",
    "resolve_servers",
    "resolve_sync_mode",
    "validate_runtime",
]
