"""What a launch asks for, every reason it cannot run, and the device layout it gets.

Owns: :class:`LaunchRequest` (one node's launch as data), :func:`launch_overrides` (the launch flags
that name a config key, as ``launch.*`` overrides), :func:`with_settings` (the config's ``launch:``
section for one node of ``launch.nodes``), :func:`parse_devices`, :func:`request_problems` (what only
the launcher knows: ``--cpu``, the roles, the machine's devices, the config's mode; checked before
any process starts) and :func:`derive_layout` (devices -> servers of ``tensor_parallel_size``
devices each, learner ranks). Leaves out: the rules of the ``launch:`` keys themselves (devices each
once, disjoint roles, tensor-parallel split: ``config.launch_rules``, run when the config loads, so
a flag and its key get one rule and one message), ports, hosts, commands (``launch.plan``) and
processes (``launch.processes``).

The config goes through the project's rules (:func:`rollmatch.config.rules.check_config`, and
:func:`~rollmatch.config.rules.check_runtime` for the learner's world size), the same ones ``rollmatch
train`` applies at start-up, so a layout the trainer would refuse is refused here first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal
from urllib.parse import urlparse

from rollmatch.config.rules import check_config, check_runtime
from rollmatch.config.schema import ROLLOUT_KEY, LaunchSettings, RollmatchConfig, ServerEndpoint
from rollmatch.errors import ConfigProblem

VLLM_KEY = f"{ROLLOUT_KEY}.vllm"
SERVERS_KEY = f"{VLLM_KEY}.server.servers"
TP_KEY = "launch.tensor_parallel_size"
SERVER_DEVICES_KEY = "launch.server_devices"
LEARNER_DEVICES_KEY = "launch.learner_devices"
ENGINE_KEY = "launch.engine"
Engine = Literal["vllm", "hf"]


@dataclass(frozen=True)
class LaunchRequest:
    """One node's launch; checked by :func:`request_problems`.

    ``cpu``, ``servers_only``, ``learner_only`` and ``dry_run`` are the flags that have no config
    key; every other field is the config's ``launch:`` value for the node (flags with a key reach
    it as ``launch.*`` overrides, :func:`launch_overrides`), filled in by :func:`with_settings`.
    """

    config: str
    overrides: tuple[str, ...] = ()
    server_devices: tuple[int, ...] = ()
    learner_devices: tuple[int, ...] = ()
    tensor_parallel_size: int | None = None  # None: the config's launch.tensor_parallel_size
    cpu: bool = False
    servers: int | None = None  # --cpu only; default 1
    learner_procs: int | None = None  # --cpu only; default 1
    servers_only: bool = False
    learner_only: bool = False
    engine: Engine = "vllm"
    port_base: int | None = None  # None: free ports picked by the OS
    dry_run: bool = False
    grace_s: float = 10.0
    node_rank: int = 0  # which node of launch.nodes this launch plans
    node_runs_servers: bool = True  # launch.nodes.roles of node_rank
    node_runs_learner: bool = True

    @property
    def starts_servers(self) -> bool:
        return self.node_runs_servers and not self.learner_only

    @property
    def starts_learner(self) -> bool:
        return self.node_runs_learner and not self.servers_only


def launch_overrides(flags: dict[str, object]) -> list[str]:
    """The launch flags that name a config key, as ``launch.*`` overrides (``None``: not given).

    ``flags``: ``server_devices`` / ``learner_devices`` (parsed device tuples), ``tensor_parallel_size``,
    ``servers`` (``launch.servers_per_node``), ``learner_procs`` (``launch.learner_procs_per_node``),
    ``engine``, ``port_base`` and ``grace_s``. They come after the config's own overrides, so a flag wins.
    """
    keys = {
        "server_devices": "server_devices",
        "learner_devices": "learner_devices",
        "tensor_parallel_size": "tensor_parallel_size",
        "servers": "servers_per_node",
        "learner_procs": "learner_procs_per_node",
        "engine": "engine",
        "port_base": "port_base",
        "grace_s": "grace_s",
    }
    overrides: list[str] = []
    for flag, key in keys.items():
        value = flags.get(flag)
        if value is None or value == ():
            continue
        text = f"[{', '.join(map(str, value))}]" if isinstance(value, tuple) else str(value)
        overrides.append(f"launch.{key}={text}")
    return overrides


def with_settings(
    request: LaunchRequest, settings: LaunchSettings, node_rank: int | None = None
) -> LaunchRequest:
    """``request`` for node ``node_rank`` (default ``launch.nodes.rank``), its devices, process
    counts, engine, ports and grace from the config's ``launch`` section (flags already in it)."""
    rank = settings.nodes.rank if node_rank is None else node_rank
    role = settings.nodes.role(rank)
    return replace(
        request,
        server_devices=tuple(settings.server_devices),
        learner_devices=tuple(settings.learner_devices),
        tensor_parallel_size=settings.tensor_parallel_size,
        servers=settings.servers_per_node if request.cpu else None,
        learner_procs=settings.learner_procs_per_node if request.cpu else None,
        engine=settings.engine,
        port_base=settings.port_base,
        grace_s=settings.grace_s,
        node_rank=rank,
        node_runs_servers=role in ("servers", "both"),
        node_runs_learner=role in ("learner", "both"),
    )


