"""Every study driver under studies/ runs in its smallest setting, ``python -m studies.<name>`` from the
repository root, and prints the JSON object its docs describe (declarations and runner:
tests/smoke_programs.py). ``make bench-smoke`` runs these with the benches (marker ``bench``).
"""

from __future__ import annotations

import pytest
from smoke_programs import REPO, SMOKE_TIMEOUT_S, ProgramFolder, SmokeRuns

STUDIES = ProgramFolder(REPO / "studies", as_module=True)


@pytest.mark.parametrize("name", STUDIES.names())
def test_every_study_declares_its_smallest_setting(name: str) -> None:
    STUDIES.check_declarations(name)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> SmokeRuns:
    return SmokeRuns(STUDIES, tmp_path_factory.mktemp("study_smoke"))


@pytest.mark.bench
@pytest.mark.timeout(2 * SMOKE_TIMEOUT_S)  # over the suite's 300 s: a study is a whole program
@pytest.mark.parametrize("name", STUDIES.names())
def test_study_runs_in_its_smallest_setting(name: str, smoke_runs: SmokeRuns) -> None:
    smoke_runs.check(name)
