"""Rules of the ``launch:`` section that need only the config: devices, tensor parallel size and nodes.

Owns: :func:`launch_problems` (one of the static rules every loader runs, so a layout that cannot run
is refused before anything starts, by ``rollmatch launch``, ``check-config`` and ``train`` alike).
Leaves out: the command-line flags that override these keys and the devices a machine really has
(``rollmatch.launch.layout`` checks both once they are known).
"""

from __future__ import annotations

import ipaddress

from rollmatch.config.schema import LaunchSettings, RollmatchConfig
from rollmatch.errors import ConfigProblem

_KEY = "launch"


def launch_problems(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`launch`: server and learner devices disjoint, each listed once, server devices a multiple of
    `tensor_parallel_size`; with `nodes.count` > 1: `nodes.rank` < count, one concrete host per node,
    `nodes.rendezvous` HOST:PORT, `port_base` set, `nodes.roles` one per node."""
    launch = cfg.launch
    return _device_problems(launch) + _node_problems(launch)


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
    if shared:
        problems.append(
            ConfigProblem(
                f"{_KEY}.learner_devices",
                launch.learner_devices,
                f"device(s) {shared} are also in {_KEY}.server_devices {launch.server_devices}; give each role "
                "its own devices",
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
