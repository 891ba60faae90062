"""Smoke runs of the repository's programs: the benches (``bench/*.py``, run as scripts) and the studies
(``studies/*.py``, run as ``python -m studies.<name>``), each in its smallest setting.

A program is a file with a ``__main__`` block. Each declares its smallest setting next to its code, at
module level (docs/runbook.md, "Benchmarks"):

- ``SMOKE_ARGS``: the command line (a string, split like a shell does) of a run of a few seconds
  (``{tmp}`` stands for a folder the programs of one test module share);
- ``SMOKE_KEYS``: top-level keys the printed JSON object must hold;
- ``SMOKE_AFTER`` (optional): programs of the same folder whose smoke run must come first (their
  outputs under ``{tmp}`` are its inputs).

The declarations are read with ``ast`` (a program's imports are heavy), and each program runs as a
subprocess the way a user runs it: exit status 0, stdout exactly one JSON object. Used by
tests/test_benches.py and tests/studies/test_study_smoke.py.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# One program's subprocess, and one test (compare_studies runs learning_signal first). The slowest smallest
# setting, studies/learning_signal.py, is ~80 CPU seconds; a shared 2-core machine stretched it to 13 minutes.
SMOKE_TIMEOUT_S = 1200


@dataclass(frozen=True)
class ProgramFolder:
    """One folder of programs and how a user runs one of them."""

    folder: Path
    as_module: bool  # ``python -m <package>.<name>`` from the repository root, else ``python <path>``
    helpers: frozenset[str] = frozenset()  # scripts with a ``__main__`` block that are not programs

    def names(self) -> list[str]:
        return sorted(
            p.stem
            for p in self.folder.glob("*.py")
            if 'if __name__ == "__main__":' in p.read_text() and p.stem not in self.helpers
        )

    def label(self, name: str) -> str:
        return f"{self.folder.name}/{name}.py"

    def command(self, name: str) -> list[str]:
        if self.as_module:
            return [sys.executable, "-m", f"{self.folder.name}.{name}"]
        return [sys.executable, str(self.folder / f"{name}.py")]

    def declarations(self, name: str) -> dict[str, Any]:
        """The module-level ``SMOKE_*`` constants of the program (literals only)."""
        found: dict[str, Any] = {}
        for node in ast.parse((self.folder / f"{name}.py").read_text()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(target, ast.Name) and target.id.startswith("SMOKE_"):
                found[target.id] = ast.literal_eval(node.value)
        return found

    def check_declarations(self, name: str) -> None:
        declared = self.declarations(name)
        label = self.label(name)
        missing = {"SMOKE_ARGS", "SMOKE_KEYS"} - set(declared)
        assert not missing, (
            f"{label} declares no {sorted(missing)}: add module-level SMOKE_ARGS (the command line of a "
            "run of a few seconds) and SMOKE_KEYS (top-level keys of its JSON), see docs/runbook.md 'Benchmarks'"
        )
        assert isinstance(declared["SMOKE_ARGS"], str), f"{label}: SMOKE_ARGS is one command-line string"
        assert declared["SMOKE_KEYS"] and all(isinstance(k, str) for k in declared["SMOKE_KEYS"]), label
        assert set(declared.get("SMOKE_AFTER", [])) <= set(self.names()), f"{label}: SMOKE_AFTER names none"


class SmokeRuns:
    """Runs each program of one folder once per test module (``SMOKE_AFTER`` first) and keeps its JSON."""

    def __init__(self, programs: ProgramFolder, tmp: Path):
        self.programs = programs
        self.tmp = tmp
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str) -> dict[str, Any]:
        if name not in self.results:
            declared = self.programs.declarations(name)
            for before in declared.get("SMOKE_AFTER", []):
                self.run(before)
            args = shlex.split(declared["SMOKE_ARGS"].replace("{tmp}", str(self.tmp)))
            workdir = self.tmp / f"cwd_{name}"  # a program's default outputs land here, never in the repo
            workdir.mkdir(exist_ok=True)  # a run cut short before (a timeout) left it
            # the repository root on the path, as when a user runs ``python -m studies.<name>`` from it
            path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
            label = self.programs.label(name)
            done = subprocess.run(
                [*self.programs.command(name), *args],
                cwd=workdir,
                capture_output=True,
                text=True,
                timeout=SMOKE_TIMEOUT_S,
                env={**os.environ, "PYTHONPATH": path},
            )
            assert done.returncode == 0, (
                f"{label} {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}"
            )
            try:
                printed = json.loads(done.stdout)
            except json.JSONDecodeError as exc:
                raise AssertionError(
                    f"{label} must print exactly one JSON object on stdout ({exc}):\n{done.stdout[-2000:]}"
                ) from exc
            assert isinstance(printed, dict), f"{label} printed {type(printed).__name__}, not an object"
            self.results[name] = printed
        return self.results[name]

    def check(self, name: str) -> None:
        printed = self.run(name)
        keys = self.programs.declarations(name)["SMOKE_KEYS"]
        assert set(keys) <= set(printed), (
            f"{self.programs.label(name)} printed no {sorted(set(keys) - set(printed))}"
        )
