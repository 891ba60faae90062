"""Every performance bench under bench/ runs in its smallest setting and prints the JSON object its docs
describe (the declarations and the runner: tests/smoke_programs.py; the studies': tests/studies).

A bench is a ``bench/*.py`` file with a ``__main__`` block (``bench/server_process.py`` and
``bench/tiny_size_flags.py`` are helpers the benches share), run as a script: ``python bench/<name>.py``.
"""

from __future__ import annotations

import pytest
from smoke_programs import REPO, SMOKE_TIMEOUT_S, ProgramFolder, SmokeRuns

# health_prober.py has a ``__main__`` block: server_hammer.py runs it as its /health/ prober
BENCHES = ProgramFolder(REPO / "bench", as_module=False, helpers=frozenset({"health_prober"}))


@pytest.mark.parametrize("name", BENCHES.names())
def test_every_bench_declares_its_smallest_setting(name: str) -> None:
    BENCHES.check_declarations(name)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> SmokeRuns:
    return SmokeRuns(BENCHES, tmp_path_factory.mktemp("bench_smoke"))


@pytest.mark.bench
@pytest.mark.timeout(2 * SMOKE_TIMEOUT_S)  # over the suite's 300 s: a bench is a whole program
@pytest.mark.parametrize("name", BENCHES.names())
def test_bench_runs_in_its_smallest_setting(name: str, smoke_runs: SmokeRuns) -> None:
    smoke_runs.check(name)
