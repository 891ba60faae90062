"""The import layers of tools/check_layers.py hold on this tree, and the check catches violations."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", REPO / "tools" / "check_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_package_respects_its_layers() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_layers.py")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout


def test_upward_lazy_and_unplaced_imports_are_reported(tmp_path: Path) -> None:
    checker = load_checker()
    package = tmp_path / "rollmatch"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("from rollmatch.models.compat import apply_workarounds\n")
    (package / "data" / "prompts.py").write_text(
        "from rollmatch.detection.objects import DetObject\n"  # below: fine
        "def f():\n    from rollmatch.rollout.types import Rollout\n"  # above, even lazily
    )
    (package / "evaluation.py").write_text("from rollmatch import training\n")
    (package / "newthing.py").write_text("x = 1\n")
    found = {(v.importer, v.imported) for v in checker.check_package(package)}
    assert found == {("data", "rollout"), ("evaluation", "training"), ("newthing", "newthing")}
    messages = [str(v) for v in checker.check_package(package)]
    assert any("prompts.py:3: data (layer 3) imports rollmatch.rollout" in m for m in messages)
    assert any("newthing is in no layer" in m for m in messages)


def test_import_circles_are_reported_even_through_lazy_imports(tmp_path: Path) -> None:
    checker = load_checker()
    package = tmp_path / "rollmatch"
    (package / "detection").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "detection" / "__init__.py").write_text("")
    (package / "detection" / "codec.py").write_text(
        "def build():\n    from rollmatch.detection.coord_tokens import Codec\n"  # lazy: still counts
    )
    (package / "detection" / "coord_tokens.py").write_text("from rollmatch.detection import codec\n")
    (package / "detection" / "objects.py").write_text("from rollmatch.detection.codec import build\n")
    assert checker.find_import_circles(package) == [
        ["rollmatch.detection.codec", "rollmatch.detection.coord_tokens"]
    ]
    (package / "detection" / "codec.py").write_text("x = 1\n")
    assert checker.find_import_circles(package) == []


def test_the_package_has_no_import_circles() -> None:
    checker = load_checker()
    assert checker.find_import_circles(REPO / "rollmatch") == []


def test_the_programs_beside_the_package_import_it_one_way(tmp_path: Path) -> None:
    """studies/ and bench/ import rollmatch, never the reverse; no bench imports a study or a study a
    bench; studies/ has no import circle. The repository holds all of it."""
    checker = load_checker()
    assert checker.check_programs(REPO) == []
    for folder in ("rollmatch", "studies", "bench"):
        (tmp_path / folder).mkdir()
    (tmp_path / "rollmatch" / "evaluation.py").write_text("def f():\n    from studies import stats\n")
    (tmp_path / "bench" / "packing.py").write_text("import rollmatch\nfrom studies.stats import f1_of\n")
    (tmp_path / "bench" / "server_process.py").write_text("from tiny_size_flags import add_size_flags\n")
    (tmp_path / "studies" / "__init__.py").write_text("import rollmatch\n")
    (tmp_path / "studies" / "driver.py").write_text("from studies import units\nimport bench.packing\n")
    (tmp_path / "studies" / "units.py").write_text("from studies.driver import run\n")
    found = checker.check_programs(tmp_path)
    where = sorted(line.split(": ")[0].removeprefix(str(tmp_path) + "/") for line in found)
    assert where == [
        "bench/packing.py:2",
        "import circle",
        "rollmatch/evaluation.py:2",
        "studies/driver.py:2",
    ]
    assert any("rollmatch imports studies; rollmatch may not import studies, bench" in line for line in found)
    assert any("bench imports studies" in line for line in found)
    assert any("studies imports bench" in line for line in found)
    assert "import circle: studies.driver <-> studies.units; move the shared piece" in found[-1]


def test_wire_models_importing_the_client_side_is_an_upward_arrow(tmp_path: Path) -> None:
    """``protocol/`` sits below both of its users (the client in ``rollout/``, the server): a wire model
    that reaches into ``rollout/`` (as ``protocol/infer.py`` once did for ``Decoding``) is reported."""
    checker = load_checker()
    package = tmp_path / "rollmatch"
    (package / "protocol").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "protocol" / "infer.py").write_text(
        "from rollmatch.config.decoding import Decoding\n"  # below: fine
        "from rollmatch.rollout.types import Rollout\n"  # the client's layer: above
    )
    (package / "protocol" / "sync.py").write_text("from rollmatch.sync.weights import TensorMeta\n")
    found = {(v.importer, v.imported) for v in checker.check_package(package)}
    assert found == {("protocol", "rollout"), ("protocol", "sync")}
