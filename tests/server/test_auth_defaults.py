"""Who may call a rollout server by default: the bind-address rule, the key's sources, the guarded routes.

A ``--host`` that is not loopback needs a key (or ``--insecure-no-auth``), checked before the model
loads; the key comes from ``--api-key``, ``--api-key-file`` or ``$ROLLMATCH_API_KEY``; with a key,
every route but ``GET /health/`` (the API docs, ``/info/``, ``/stats/`` included) needs it. The
trainer sending the key on its ``/info/`` calls is covered against a real server in
``test_faults.py`` (``test_sync_needs_the_token_and_the_lease_...``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.cli import build_parser, main
from rollmatch.errors import ConfigError
from rollmatch.server.gate import API_KEY_ENV, is_loopback, server_api_key
from rollmatch.server.serve import server_access

REPO = Path(__file__).resolve().parents[2]
GUARDED_GETS = ("/docs", "/redoc", "/openapi.json", "/info/", "/stats/", "/get_world_size/")


def _serve_args(*flags: str) -> Any:
    return build_parser().parse_args(["serve", "--model", "/nowhere/model", *flags])


@pytest.fixture(autouse=True)
def _no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)


# ------------------------------------------------------------------------------ bind address
def test_a_public_host_without_a_key_refuses_to_start_before_loading_the_model() -> None:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    command = [
        sys.executable,
        "-m",
        "rollmatch.cli",
        "serve",
        "--model",
        "/nowhere/model",
        "--host",
        "0.0.0.0",
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    message = done.stderr
    assert "--host = '0.0.0.0'" in message and "not a loopback address and no API key" in message
    assert "--api-key-file" in message and "--insecure-no-auth" in message and "127.0.0.1" in message
    assert "/nowhere/model" not in message  # refused before the model was looked at


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7"])
def test_non_loopback_hosts_need_a_key_or_insecure_no_auth(host: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--host"):
        server_access(_serve_args("--host", host))
    assert server_access(_serve_args("--host", host, "--insecure-no-auth")) is None
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")
    assert server_access(_serve_args("--host", host, "--api-key-file", str(key_file))) == "k3y"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_stay_open_for_local_development(host: str) -> None:
    assert is_loopback(host)
    assert server_access(_serve_args("--host", host)) is None
    assert server_access(_serve_args()) is None  # the default host is 127.0.0.1


def test_the_environment_key_counts_for_a_public_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_access(_serve_args("--host", "0.0.0.0")) == "from-env"
    monkeypatch.setenv(API_KEY_ENV, "")  # empty counts as unset, as it does for the trainer
    with pytest.raises(ConfigError, match="--host"):
        server_access(_serve_args("--host", "0.0.0.0"))


# ------------------------------------------------------------------------------ key sources
def test_the_key_file_is_read_without_its_trailing_newline(tmp_path: Path) -> None:
    for text in ("s3cret\n", "s3cret\r\n", "s3cret"):
        (tmp_path / "key").write_text(text, newline="")
        assert server_api_key(None, str(tmp_path / "key"), {}) == "s3cret"
    assert server_api_key(None, str(tmp_path / "key"), {API_KEY_ENV: "other"}) == "s3cret"  # flag first
    assert server_api_key("flag", None, {API_KEY_ENV: "other"}) == "flag"


@pytest.mark.parametrize(
    ("content", "fix"),
    [
        ("", "the key is empty"),
        ("\n", "the key is empty"),
        ("  \n", "the key is empty"),
        ("a b", "the key holds whitespace"),
    ],
)
def test_an_empty_or_mangled_key_file_is_refused(tmp_path: Path, content: str, fix: str) -> None:
    (tmp_path / "key").write_text(content)
    with pytest.raises(ConfigError, match=f"--api-key-file = '{tmp_path / 'key'}': {fix}"):
        server_api_key(None, str(tmp_path / "key"), {})


def test_a_missing_or_unreadable_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match=r"--api-key-file = .*absent': no such file; write the key there"):
        server_api_key(None, str(missing), {})
    with pytest.raises(ConfigError, match=r"--api-key-file = .*: cannot be read \(IsADirectoryError"):
        server_api_key(None, str(tmp_path), {})


def test_an_empty_or_mangled_flag_key_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError, match="--api-key = '<redacted>': the key is empty"):
        server_api_key("", None, {})
    with pytest.raises(ConfigError, match="non-ASCII") as refused:
        server_api_key("s3cr\u00e9t-value", None, {})
    assert "s3cr" not in str(refused.value)
    with pytest.raises(ConfigError, match=rf"\${API_KEY_ENV} = '<redacted>': .*whitespace"):
        server_api_key(None, None, {API_KEY_ENV: "key with spaces"})


def test_both_key_flags_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "key").write_text("k3y")
    with pytest.raises(SystemExit) as refused:
        main(
            [
                "serve",
                "--model",
                "/nowhere/model",
                "--api-key",
                "k3y",
                "--api-key-file",
                str(tmp_path / "key"),
            ]
        )
    assert refused.value.code == 2
    assert "--api-key-file: not allowed with argument --api-key" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="give one"):
        server_api_key("k3y", str(tmp_path / "key"), {})


def test_an_empty_key_file_stops_rollmatch_serve_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "key").write_text("\n")
    code = main(["serve", "--model", "/nowhere/model", "--api-key-file", str(tmp_path / "key")])
    assert code == 2
    assert "rollmatch serve: error:" in capsys.readouterr().err


# ------------------------------------------------------------------------------ guarded routes
def test_docs_info_and_stats_need_the_key_and_health_does_not(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    client, _server = app_client(hf_engine, api_key="s3cret")
    for path in (*GUARDED_GETS, "/no-such-route/"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            reply = client.get(path, headers=headers)
            assert reply.status_code == 401, (path, headers, reply.text)
            assert reply.headers["www-authenticate"] == "Bearer" and "API key" in reply.json()["detail"]
    keyed = {"Authorization": "Bearer s3cret"}
    for path in GUARDED_GETS:
        assert client.get(path, headers=keyed).status_code == 200, path
    assert client.get("/no-such-route/", headers=keyed).status_code == 404
    assert client.get("/health/").status_code == 200 and client.head("/health/").status_code in (200, 405)
    assert client.post("/health/").status_code == 401  # only reading /health/ is open


def test_without_a_key_every_route_stays_open(hf_engine: Any, app_client: Callable[..., Any]) -> None:
    client, _server = app_client(hf_engine)
    for path in (*GUARDED_GETS, "/health/"):
        assert client.get(path).status_code == 200, path
