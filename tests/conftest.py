"""Shared fixtures: tiny real models built offline once per session (see rollmatch.models.tiny).

- ``tiny_model_dir``: a tiny Qwen2.5-VL checkpoint directory (the default model of the tests).
- ``tiny_model_dirs``: ``{family: dir}`` for qwen2_vl, qwen2_5_vl and qwen3_vl.
- ``tiny_tokenizer``: the tokenizer loaded from ``tiny_model_dir``.
- ``coord_model_dir``: the default family with the coordinate tokens added (``add-coord-tokens``).
- ``loaded_tiny``: ``(model, processor)`` of ``tiny_model_dir``; float32, sdpa, eval mode. Shared by
  the session: a test that changes weights or modes must restore them (or load its own copy).
- ``free_port``: a function returning a currently free TCP port on 127.0.0.1.

Tiers (``make test`` runs both): a test is marked ``integration`` when it starts several processes or
a vLLM engine (see :func:`pytest_collection_modifyitems`; modules whose helpers do set ``pytestmark``).
Every other test is the unit tier. Both run under pytest-xdist (``-n 2``): each worker has its own
session, so session fixtures (tiny models, in-process engines, shared servers) are built per worker,
ports come from ``free_port`` and files go under ``tmp_path``. In the integration tier
(``--dist loadgroup``) the tests of a module with a module-scoped fixture (a server, an engine, a
trained run that several tests read) share an ``xdist_group``, so that fixture starts once; the
integration tests whose wall-clock bounds assume no other integration test beside them are marked
``serial`` (:data:`SERIAL`): `make test` runs them one at a time on one worker while the other runs
the unit tier, then the rest of the integration tier on both.
"""

from __future__ import annotations

import inspect
import os

# One OpenMP thread per test process unless the caller sets it: the tiny models gain nothing from a
# second thread on an idle machine (tests/training: 147 s either way), and beside any other job two
# spinning threads per process slow a test several times over (the image-use test: 126 s against 27 s
# next to a 2-thread training run). Subprocesses inherit it; the CPU launch plan sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from local_ports import free_tcp_port

import rollmatch  # noqa: F401  (applies the environment workarounds before transformers loads)

DEFAULT_FAMILY = "qwen2_5_vl"
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # rollmatch.models.tiny.FAMILIES (a test checks)


class _TinyModels:
    """Builds each family on first use only, so a run that needs the default family builds just that."""

    def __init__(self, root: Path):
        self.root = root
        self.dirs: dict[str, Path] = {}

    def get(self, family: str) -> Path:
        if family not in self.dirs:
            # Imported here so pure tests (detection, config) do not pay for torch + transformers.
            from rollmatch.models.tiny import build_tiny_model

            self.dirs[family] = build_tiny_model(family, self.root / family, seed=0)  # type: ignore[arg-type]
        return self.dirs[family]


@pytest.fixture(scope="session")
def _tiny_models(tmp_path_factory: pytest.TempPathFactory) -> _TinyModels:
    return _TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_model_dir(_tiny_models: _TinyModels) -> Path:
    return _tiny_models.get(DEFAULT_FAMILY)


