"""`rollmatch serve`'s limit flags are generated from `ServerLimits`: one flag per field, its help and
default written once on the field; the scheduler takes the same `ServerLimits` (one default each)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from rollmatch.cli import build_parser
from rollmatch.server.engine_watch import EngineWatch
from rollmatch.server.limits import ServerLimits, server_limits
from rollmatch.server.scheduler import EngineScheduler


def _serve_flags() -> dict[str, Any]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {a.dest: a for a in serve._actions}


def test_every_limit_is_a_flag_whose_help_states_the_fields_default() -> None:
    flags = _serve_flags()
    shown = {
        "max_body_bytes": "64 MiB",
        "max_json_values": "2^20",
        "max_queued_prompt_tokens": "2^23",  # the documented default (docs/server.md)
        "engine_stall_timeout_s": "120 s",
        "update_mode": "drain",
        "max_connections": "512",
    }
    for cap in fields(ServerLimits):
        flag = flags[cap.name]
        assert flag.option_strings == [f"--{cap.name.replace('_', '-')}"]
        assert flag.default is None  # not given: the field's default applies
        assert flag.help.startswith(cap.metadata["help"]), cap.name
        if cap.name in shown:
            assert flag.help.endswith(f"; default {shown[cap.name]}"), flag.help
    assert flags["update_mode"].choices == ("drain", "abort", "keep")


def test_flags_parse_onto_the_limits() -> None:
    parser = build_parser()
    assert server_limits(parser.parse_args(["serve", "--model", "m"])) == ServerLimits()
    given = parser.parse_args(
        [
            "serve",
            "--model",
            "m",
            "--max-queued-prompt-tokens",
            "4096",
            "--update-mode",
            "keep",
            "--drain-timeout-s",
            "0.5",
        ]
    )
    limits = server_limits(given)
    assert (limits.max_queued_prompt_tokens, limits.update_mode, limits.drain_timeout_s) == (
        4096,
        "keep",
        0.5,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--update-mode", "pause"])


def test_the_scheduler_takes_the_servers_limits(hf_engine: Any) -> None:
    """Before, the scheduler had defaults of its own (2^22 prompt tokens against the documented 2^23)."""
    for limits in (
        ServerLimits(),
        ServerLimits(max_queued_prompt_tokens=1000, update_mode="abort", max_reruns=0),
    ):
        scheduler = EngineScheduler(hf_engine, EngineWatch(limits.engine_stall_timeout_s), limits)
        try:
            assert (
                scheduler.max_queued_prompts,
                scheduler.max_queued_prompt_tokens,
                scheduler.update_mode,
                scheduler.drain_timeout_s,
                scheduler.max_reruns,
            ) == (
                limits.max_queued_prompts,
                limits.max_queued_prompt_tokens,
                limits.update_mode,
                limits.drain_timeout_s,
                limits.max_reruns,
            )
        finally:
            scheduler.close()
    assert ServerLimits().max_queued_prompt_tokens == 1 << 23
