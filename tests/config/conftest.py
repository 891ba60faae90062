"""Fixtures for config tests: collect the problems of an invalid config (``Problems``), write YAML files.

A config's problems are what the one door to a run reports (``config.resolved.resolve_run``: keys,
values and every rule) for one process on a GPU machine (8 devices: the engine rules of a CPU run
have their own tests); the checkpoint is not required (``model.path`` need not exist), so
``data.coord_frame: auto`` is left unresolved."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from resolved_runs import resolve_for

from rollmatch.config.load import load_config_dict
from rollmatch.errors import ConfigError, ConfigProblem


class Problems(list[ConfigProblem]):
    """The problems of one ConfigError, with lookup by dotted key."""

    def only(self, key: str) -> ConfigProblem:
        """The single problem reported for ``key``."""
        hits = [p for p in self if p.key == key]
        assert len(hits) == 1, f"expected one problem for {key}, got {list(self)}"
        return hits[0]

    def keys(self) -> list[str]:
        return [p.key for p in self]


ProblemsOf = Callable[..., Problems]


@pytest.fixture
def problems_of() -> ProblemsOf:
    """``problems_of(data, overrides=())``: every problem of an invalid config (fails if it loads)."""

    def collect(data: dict[str, Any], overrides: Sequence[str] = ()) -> Problems:
        with pytest.raises(ConfigError) as info:
            resolve_for(load_config_dict(data, overrides), gpus=8)
        assert info.value.problems, "a ConfigError must carry at least one problem"
        return Problems(info.value.problems)

    return collect


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[str, Any], Path]:
    """``write_yaml("sub/name.yaml", mapping_or_text)`` -> the path written under tmp_path."""

    def write(name: str, content: Any) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content), encoding="utf-8")
        return path

    return write
