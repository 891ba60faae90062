"""The launch plan: the exact command, environment and log file of every process, and the learner's config.

Owns: :func:`load_launch_config` (the ``train`` YAML, whose server list may be left to the launcher),
port sources (:func:`free_ports`, :func:`sequential_ports`), :func:`torchrun_command` (the
learner's command line; tests start 2-rank runs with it too), :class:`ProcessSpec`, :class:`LaunchPlan`,
:func:`build_plan` and :func:`render_plan` (what ``--dry-run`` prints). Leaves out: checking the request
(``launch.layout``) and running anything (``launch.supervisor``).

What the servers are started with pins what the trainer cross-checks at start-up
(``ServerBackend.check_compatible``): the model directory, dtype, ``max_model_len``
(``vllm.max_model_len`` or ``training.global_max_length``), the processor's pixel bounds
(``data.min_pixels`` / ``data.max_pixels``) and ``--enable-lora`` when ``vllm.enable_lora`` is set.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollmatch.config.load import load_config
from rollmatch.config.rules import resolve_servers
from rollmatch.config.schema import RollmatchConfig, ServerEndpoint
from rollmatch.errors import ConfigError
from rollmatch.launch.layout import SERVERS_KEY, LaunchRequest, Layout, server_hosts

API_KEY_ENV = "ROLLMATCH_API_KEY"
REDACTED = "<redacted>"
LEARNER_CONFIG_NAME = "learner.yaml"
# Stands in for the servers while the config is validated; never reaches a written config.
_PLACEHOLDER_SERVERS = f"{SERVERS_KEY}=[{{base_url: 'http://launch.invalid:1', group_port: 1}}]"

PortSource = Callable[[int], list[int]]  # n -> n distinct TCP ports


@dataclass(frozen=True)
class LaunchConfig:
    """The validated config and the servers it names itself (empty: left to the launcher)."""

    cfg: RollmatchConfig
    named_servers: list[ServerEndpoint]


@dataclass(frozen=True)
class ProcessSpec:
    """One child process: ``env`` is what launch sets on top of its own environment."""

    role: str  # "server" | "learner"
    index: int
    command: tuple[str, ...]
    env: dict[str, str] = field(repr=False)  # holds the API key: never in a repr
    log_path: Path
    url: str | None = None  # servers: the base URL whose /health/ launch polls

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch starts, in start order (servers, then the learner)."""

    servers: tuple[ProcessSpec, ...]
    learner: ProcessSpec | None
    endpoints: tuple[ServerEndpoint, ...]  # what the learner's config lists
    learner_config: RollmatchConfig
    learner_config_path: Path
    launch_dir: Path
    health_timeout_s: float
    layout: Layout
    engine: str

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return (*self.servers, *((self.learner,) if self.learner else ()))


# ------------------------------------------------------------------------------------ public entry
def load_launch_config(path: str, overrides: Sequence[str] = ()) -> LaunchConfig:
    """``load_config`` with ``extends`` and overrides; a server-mode config may list no servers.

    The static rules ask server mode for at least one server; the launcher writes them, so when that
    is the only reason the servers section fails, the config is validated with a placeholder entry.
    """
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        if not any(p.key == SERVERS_KEY and not p.value for p in exc.problems):
            raise
        cfg = load_config(path, [*overrides, _PLACEHOLDER_SERVERS])  # still raises any other problem
        return LaunchConfig(cfg, [])
    return LaunchConfig(cfg, resolve_servers(cfg.rollout.vllm.server))


def torchrun_command(
    nproc: int, master_port: int, *args: str, python: str = sys.executable
) -> tuple[str, ...]:
    """``python -m torch.distributed.run`` with ``nproc`` processes on this machine and the rendezvous on
    127.0.0.1:``master_port``; ``args``: further torchrun options, then the program (a script and its
    arguments, or ``-m module ...``)."""
    return (
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(master_port),
        *args,
    )


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on every interface right now (held together while picked)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def sequential_ports(base: int) -> PortSource:
    """``--port-base``: ports ``base, base + 1, ...`` in plan order (server i: HTTP, group; then torchrun)."""
    return lambda count: list(range(base, base + count))


def ports_needed(layout: Layout) -> int:
    """HTTP + weight-sync group port per started server, plus torchrun's master port."""
    return 2 * layout.num_servers + (1 if layout.learner_procs else 0)