@pytest.fixture(scope="session")
def coord_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL with the 1,000 coordinate tokens (``custom.object_format: coord_tokens``)."""
    from rollmatch.models.tiny import TinySize, build_tiny_model

    return build_tiny_model(
        DEFAULT_FAMILY, tmp_path_factory.mktemp("coord_model"), seed=0, size=TinySize(), coord_tokens=True
    )


@pytest.fixture(scope="session")
def tiny_model_dirs(_tiny_models: _TinyModels) -> dict[str, Path]:
    return {family: _tiny_models.get(family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def loaded_tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval(), AutoProcessor.from_pretrained(tiny_model_dir)


# Fixtures that start real server processes or engines: their tests are the integration tier.
INTEGRATION_FIXTURES = frozenset(
    {"hf_server", "hf_sync_server", "start_server", "shared_vllm_engine", "start_launch", "launch_config"}
)
# What in a test function's own source means it starts several processes (torchrun ranks, forked
# ranks, launcher supervision, stand-in servers) or a vLLM engine (colocated, or in a CLI subprocess);
# a lone CLI subprocess does not count. Modules whose helpers start them set ``pytestmark`` themselves.
INTEGRATION_SOURCE = (
    "torchrun",
    "start_launch",
    "run_plan(",
    "start_child(",
    "launch_server(",
    "subprocess.Popen(",
    "run_forked_ranks(",
    "VllmEngine",
    "vllm_engine",
    'find_spec("vllm")',
    'importorskip("vllm")',
    '"rollout_backend": "vllm"',
)


# Integration tests with a wall-clock bound that assumes no other integration test beside it (a reply or a
# refusal within a few seconds, a detection within a timeout plus seconds, a cost compared with another
# call's): the serial sub-tier (``-m serial``). They share one ``xdist_group``, so one worker runs them
# one at a time; `make test` runs them beside the unit tier (one worker each: a unit test is one
# in-process job, milder than the busy loops `make test-stress` runs them beside), never beside
# another integration test.
SERIAL = (
    "tests/launch/test_launch_cpu.py::test_killing_one_nodes_launcher_stops_the_other_naming_the_lost_node",
    "tests/launch/test_orphans.py::",
    "tests/launch/test_processes.py::",
    "tests/reliability/test_hung_rank.py::",
    "tests/server/test_attack_bodies.py::",
    "tests/server/test_attack_connections.py::",
    "tests/server/test_attack_framing.py::",
    "tests/server/test_attack_images.py::",
    "tests/server/test_client.py::",
    "tests/server/test_concurrency.py::",
    "tests/server/test_connections.py::",
    "tests/server/test_faults.py::",
    "tests/server/test_fuzz.py::",
    "tests/server/test_image_wire.py::",
    "tests/server/test_infer_path.py::",
    "tests/server/test_media_safety.py::",
    "tests/server/test_request_boundary.py::",
    "tests/server/test_server_hammer.py::",
    "tests/server/test_template_safety.py::",
    "tests/server/test_vllm_server.py::test_vllm_weight_pushes_under_load_are_fair_and_every_answer_has_the_right_version",
)


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)


def _starts_processes(item: pytest.Item) -> bool:
    """Whether the test function's own source names one of :data:`INTEGRATION_SOURCE` (read once per
    function: parametrised items share it, and reading source is most of the collection's time)."""
    function = getattr(item, "function", None)
    if function is None:
        return False
    if function not in _STARTS_PROCESSES:
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            source = ""
        _STARTS_PROCESSES[function] = any(token in source for token in INTEGRATION_SOURCE)
    return _STARTS_PROCESSES[function]


_STARTS_PROCESSES: dict[Callable[..., Any], bool] = {}


# tryfirst: pytest-xdist's worker reads the xdist_group marks in its own hook of this name, which ran
# before this one (the root conftest is registered first): the marks came too late to group anything.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the integration tier (``-m integration``): tests that use a server/engine fixture or whose
    own source starts several processes or a vLLM engine (see above); in it, the serial sub-tier
    (:data:`SERIAL`) and the ``xdist_group`` of each module with a module-scoped fixture."""
    for item in items:
        if INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())) or _starts_processes(item):
            item.add_marker(pytest.mark.integration)
        if not item.get_closest_marker("integration"):
            continue
        if item.nodeid.startswith(SERIAL):  # one worker takes them all, one at a time (see SERIAL)
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.xdist_group("serial"))
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


class _XdistGroupCheck:
    """Refuses a run in which ``--dist loadgroup`` would split an ``xdist_group`` over workers: pytest-xdist
    marks a group by appending it to each test's id, which pytest 9.2 ignores (so the serial sub-tier ran
    beside other tests and each module's shared servers started on both workers; pyproject pins below)."""

    @pytest.hookimpl(trylast=True)  # after pytest-xdist's worker hook
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
                raise pytest.UsageError(
                    f"pytest {pytest.__version__} dropped the xdist_group of {item.nodeid}: --dist loadgroup "
                    "would spread the group over workers. Install the pytest pyproject.toml pins (make venv)."
                )


def pytest_configure(config: pytest.Config) -> None:
    # The controller says why at once (a worker's refusal below reaches it only as a crashed worker).
    if config.getoption("dist", "no") == "loadgroup" and tuple(
        map(int, pytest.__version__.split(".")[:2])
    ) >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} drops pytest-xdist's xdist_group: --dist loadgroup would spread the "
            "serial sub-tier and each module's shared servers over workers. Install the pins (make venv)."
        )
    config.pluginmanager.register(_XdistGroupCheck(), "rollmatch-xdist-group-check")


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for each port needed: ``port = free_port()``."""
    return free_tcp_port
