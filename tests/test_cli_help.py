"""The top-level help says what rollmatch does and where to start; help and check-config stay light:
they never import torch, transformers, vLLM or the other heavy packages (fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "torchvision", "transformers", "peft", "vllm", "numpy", "PIL")


def _heavy_modules_after(argv: list[str]) -> list[str]:
    code = f"""
        import contextlib, io, sys
        from rollmatch.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                main({argv!r})
            except SystemExit:
                pass
        print(",".join(m for m in {HEAVY!r} if m in sys.modules))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [m for m in done.stdout.strip().split(",") if m]


def test_help_imports_no_heavy_module() -> None:
    assert _heavy_modules_after(["--help"]) == []


def test_check_config_imports_no_heavy_module() -> None:
    # The keys alone; the input checks load the model directory's processor when the files are there.
    assert (
        _heavy_modules_after(["check-config", "--schema-only", str(REPO / "configs" / "demo_sft.yaml")]) == []
    )


def test_top_level_help_says_what_and_where_to_start(capsys) -> None:
    from rollmatch.cli import build_parser

    text = build_parser().format_help()
    assert "detect objects" in text and "where to start:" in text
    for start in ("rollmatch demo", "configs/recipes/", "docs/runbook.md"):
        assert start in text
    assert "argument parsing only" not in text
