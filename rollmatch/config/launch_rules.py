"""Rules of the ``launch:`` section that need only the config: devices, tensor parallel size and nodes.

Owns: :func:`launch_problems` (one of the static rules every loader runs, so a layout that cannot run
is refused before anything starts, by ``rollmatch launch``, ``check-config`` and ``train`` alike).
The ``rollmatch launch`` flags that name these keys (``--server-devices``, ``--tensor-parallel-size``,
...) reach them as ``launch.*`` overrides, so a flag and its key share one rule and one message.
Leaves out: what only the launcher knows (``--cpu``, the roles, the devices a machine really has:
``rollmatch.launch.layout``).
"""

from __future__ import annotations

import ipaddress

from rollmatch.config.schema import LaunchSettings, RollmatchConfig
from rollmatch.errors import ConfigProblem

_KEY = "launch"


def launch_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`launch` (its keys or the `rollmatch launch` flags that set them): server and learner devices each listed
    once, disjoint where a node runs both roles, server devices a multiple of `tensor_parallel_size`,
    `servers_per_node` / `learner_procs_per_node` beside devices matching them; with `nodes.count` > 1: `nodes.rank` < count, one concrete
    host per node, `nodes.rendezvous` HOST:PORT on a learner node, `port_base` set, `nodes.roles` one per
    node; `slurm`: CPUs asked for one way or the other."""
    launch = cfg.launch
    return _device_problems(launch) + _node_problems(launch) + _slurm_problems(launch)


def launch_world_size(cfg: RollmatchConfig) -> int | None:
    """The learner world size ``rollmatch launch`` gives a server-mode rollout config: learner ranks per
    node (``launch.learner_devices``, or ``learner_procs_per_node`` with ``--cpu``) times the nodes that run
    the learner. None where the config leaves it to torchrun (stage-1 SFT, colocated or hf rollouts) or
    names no learner ranks."""
    rollout = cfg.rollout
    if (
        cfg.custom.trainer_variant == "sft"
        or rollout.rollout_backend != "vllm"
        or rollout.vllm.mode != "server"
    ):
        return None
    nodes = cfg.launch.nodes
    learner_nodes = sum(1 for rank in range(nodes.count) if nodes.role(rank) != "servers")
    per_node = len(cfg.launch.learner_devices) or cfg.launch.learner_procs_per_node or 0
    return per_node * max(learner_nodes, 1) or None


def endpoint_problem(key: str, value: str) -> str | None:
    """Why ``value`` is not a usable ``HOST:PORT`` (None when it is)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"write HOST:PORT, e.g. {key}=node0.cluster:29500"
    return _wildcard(host.strip("[]"))


# ------------------------------------------------------------------------------------ private helpers
def _device_problems(launch: LaunchSettings) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    for name in ("server_devices", "learner_devices"):
        devices: list[int] = getattr(launch, name)
        if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
            problems.append(
                ConfigProblem(
                    f"{_KEY}.{name}", devices, "list device indices >= 0, each once, e.g. [0, 1, 2, 3]"
                )
            )
    shared = sorted(set(launch.server_devices) & set(launch.learner_devices))
    both = [r for r in range(launch.nodes.count) if launch.nodes.role(r) == "both"]
    if shared and both:  # disjoint per node: a node that runs one role may use the same indices
        problems.append(
            ConfigProblem(
                f"{_KEY}.learner_devices",
                launch.learner_devices,
                f"device(s) {shared} are also in {_KEY}.server_devices {launch.server_devices}, and node(s) "
                f"{both} run both roles; give each role its own devices (or split the roles over the nodes "
                f"with {_KEY}.nodes.roles)",
            )
        )
    tp, count = launch.tensor_parallel_size, len(launch.server_devices)
    if count % tp:
        problems.append(
            ConfigProblem(
                f"{_KEY}.server_devices",
                launch.server_devices,
                f"{count} device(s) do not split into servers of {_KEY}.tensor_parallel_size {tp}; give a "
                f"multiple of {tp} devices, or another tensor_parallel_size",
            )
        )
    elif count and launch.servers_per_node is not None and launch.servers_per_node != count // tp:
        problems.append(
            ConfigProblem(
                f"{_KEY}.servers_per_node",
                launch.servers_per_node,
                f"{count} server device(s) in tensor parallel {tp} make {count // tp} server(s) per node; set "
                f"servers_per_node: {count // tp} or null (on GPUs the devices decide)",
            )
        )
    learners = len(launch.learner_devices)
    if learners and launch.learner_procs_per_node is not None and launch.learner_procs_per_node != learners:
        problems.append(
            ConfigProblem(
                f"{_KEY}.learner_procs_per_node",
                launch.learner_procs_per_node,
                f"{learners} learner device(s) run {learners} rank(s) per node; set learner_procs_per_node: "
                f"{learners} or null (on GPUs the devices decide)",
            )
        )
    return problems


