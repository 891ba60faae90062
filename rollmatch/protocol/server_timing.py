"""The ``Server-Timing`` header of ``/infer/`` answers: the server's own phase times."""

from __future__ import annotations

# ``/infer/`` answers carry the server's own phase times in the standard ``Server-Timing`` header
# (``parse;dur=1.204, engine;dur=250.1``, milliseconds), so a client can tell transfer from work.
SERVER_TIMING_HEADER = "Server-Timing"


def format_server_timing(seconds: dict[str, float]) -> str:
    """``{"parse": 0.0012}`` -> ``parse;dur=1.200`` (the header's unit is milliseconds)."""
    return ", ".join(f"{name};dur={value * 1000:.3f}" for name, value in seconds.items())


def parse_server_timing(value: str) -> dict[str, float]:
    """The header back to seconds per phase; entries without a ``dur`` are skipped."""
    phases: dict[str, float] = {}
    for entry in value.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, number = param.strip().partition("=")
            if name and key == "dur":
                try:
                    phases[name] = float(number) / 1000
                except ValueError:
                    continue
    return phases
