"""Every script under bench/ runs in its smallest setting and prints the JSON object its docs describe.

A bench is a ``bench/*.py`` file with a ``__main__`` block (``bench/server_process.py`` is a helper the
benches share). Each declares its smallest setting next to its code, at module level (docs/runbook.md,
"Benchmarks"):

- ``SMOKE_ARGS``: the command line (a string, split like a shell does) of a run of a few seconds
  (``{tmp}`` stands for a folder the benches of one test run share);
- ``SMOKE_KEYS``: top-level keys the printed JSON object must hold;
- ``SMOKE_AFTER`` (optional): benches whose smoke run must come first (their outputs under ``{tmp}``
  are its inputs).

The declarations are read with ``ast`` (a bench's imports are heavy), and each bench runs as a
subprocess the way a user runs it: exit status 0, stdout exactly one JSON object.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
# One bench's subprocess, and one test (compare_studies runs learning_signal first). The slowest smallest
# setting, learning_signal.py, is ~80 CPU seconds; a shared 2-core machine stretched it to 13 minutes.
SMOKE_TIMEOUT_S = 1200


# Scripts with a ``__main__`` block that other benches run as processes, not benches themselves.
HELPER_SCRIPTS = frozenset({"health_prober"})  # server_hammer.py's /health/ prober


def bench_names() -> list[str]:
    return sorted(
        p.stem
        for p in BENCH.glob("*.py")
        if 'if __name__ == "__main__":' in p.read_text() and p.stem not in HELPER_SCRIPTS
    )


def smoke_declarations(name: str) -> dict[str, Any]:
    """The module-level ``SMOKE_*`` constants of ``bench/<name>.py`` (literals only)."""
    found: dict[str, Any] = {}
    for node in ast.parse((BENCH / f"{name}.py").read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id.startswith("SMOKE_"):
            found[target.id] = ast.literal_eval(node.value)
    return found


@pytest.mark.parametrize("name", bench_names())
def test_every_bench_declares_its_smallest_setting(name: str) -> None:
    declared = smoke_declarations(name)
    missing = {"SMOKE_ARGS", "SMOKE_KEYS"} - set(declared)
    assert not missing, (
        f"bench/{name}.py declares no {sorted(missing)}: add module-level SMOKE_ARGS (the command line of a "
        "run of a few seconds) and SMOKE_KEYS (top-level keys of its JSON), see docs/runbook.md 'Benchmarks'"
    )
    assert isinstance(declared["SMOKE_ARGS"], str), f"bench/{name}.py: SMOKE_ARGS is one command-line string"
    assert declared["SMOKE_KEYS"] and all(isinstance(k, str) for k in declared["SMOKE_KEYS"]), name
    assert set(declared.get("SMOKE_AFTER", [])) <= set(bench_names()), f"{name}: SMOKE_AFTER names no bench"


class SmokeRuns:
    """Runs each bench once per session (``SMOKE_AFTER`` first) and keeps what it printed."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str) -> dict[str, Any]:
        if name not in self.results:
            declared = smoke_declarations(name)
            for before in declared.get("SMOKE_AFTER", []):
                self.run(before)
            args = shlex.split(declared["SMOKE_ARGS"].replace("{tmp}", str(self.tmp)))
            workdir = self.tmp / f"cwd_{name}"  # a bench's default outputs land here, never in the repo
            workdir.mkdir(exist_ok=True)  # a run cut short before (a timeout) left it
            command = [sys.executable, str(BENCH / f"{name}.py"), *args]
            done = subprocess.run(
                command, cwd=workdir, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=os.environ
            )
            assert done.returncode == 0, (
                f"bench/{name}.py {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}"
            )
            try:
                printed = json.loads(done.stdout)
            except json.JSONDecodeError as exc:
                raise AssertionError(
                    f"bench/{name}.py must print exactly one JSON object on stdout ({exc}):\n{done.stdout[-2000:]}"
                ) from exc
            assert isinstance(printed, dict), (
                f"bench/{name}.py printed {type(printed).__name__}, not an object"
            )
            self.results[name] = printed
        return self.results[name]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> SmokeRuns:
    return SmokeRuns(tmp_path_factory.mktemp("bench_smoke"))


@pytest.mark.bench
@pytest.mark.timeout(2 * SMOKE_TIMEOUT_S)  # over the suite's 300 s: a bench is a whole program
@pytest.mark.parametrize("name", bench_names())
def test_bench_runs_in_its_smallest_setting(name: str, smoke_runs: SmokeRuns) -> None:
    printed = smoke_runs.run(name)
    keys = smoke_declarations(name)["SMOKE_KEYS"]
    assert set(keys) <= set(printed), f"bench/{name}.py printed no {sorted(set(keys) - set(printed))}"
