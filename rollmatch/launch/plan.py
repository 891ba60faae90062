"""The launch plan: the exact command, environment and log file of every process, and the learner's config.

Owns: :func:`load_launch_config` (the ``train`` YAML, whose server list may be left to the launcher),
port sources (:func:`free_ports`, :func:`sequential_ports`), :func:`torchrun_command` (the
learner's command line; tests start 2-rank runs with it too) and its c10d :class:`Rendezvous` (one code
path for 1 and N nodes), :func:`cluster_endpoints` (the learner's server list: every server node's
servers, derived alike on every node), :class:`ProcessSpec`, :class:`LaunchPlan`, :func:`build_plan`
(one node's plan) and :func:`render_plan` (what ``--dry-run`` prints, per node). Leaves out: checking the request
(``launch.layout``) and running anything (``launch.supervisor``).

What the servers are started with pins what the trainer cross-checks at start-up
(``ServerBackend.check_compatible``): the model directory, dtype, ``max_model_len``
(``vllm.max_model_len`` or ``training.global_max_length``), the processor's pixel bounds
(``data.min_pixels`` / ``data.max_pixels``), the coordinate frame (``--coord-frame`` when
``data.coord_frame`` needs no checkpoint to resolve; else the server resolves ``auto`` from the same
directory) and ``--enable-lora`` when ``vllm.enable_lora`` is set.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from rollmatch.config.engine_rules import server_engine_flags
from rollmatch.config.frames import fixed_coord_frame
from rollmatch.config.input_files import absolute_input_paths
from rollmatch.config.load import load_config
from rollmatch.config.precision import rollout_dtype
from rollmatch.config.schema import RollmatchConfig, ServerEndpoint
from rollmatch.config.server_rules import min_healthy_problems, resolve_servers
from rollmatch.errors import ConfigError
from rollmatch.launch.layout import SERVERS_KEY, LaunchRequest, Layout, derive_layout, server_hosts
from rollmatch.protocol import API_KEY_ENV

REDACTED = "<redacted>"
LEARNER_CONFIG_NAME = "learner.yaml"
LOCALHOST = "127.0.0.1"
# Stands in for the servers while the config is validated; never reaches a written config.
_PLACEHOLDER_SERVERS = f"{SERVERS_KEY}=[{{base_url: 'http://launch.invalid:1', group_port: 1}}]"

PortSource = Callable[[int], list[int]]  # n -> n distinct TCP ports
# One learner node's rendezvous: port 0, so torchrun's c10d store binds a port the OS picks the moment it
# starts (as ``torchrun --standalone`` does). A port picked by the launcher is free only when picked;
# torchrun binds it once the servers are healthy, tens of seconds later, and if another process took it
# meanwhile, torch's c10d backend does not fail: it joins the store it finds there as a client and waits
# for a rendezvous that never comes (join_timeout), with an empty learner log.
ONE_NODE_RENDEZVOUS = f"{LOCALHOST}:0"


@dataclass(frozen=True)
class LaunchConfig:
    """The validated config and the servers it names itself (empty: left to the launcher)."""

    cfg: RollmatchConfig
    named_servers: list[ServerEndpoint]


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's c10d rendezvous of one learner node: the same ``endpoint`` on every node."""

    endpoint: str  # HOST:PORT; on one node HOST:0 (see ONE_NODE_RENDEZVOUS)
    rdzv_id: str = "rollmatch"  # build_plan: rendezvous_id()
    nnodes: int = 1
    node_rank: int = 0  # this node's index among the learner nodes
    local_addr: str = LOCALHOST  # this node's address: rank 0's is every worker's MASTER_ADDR
    join_timeout_s: float = 600.0

    def args(self) -> tuple[str, ...]:
        return (
            "--nnodes",
            str(self.nnodes),
            "--node-rank",
            str(self.node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.rdzv_id,
            "--rdzv-conf",
            f"join_timeout={self.join_timeout_s:g}",
            "--local-addr",
            self.local_addr,
        )


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
    node_rank: int = 0
    node_count: int = 1
    learner_nodes: tuple[int, ...] = (0,)  # the node ranks that run a learner
    restart_servers: int = 0  # launch.restart_servers: restarts per server before the launch gives up
    restart_backoff_s: float = 1.0  # launch.restart_backoff_s: before a server's first restart, then doubled

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return (*self.servers, *((self.learner,) if self.learner else ()))


_SERVERS_SUFFIX = "vllm.server.servers"  # SERVERS_KEY in either spelling (config.spelling)


# ------------------------------------------------------------------------------------ public entry
def load_launch_config(path: str, overrides: Sequence[str] = ()) -> LaunchConfig:
    """``load_config`` with ``extends`` and overrides; a server-mode config may list no servers.

    The static rules ask server mode for at least one server; the launcher writes them, so a
    server-mode config that lists none is loaded with a placeholder entry. The rules run on the
    result in :func:`~rollmatch.launch.layout.request_problems`.
    """
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:  # field errors come with the static rules' problems
        if not any(p.key.endswith(_SERVERS_SUFFIX) and not p.value for p in exc.problems):
            raise
        cfg = load_config(path, [*overrides, _PLACEHOLDER_SERVERS])  # still raises any other problem
        return LaunchConfig(cfg, [])
    server = cfg.rollout.vllm.server
    if cfg.rollout.vllm.mode == "server" and not (server.servers or server.base_url):
        return LaunchConfig(load_config(path, [*overrides, _PLACEHOLDER_SERVERS]), [])
    return LaunchConfig(cfg, resolve_servers(server))


def torchrun_command(
    nproc: int,
    master_port: int,
    *args: str,
    python: str = sys.executable,
    rendezvous: Rendezvous | None = None,
) -> tuple[str, ...]:
    """``python -m torch.distributed.run`` with ``nproc`` processes on this machine; ``args``: further
    torchrun options, then the program (a script and its arguments, or ``-m module ...``).

    With ``rendezvous`` (what ``rollmatch launch`` always passes, on 1 node or N): torchrun's c10d
    rendezvous across ``rendezvous.nnodes`` nodes (``master_port`` unused). Without: a static one-node
    rendezvous on 127.0.0.1:``master_port`` (tests that start 2-rank runs)."""
    if rendezvous is not None:
        where: tuple[str, ...] = rendezvous.args()
    else:
        where = ("--master_addr", LOCALHOST, "--master_port", str(master_port))
    return (python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *where, *args)


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
    """``--port-base``: ports ``base, base + 1, ...`` in plan order (server i: HTTP, group)."""
    return lambda count: list(range(base, base + count))


def ports_needed(layout: Layout) -> int:
    """HTTP + weight-sync group port per started server. The learner's rendezvous needs none: on one node
    its store binds a port of the OS's choosing (:data:`ONE_NODE_RENDEZVOUS`), several nodes meet at
    ``launch.nodes.rendezvous``."""
    return 2 * layout.num_servers


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
    nodes = cfg.launch.nodes
    multi = nodes.count > 1
    launch_dir = node_launch_dir(cfg, request.node_rank)
    common = {"PYTHONUNBUFFERED": "1", **({API_KEY_ENV: api_key} if api_key else {})}
    if layout.on_cpu:
        processes = layout.num_servers + layout.learner_procs
        threads = max(1, (cpu_count or os.cpu_count() or 1) // max(processes, 1))
        common.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(threads))

    here = nodes.hosts[request.node_rank] if multi else LOCALHOST
    hosts = [here] * layout.num_servers if multi else server_hosts(launch.named_servers, layout.num_servers)
    servers = []
    for i, devices in enumerate(layout.server_devices):
        host, port = hosts[i], ports[2 * i]
        url = f"http://{host}:{port}"
        env = dict(common) if layout.on_cpu else {"CUDA_VISIBLE_DEVICES": _csv(devices), **common}
        command = (python, "-m", "rollmatch.cli", "serve", *server_flags(cfg, request, layout, host, port))
        servers.append(ProcessSpec("server", i, command, env, launch_dir / f"server-{i}.log", url))
    endpoints = cluster_endpoints(launch, request, layout, ports)
    floor = min_healthy_problems(cfg.rollout.vllm.server.min_healthy, len(endpoints))
    if floor:  # the servers a launch starts are known only here
        raise ConfigError(floor)

    learner_cfg = learner_config(cfg, endpoints)
    learner_path = launch_dir / LEARNER_CONFIG_NAME
    learner_nodes = [r for r in range(nodes.count) if nodes.role(r) != "servers"]
    learner = None
    if layout.learner_procs:
        env = (
            dict(common)
            if layout.on_cpu
            else {"CUDA_VISIBLE_DEVICES": _csv(layout.learner_devices), **common}
        )
        endpoint = nodes.rendezvous or ONE_NODE_RENDEZVOUS
        rendezvous = Rendezvous(
            endpoint=endpoint,
            rdzv_id=rendezvous_id(cfg, endpoint),
            nnodes=len(learner_nodes),
            node_rank=learner_nodes.index(request.node_rank),
            local_addr=here,
            join_timeout_s=nodes.join_timeout_s,
        )
        command = torchrun_command(
            layout.learner_procs,
            0,
            "-m",
            "rollmatch.cli",
            "train",
            str(learner_path),
            python=python,
            rendezvous=rendezvous,
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
        node_rank=request.node_rank,
        node_count=nodes.count,
        learner_nodes=tuple(learner_nodes),
        restart_servers=cfg.launch.restart_servers,
        restart_backoff_s=cfg.launch.restart_backoff_s,
    )


def rendezvous_id(cfg: RollmatchConfig, endpoint: str) -> str:
    """torchrun's ``--rdzv-id``: ``launch.nodes.rendezvous_id`` (the Slurm script sets the job id), else
    ``rollmatch-<hash>`` of ``training.output_dir`` as written and ``endpoint``: the same on every node,
    different for two runs that share a rendezvous host and port (which torch would otherwise join to
    each other's rendezvous: a taken port makes torchrun a client of the store already there)."""
    if cfg.launch.nodes.rendezvous_id:
        return cfg.launch.nodes.rendezvous_id
    digest = hashlib.sha256(f"{cfg.training.output_dir}\0{endpoint}".encode()).hexdigest()
    return f"rollmatch-{digest[:12]}"


def node_launch_dir(cfg: RollmatchConfig, node_rank: int) -> Path:
    """``<output_dir>/launch``, or ``<output_dir>/launch/node-<rank>`` when several nodes share it."""
    launch_dir = Path(cfg.training.output_dir) / "launch"
    return launch_dir / f"node-{node_rank}" if cfg.launch.nodes.count > 1 else launch_dir


def cluster_endpoints(
    launch: LaunchConfig, request: LaunchRequest, layout: Layout, ports: list[int]
) -> list[ServerEndpoint]:
    """The servers the learner lists: on one node those this launch starts (or, ``--learner-only``, the ones
    the config names); on several, every server node's servers at its host, the same ports on each node
    (``launch.port_base``), in node order. Every learner node derives the same list."""
    nodes = launch.cfg.launch.nodes
    if nodes.count == 1:
        if not layout.num_servers:  # --learner-only: the servers the config names
            return [e.model_copy() for e in launch.named_servers]
        hosts = server_hosts(launch.named_servers, layout.num_servers)
        return [
            ServerEndpoint(base_url=f"http://{hosts[i]}:{ports[2 * i]}", group_port=ports[2 * i + 1])
            for i in range(layout.num_servers)
        ]
    server_node = replace(request, node_runs_servers=True, learner_only=False)
    per_node = derive_layout(server_node, launch.cfg).num_servers
    base = launch.cfg.launch.port_base or ports[0]
    return [
        ServerEndpoint(base_url=f"http://{nodes.hosts[r]}:{base + 2 * i}", group_port=base + 2 * i + 1)
        for r in range(nodes.count)
        if nodes.role(r) != "learner"
        for i in range(per_node)
    ]


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
        "float32" if layout.on_cpu else rollout_dtype(cfg),
    ]
    if cfg.data.min_pixels is not None:
        flags += ["--min-pixels", str(cfg.data.min_pixels)]
    if cfg.data.max_pixels is not None:
        flags += ["--max-pixels", str(cfg.data.max_pixels)]
    frame = fixed_coord_frame(cfg.data.coord_frame, cfg.custom.object_format)
    if frame is not None:  # auto with a family frame: the server resolves it from the same directory
        flags += ["--coord-frame", frame]
    if vllm.enable_lora:
        flags.append("--enable-lora")
    if request.engine == "vllm":  # the engine keys of the config reach every vLLM server
        flags += server_engine_flags(cfg, on_cpu=layout.on_cpu)
    return flags


def learner_config(cfg: RollmatchConfig, endpoints: list[ServerEndpoint]) -> RollmatchConfig:
    """The config the learner trains with: ``cfg`` with the started servers written in (preferred form)."""
    resolved = cfg.model_copy(deep=True)
    server = resolved.rollout.vllm.server
    server.servers = [e.model_copy() for e in endpoints]
    server.base_url, server.group_port = None, None
    absolute_input_paths(
        resolved, Path.cwd()
    )  # learner.yaml lives elsewhere: no path may depend on its folder
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
    where = f"node {plan.node_rank} of {plan.node_count}: " if plan.node_count > 1 else ""
    lines = [
        f"rollmatch launch plan: {where}{' + '.join(parts) or 'nothing'}{' on CPU' if layout.on_cpu else ''}"
    ]
    lines.append(f"learner config: {plan.learner_config_path}")
    lines.append(f"  {SERVERS_KEY}:")
    lines += [f"    - {{base_url: {e.base_url}, group_port: {e.group_port}}}" for e in plan.endpoints]
    for spec in plan.processes:
        lines.append(f"{spec.name} (log {spec.log_path}):")
        lines.append(f"  {shell_line(spec)}")
    return "\n".join(lines) + "\n"


def _csv(devices: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in devices)