def _node_problems(launch: LaunchSettings) -> list[ConfigProblem]:
    nodes, key = launch.nodes, f"{_KEY}.nodes"
    problems: list[ConfigProblem] = []
    if nodes.rank >= nodes.count:
        problems.append(
            ConfigProblem(
                f"{key}.rank",
                nodes.rank,
                f"node ranks run 0..{nodes.count - 1} ({key}.count {nodes.count}); set {key}.rank=<this node's "
                "index> on each node",
            )
        )
    if nodes.roles and len(nodes.roles) != nodes.count:
        problems.append(
            ConfigProblem(
                f"{key}.roles",
                nodes.roles,
                f"give one role per node ({nodes.count}: servers, learner or both), or [] for both everywhere",
            )
        )
    elif nodes.roles and not any(role != "servers" for role in nodes.roles):
        problems.append(
            ConfigProblem(
                f"{key}.roles", nodes.roles, "no node runs the learner: make one `learner` or `both`"
            )
        )
    for host in nodes.hosts:
        if (why := _wildcard(host)) is not None:
            problems.append(ConfigProblem(f"{key}.hosts", host, why))
    if nodes.rendezvous is not None and (why := endpoint_problem(f"{key}.rendezvous", nodes.rendezvous)):
        problems.append(ConfigProblem(f"{key}.rendezvous", nodes.rendezvous, why))
    if nodes.count == 1:
        return problems
    if len(nodes.hosts) != nodes.count:
        problems.append(
            ConfigProblem(
                f"{key}.hosts",
                nodes.hosts,
                f"{nodes.count} nodes need {nodes.count} addresses in rank order, e.g. [node0.cluster, "
                "node1.cluster] (`rollmatch launch --emit slurm` fills them from SLURM_JOB_NODELIST)",
            )
        )
    if nodes.rendezvous is None:
        problems.append(
            ConfigProblem(
                f"{key}.rendezvous",
                None,
                f"{nodes.count} nodes need the learner's rendezvous: set {key}.rendezvous: HOST:PORT (a learner "
                "node's address and a free port, the same on every node)",
            )
        )
    if (
        nodes.rendezvous is not None
        and len(nodes.hosts) == nodes.count
        and not endpoint_problem(f"{key}.rendezvous", nodes.rendezvous)
    ):
        rdzv_host, _, rdzv_port = nodes.rendezvous.rpartition(":")
        hub_host, heartbeat = nodes.heartbeat_endpoint()
        if heartbeat >= 65536 or (heartbeat == int(rdzv_port) and rdzv_host == hub_host):
            problems.append(
                ConfigProblem(
                    f"{key}.heartbeat_port",
                    nodes.heartbeat_port,
                    f"node 0 collects the heartbeat at port {heartbeat}, which is not a free port beside the "
                    f"rendezvous {nodes.rendezvous}: set {key}.heartbeat_port to another port",
                )
            )
    if (
        nodes.rendezvous is not None
        and nodes.roles
        and len(nodes.roles) == nodes.count == len(nodes.hosts)
        and not endpoint_problem(f"{key}.rendezvous", nodes.rendezvous)
    ):
        rdzv_host = nodes.rendezvous.rpartition(":")[0].strip("[]")
        servers_only = [r for r, h in enumerate(nodes.hosts) if h == rdzv_host and nodes.role(r) == "servers"]
        learner_hosts = [h for r, h in enumerate(nodes.hosts) if nodes.role(r) != "servers"]
        if servers_only and rdzv_host not in learner_hosts:
            problems.append(
                ConfigProblem(
                    f"{key}.rendezvous",
                    nodes.rendezvous,
                    f"{rdzv_host} is node {servers_only[0]}, which runs only servers: nothing hosts the learner's "
                    f"rendezvous there; name a learner node, e.g. {learner_hosts[0]}:{nodes.rendezvous.rpartition(':')[2]}",
                )
            )
    if launch.port_base is None:
        problems.append(
            ConfigProblem(
                f"{_KEY}.port_base",
                None,
                f"{nodes.count} nodes need fixed ports (every node lists every server): set {_KEY}.port_base, "
                "e.g. 8000",
            )
        )
    return problems


def _slurm_problems(launch: LaunchSettings) -> list[ConfigProblem]:
    slurm, key = launch.slurm, f"{_KEY}.slurm"
    problems: list[ConfigProblem] = []
    if not slurm.exclusive and slurm.cpus_per_task is None:
        problems.append(
            ConfigProblem(
                f"{key}.cpus_per_task",
                None,
                f"{key}.exclusive is false: set the CPUs each node's launch gets (e.g. 64); Slurm's default of "
                "one CPU would run every server, rank and actor thread of a node on one core",
            )
        )
    for option in slurm.options:
        if not option.startswith("--") or "\n" in option:
            problems.append(
                ConfigProblem(
                    f"{key}.options", option, "write one long sbatch option each, e.g. --partition=gpu"
                )
            )
    return problems


def _wildcard(host: str) -> str | None:
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        unspecified = not host
    if unspecified:
        return (
            "name the node's own address (what other nodes reach it at), never a wildcard: servers bind it and "
            "the weight-sync group's master is there"
        )
    return None
