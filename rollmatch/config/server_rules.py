"""The rollout servers' rules and their one normalised list.

Owns :func:`resolve_servers` (the servers as one list, whichever form configured them),
:func:`server_problems` (the server section alone: forms, pairing, ports, URLs), the static rule
:func:`rule_servers` and :func:`min_healthy_problems` (``vllm.server.min_healthy`` against the server
count, checked where the servers are known). Leaves out: reaching the servers (``rollout.client``).
"""

from __future__ import annotations

from urllib.parse import urlparse

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig, ServerConfig, ServerEndpoint
from rollmatch.errors import ConfigError, ConfigProblem

_VLLM = f"{ROLLOUT_KEY}.vllm"
_SERVER = f"{_VLLM}.server"


def resolve_servers(server_cfg: ServerConfig) -> list[ServerEndpoint]:
    """The rollout servers as one list, whichever form configured them (empty: none configured).

    Legacy form: ``base_url`` str or list, ``group_port`` int (server ``i`` gets ``group_port + i``)
    or a list of the same length. Raises :class:`ConfigError` on any :func:`server_problems`.
    """
    problems = server_problems(server_cfg)
    if problems:
        raise ConfigError(problems)
    if server_cfg.servers is not None:
        return [endpoint.model_copy() for endpoint in server_cfg.servers]
    urls = _legacy_urls(server_cfg)
    return [
        ServerEndpoint(base_url=url, group_port=port)
        for url, port in zip(urls, _legacy_ports(server_cfg, len(urls)), strict=True)
    ]


def min_healthy_problems(min_healthy: int | None, servers: int) -> list[ConfigProblem]:
    """``vllm.server.min_healthy`` above the run's ``servers`` (a floor the run could never meet). Checked
    where the servers are known: the resolved run (``config.resolved``) and a launch's plan."""
    if min_healthy is None or min_healthy <= servers:
        return []
    return [
        ConfigProblem(
            f"{_SERVER}.min_healthy",
            min_healthy,
            f"the run has {servers} rollout server(s), fewer than it needs healthy: set it between 1 and "
            f"{servers}, or null (every server must stay healthy)",
        )
    ]


def server_problems(server_cfg: ServerConfig) -> list[ConfigProblem]:
    """Every problem of the server section alone (forms, pairing, ports, URLs)."""
    problems: list[ConfigProblem] = []
    legacy_set = server_cfg.base_url is not None or server_cfg.group_port is not None
    if server_cfg.servers is not None and legacy_set:
        problems.append(
            ConfigProblem(
                f"{_SERVER}.servers",
                [s.base_url for s in server_cfg.servers],
                f"both `servers` and legacy `base_url`/`group_port` are set under {_SERVER}; keep only `servers`",
            )
        )
        return problems
    if server_cfg.servers is not None:
        endpoints = [(s.base_url, s.group_port) for s in server_cfg.servers]
        return problems + _endpoint_problems(endpoints, f"{_SERVER}.servers")
    if legacy_set:
        problems.extend(_legacy_problems(server_cfg))
    return problems


def rule_servers(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """Rollout servers: exactly one form (`servers` or legacy `base_url` + `group_port`), paired lists, unique URLs, no two servers on one host sharing a `group_port`; `vllm.mode: server` needs at least one server."""
    server_cfg = cfg.rollout.vllm.server
    problems = server_problems(server_cfg)
    configured = server_cfg.servers or server_cfg.base_url
    if cfg.rollout.vllm.mode == "server" and not configured:
        problems.append(
            ConfigProblem(
                f"{_SERVER}.servers",
                server_cfg.servers,
                f"{_VLLM}.mode is server but no rollout server is configured; set {_SERVER}.servers: "
                "[{base_url: http://HOST:PORT, group_port: PORT}], or use vllm.mode: colocate / rollout_backend: hf",
            )
        )
    return problems


def _legacy_urls(server_cfg: ServerConfig) -> list[str]:
    base_url = server_cfg.base_url
    if base_url is None:
        return []
    return [base_url] if isinstance(base_url, str) else list(base_url)


def _legacy_ports(server_cfg: ServerConfig, count: int) -> list[int]:
    group_port = server_cfg.group_port
    if group_port is None:
        return []
    if isinstance(group_port, int):
        return [group_port + i for i in range(count)]
    return list(group_port)


def _legacy_problems(server_cfg: ServerConfig) -> list[ConfigProblem]:
    urls = _legacy_urls(server_cfg)
    if server_cfg.base_url is None:
        return [
            ConfigProblem(
                f"{_SERVER}.group_port",
                server_cfg.group_port,
                f"group_port without base_url; prefer {_SERVER}.servers: [{{base_url: ..., group_port: ...}}]",
            )
        ]
    if server_cfg.group_port is None:
        return [
            ConfigProblem(
                f"{_SERVER}.base_url",
                server_cfg.base_url,
                "base_url without group_port (the weight-sync port); set group_port (int: server i uses "
                f"group_port + i), or use {_SERVER}.servers: [{{base_url: ..., group_port: ...}}]",
            )
        ]
    ports = _legacy_ports(server_cfg, len(urls))
    if len(ports) != len(urls):
        return [
            ConfigProblem(
                f"{_SERVER}.group_port",
                server_cfg.group_port,
                f"{len(ports)} group_port(s) for {len(urls)} base_url(s); give one port per base_url, "
                "or a single int (server i uses group_port + i)",
            )
        ]
    return _endpoint_problems(list(zip(urls, ports, strict=True)), f"{_SERVER}.base_url")


def _endpoint_problems(endpoints: list[tuple[str, int]], key: str) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    seen: set[str] = set()
    group_ports: dict[tuple[str, int], str] = {}
    for url, port in endpoints:
        normalised = url.rstrip("/")
        host = (urlparse(normalised).hostname or "").replace("localhost", "127.0.0.1")
        other = group_ports.setdefault((host, port), url)
        if other != url:
            problems.append(
                ConfigProblem(
                    key,
                    port,
                    f"{url} and {other} share group_port {port} on host {host}: each server's weight-sync group "
                    "needs its own port on its host; give every server on one host a different group_port",
                )
            )
        if not normalised.startswith(("http://", "https://")):
            problems.append(ConfigProblem(key, url, "a server URL must start with http:// or https://"))
        if normalised in seen:
            problems.append(ConfigProblem(key, url, "duplicate server URL; list each rollout server once"))
        seen.add(normalised)
        if not 0 < port < 65536:
            problems.append(ConfigProblem(key, port, f"group_port {port} of {url} is outside 1..65535"))
    return problems


def resolved_server_count(server_cfg: ServerConfig) -> int:
    """How many servers :func:`resolve_servers` lists (0: none, or the section has problems, which
    :func:`rule_servers` reports)."""
    return 0 if server_problems(server_cfg) else len(resolve_servers(server_cfg))