def build_plan(
    launch: LaunchConfig,
    request: LaunchRequest,
    layout: Layout,
    ports: list[int],
    *,
    api_key: str | None,
    cpu_count: int | None = None,
    python: str = sys.executable,
) -> LaunchPlan:
    """The plan of a checked request; ``ports`` come from a :data:`PortSource` (``ports_needed`` of them)."""
    cfg = launch.cfg
    launch_dir = Path(cfg.training.output_dir) / "launch"
    common = {"PYTHONUNBUFFERED": "1", **({API_KEY_ENV: api_key} if api_key else {})}
    if layout.on_cpu:
        processes = layout.num_servers + layout.learner_procs
        threads = max(1, (cpu_count or os.cpu_count() or 1) // max(processes, 1))
        common.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(threads))

    hosts = server_hosts(launch.named_servers, layout.num_servers)
    servers, endpoints = [], []
    for i, devices in enumerate(layout.server_devices):
        host, port, group_port = hosts[i], ports[2 * i], ports[2 * i + 1]
        url = f"http://{host}:{port}"
        env = dict(common) if layout.on_cpu else {"CUDA_VISIBLE_DEVICES": _csv(devices), **common}
        command = (python, "-m", "rollmatch.cli", "serve", *server_flags(cfg, request, layout, host, port))
        servers.append(ProcessSpec("server", i, command, env, launch_dir / f"server-{i}.log", url))
        endpoints.append(ServerEndpoint(base_url=url, group_port=group_port))
    if not endpoints:  # --learner-only: the servers the config names
        endpoints = [e.model_copy() for e in launch.named_servers]

    learner_cfg = learner_config(cfg, endpoints, layout.tensor_parallel_size)
    learner_path = launch_dir / LEARNER_CONFIG_NAME
    learner = None
    if layout.learner_procs:
        env = (
            dict(common)
            if layout.on_cpu
            else {"CUDA_VISIBLE_DEVICES": _csv(layout.learner_devices), **common}
        )
        command = torchrun_command(
            layout.learner_procs, ports[-1], "-m", "rollmatch.cli", "train", str(learner_path), python=python
        )
        learner = ProcessSpec("learner", 0, command, env, launch_dir / "learner-0.log")
    return LaunchPlan(
        servers=tuple(servers),
        learner=learner,
        endpoints=tuple(endpoints),
        learner_config=learner_cfg,
        learner_config_path=learner_path,
        launch_dir=launch_dir,
        health_timeout_s=cfg.rollout.vllm.server.timeout_s,
        layout=layout,
        engine=request.engine,
    )


def server_flags(
    cfg: RollmatchConfig, request: LaunchRequest, layout: Layout, host: str, port: int
) -> list[str]:
    """``rollmatch serve`` flags that pin what the trainer checks against the server at start-up."""
    vllm = cfg.rollout.vllm
    flags = [
        "--model",
        cfg.model.path,
        "--host",
        host,
        "--port",
        str(port),
        "--engine",
        request.engine,
        "--tensor-parallel-size",
        str(layout.tensor_parallel_size),
        "--max-model-len",
        str(vllm.max_model_len or cfg.training.global_max_length),
        # CPU engines run float32 (vLLM's CPU kernels; the colocated engine does the same).
        "--dtype",
        "float32" if layout.on_cpu else cfg.model.dtype,
    ]
    if cfg.data.min_pixels is not None:
        flags += ["--min-pixels", str(cfg.data.min_pixels)]
    if cfg.data.max_pixels is not None:
        flags += ["--max-pixels", str(cfg.data.max_pixels)]
    if vllm.enable_lora:
        flags.append("--enable-lora")
    return flags


def learner_config(cfg: RollmatchConfig, endpoints: list[ServerEndpoint], tp: int) -> RollmatchConfig:
    """The config the learner trains with: ``cfg`` with the started servers written in (preferred form)."""
    resolved = cfg.model_copy(deep=True)
    server = resolved.rollout.vllm.server
    server.servers = [e.model_copy() for e in endpoints]
    server.base_url, server.group_port = None, None
    resolved.rollout.vllm.tensor_parallel_size = tp
    return resolved


def shell_line(spec: ProcessSpec, *, redact: bool = True) -> str:
    """``VAR=value ... command`` as one copy-pasteable shell line (the API key redacted)."""
    env = [
        f"{name}={shlex.quote(REDACTED if redact and name == API_KEY_ENV else value)}"
        for name, value in sorted(spec.env.items())
    ]
    return " ".join([*env, shlex.join(spec.command)])


def render_plan(plan: LaunchPlan) -> str:
    """The plan as text: summary, the servers the learner config gets, then every process's line."""
    layout = plan.layout
    parts = []
    if plan.servers:
        parts.append(
            f"{len(plan.servers)} rollout server(s) ({plan.engine} engine, tensor parallel "
            f"{layout.tensor_parallel_size})"
        )
    if plan.learner is not None:
        parts.append(f"learner (torchrun, {layout.learner_procs} process(es))")
    lines = [f"rollmatch launch plan: {' + '.join(parts)}{' on CPU' if layout.on_cpu else ''}"]
    lines.append(f"learner config: {plan.learner_config_path}")
    lines.append(f"  {SERVERS_KEY}:")
    lines += [f"    - {{base_url: {e.base_url}, group_port: {e.group_port}}}" for e in plan.endpoints]
    for spec in plan.processes:
        lines.append(f"{spec.name} (log {spec.log_path}):")
        lines.append(f"  {shell_line(spec)}")
    return "\n".join(lines) + "\n"


def _csv(devices: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in devices)
