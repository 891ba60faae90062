"""Fixtures of the data tests.

- ``shapes_jsonl``: a small synthetic shapes set (16 train / 4 val images at 224 px), built once per
  session; ``{"train": path, "val": path}`` of its JSONL files.
- ``real_data_dir``: the real detection datasets beside the repository (``../shared/data``); tests
  that need it are skipped, with the path in the reason, when that folder is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollmatch.data.shapes import generate_shapes

REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_DATA = REPO_ROOT / ".." / "shared" / "data"


@pytest.fixture(scope="session")
def shapes_jsonl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=16, n_val=4, size=224, seed=0)


@pytest.fixture(scope="session")
def real_data_dir() -> Path:
    if not REAL_DATA.is_dir():
        pytest.skip(f"real detection data not found at {REAL_DATA.resolve()} (expected ../shared/data)")
    return REAL_DATA.resolve()