@dataclass(frozen=True)
class Layout:
    """Who runs where. On CPU every device tuple is empty (children get ``CUDA_VISIBLE_DEVICES=''``)."""

    on_cpu: bool
    server_devices: tuple[tuple[int, ...], ...]  # one entry per server (empty: no servers started)
    learner_devices: tuple[int, ...]
    learner_procs: int  # 0: no learner started
    tensor_parallel_size: int

    @property
    def num_servers(self) -> int:
        return len(self.server_devices)


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)`` (``ValueError`` when it is not a list of integers); which lists
    are valid is the rule of ``launch.server_devices`` / ``launch.learner_devices``
    (``config.launch_rules``)."""
    try:
        devices = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError("not a comma-separated list of device indices; write e.g. 0,1,2,3") from None
    if not devices:
        raise ValueError("give device indices >= 0, e.g. 0,1,2,3")
    return devices


def tensor_parallel_size(request: LaunchRequest, launch: LaunchSettings) -> int:
    """``launch.tensor_parallel_size`` (``--tensor-parallel-size``; default 1); 1 on CPU."""
    if request.cpu:
        return 1
    return request.tensor_parallel_size or launch.tensor_parallel_size


def derive_layout(request: LaunchRequest, cfg: RollmatchConfig) -> Layout:
    """The layout of a request without :func:`request_problems` (servers of TP devices, in order)."""
    tp = tensor_parallel_size(request, cfg.launch)
    if request.cpu:
        servers = (request.servers or 1) if request.starts_servers else 0
        procs = (request.learner_procs or 1) if request.starts_learner else 0
        return Layout(True, ((),) * servers, (), procs, tp)
    groups = (
        tuple(request.server_devices[i : i + tp] for i in range(0, len(request.server_devices), tp))
        if request.starts_servers
        else ()
    )
    procs = len(request.learner_devices) if request.starts_learner else 0
    return Layout(False, groups, request.learner_devices, procs, tp)


def request_problems(
    request: LaunchRequest,
    cfg: RollmatchConfig,
    named_servers: list[ServerEndpoint],
    *,
    device_count: int | None,
    visible_devices: str | None = None,
) -> list[ConfigProblem]:
    """Every reason the launch cannot run, before anything starts.

    ``named_servers``: the servers the config itself lists (empty when it leaves them to the launcher).
    ``device_count``: CUDA devices on this machine, or ``None`` to skip the existence check (dry run).
    ``visible_devices``: the launcher's own ``CUDA_VISIBLE_DEVICES``, if set.
    """
    problems = _flag_problems(request)
    problems += check_config(cfg)  # the static rules (a loaded config has only valid keys and values)
    problems += _config_problems(request, cfg, named_servers)
    learner_procs = derive_layout(request, cfg).learner_procs
    nodes = cfg.launch.nodes
    learner_nodes = sum(1 for rank in range(nodes.count) if nodes.role(rank) != "servers")
    if learner_procs and cfg.rollout.vllm.mode == "server":
        # The rules `rollmatch train` applies at start-up, for the world size this launch gives it
        # (every learner node runs as many ranks as this one).
        problems += check_runtime(
            cfg,
            world_size=learner_procs * max(learner_nodes, 1),
            device_count=learner_procs,
            device_type="cpu" if request.cpu else "cuda",
        )
    if device_count is not None and not request.cpu:
        problems += missing_device_problems(request, device_count, visible_devices)
    return problems


def missing_device_problems(
    request: LaunchRequest, device_count: int, visible_devices: str | None
) -> list[ConfigProblem]:
    """Devices of ``launch.server_devices`` / ``learner_devices`` this machine (or this shell's
    CUDA_VISIBLE_DEVICES) lacks."""
    problems: list[ConfigProblem] = []
    for key, devices in (
        (SERVER_DEVICES_KEY, request.server_devices),
        (LEARNER_DEVICES_KEY, request.learner_devices),
    ):
        if visible_devices is not None:
            allowed = {p.strip() for p in visible_devices.split(",") if p.strip()}
            missing = [d for d in devices if str(d) not in allowed]
            where = f"this shell's CUDA_VISIBLE_DEVICES={visible_devices!r}"
        else:
            missing = [d for d in devices if d >= device_count]
            where = f"this machine has {device_count} CUDA device(s)" + (
                f" (0-{device_count - 1})" if device_count else ""
            )
        if missing:
            problems.append(
                ConfigProblem(
                    key,
                    list(devices),
                    f"device(s) {_devices_text(missing)} do not exist here: {where}; name existing devices, "
                    "use --cpu, or --dry-run to plan a layout for another machine",
                )
            )
    return problems


def server_hosts(named_servers: list[ServerEndpoint], num_servers: int) -> list[str]:
    """The host each started server binds: 127.0.0.1, or the host(s) the config names."""
    hosts = [urlparse(e.base_url).hostname or "127.0.0.1" for e in named_servers]
    if not hosts:
        return ["127.0.0.1"] * num_servers
    if len(set(hosts)) == 1:
        return [hosts[0]] * num_servers
    return hosts  # one per server; request_problems checked the count


# ------------------------------------------------------------------------------------ private helpers
def _flag_problems(request: LaunchRequest) -> list[ConfigProblem]:
    """What the flags without a key (``--cpu``, the roles) ask of the ``launch:`` values."""
    if request.cpu:
        return _cpu_flag_problems(request)
    problems: list[ConfigProblem] = []
    if request.starts_servers and not request.server_devices:
        problems.append(
            ConfigProblem(
                SERVER_DEVICES_KEY,
                [],
                "name the rollout servers' GPUs (launch.server_devices: [0, 1, 2, 3] or --server-devices 0,1,2,3), "
                "or use --cpu or --learner-only",
            )
        )
    if request.starts_learner and not request.learner_devices:
        problems.append(
            ConfigProblem(
                LEARNER_DEVICES_KEY,
                [],
                "name the learner's GPUs (launch.learner_devices: [4, 5] or --learner-devices 4,5), or use --cpu "
                "or --servers-only",
            )
        )
    return problems


def _cpu_flag_problems(request: LaunchRequest) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    for key, devices in (
        (SERVER_DEVICES_KEY, request.server_devices),
        (LEARNER_DEVICES_KEY, request.learner_devices),
    ):
        if devices:
            problems.append(
                ConfigProblem(
                    key,
                    list(devices),
                    "--cpu runs every process on the CPU; drop the device lists (--server-devices / "
                    "--learner-devices, launch.*_devices) and use --servers N / --learner-procs N",
                )
            )
    if (request.tensor_parallel_size or 1) != 1:
        problems.append(
            ConfigProblem(
                TP_KEY,
                request.tensor_parallel_size,
                "CPU rollout engines run unsharded: with --cpu drop --tensor-parallel-size (set "
                "launch.tensor_parallel_size: 1)",
            )
        )
    return problems


def _config_problems(
    request: LaunchRequest, cfg: RollmatchConfig, named_servers: list[ServerEndpoint]
) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    rm = cfg.rollout
    if cfg.custom.trainer_variant == "sft":
        problems.append(
            ConfigProblem(
                "custom.trainer_variant",
                "sft",
                "stage-1 SFT makes no rollouts, so it needs no rollout servers; run `rollmatch train` "
                "(under torchrun for several ranks)",
            )
        )
    elif rm.rollout_backend != "vllm" or rm.vllm.mode != "server":
        problems.append(
            ConfigProblem(
                f"{VLLM_KEY}.mode",
                rm.vllm.mode if rm.rollout_backend == "vllm" else f"rollout_backend={rm.rollout_backend}",
                f"launch starts rollout servers for server mode: set {VLLM_KEY}.mode: server and "
                f"{ROLLOUT_KEY}.rollout_backend: vllm, or run `rollmatch train` for "
                "colocated / hf rollouts",
            )
        )
    if request.engine == "hf" and request.starts_servers:
        if tensor_parallel_size(request, cfg.launch) > 1:
            problems.append(
                ConfigProblem(
                    ENGINE_KEY,
                    "hf",
                    "the hf server engine runs unsharded: use --engine vllm (launch.engine: vllm), or tensor "
                    "parallel 1",
                )
            )
        if rm.vllm.enable_lora:
            problems.append(
                ConfigProblem(
                    ENGINE_KEY,
                    "hf",
                    f"the hf server engine cannot serve adapters ({VLLM_KEY}.enable_lora is true): "
                    f"use --engine vllm (launch.engine: vllm), or set {VLLM_KEY}.enable_lora: false",
                )
            )
    problems += _named_server_problems(request, cfg, named_servers)
    return problems


def _named_server_problems(
    request: LaunchRequest, cfg: RollmatchConfig, named_servers: list[ServerEndpoint]
) -> list[ConfigProblem]:
    urls = [e.base_url for e in named_servers]
    if cfg.launch.nodes.count > 1 and named_servers:
        return [
            ConfigProblem(
                SERVERS_KEY,
                urls,
                f"{cfg.launch.nodes.count} nodes: launch lists every node's servers itself (launch.nodes.hosts, "
                "launch.port_base); leave this list empty",
            )
        ]
    if request.learner_only:
        if named_servers:
            return []
        return [
            ConfigProblem(
                SERVERS_KEY,
                None,
                "--learner-only starts no servers: list the running ones here (the learner.yaml that "
                "`rollmatch launch --servers-only` writes under <output_dir>/launch/ does)",
            )
        ]
    problems = [
        ConfigProblem(SERVERS_KEY, url, "launch starts plain-HTTP servers: name them with http://")
        for url in urls
        if not url.startswith("http://")
    ]
    hosts = {urlparse(url).hostname for url in urls}
    wanted = derive_layout(request, cfg).num_servers
    if len(hosts) > 1 and len(urls) != wanted:
        problems.append(
            ConfigProblem(
                SERVERS_KEY,
                urls,
                f"the config names {len(hosts)} hosts for {len(urls)} server(s) but launch starts {wanted}: "
                "name one host (every server binds it), one entry per started server, or no servers "
                "(127.0.0.1)",
            )
        )
    return problems


def _devices_text(devices: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(d) for d in devices)
