"""The ``launch`` section of the schema: which devices run rollout servers and the learner, on which
nodes, and what a Slurm script asks for.

Owns the pydantic models; every key's default and description lives here once. Leaves out: the rules
of these keys (``config.launch_rules``) and the launcher itself (``rollmatch.launch``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollmatch.config.section import Section

# -------------------------------------------------------------------------------------------- launch
NodeRole = Literal["servers", "learner", "both"]


class NodesConfig(Section):
    """The machines one `rollmatch launch` per node spans (docs/runbook.md, "Launch")."""

    count: int = Field(1, gt=0, description="Nodes taking part; one `rollmatch launch` runs on each.")
    rank: int = Field(
        0, ge=0, description="This node's index in 0..count-1 (set per node, e.g. `launch.nodes.rank=1`)."
    )
    hosts: list[str] = Field(
        default_factory=list,
        description="Each node's address, in rank order (servers on node i bind hosts[i]; the learner reaches them "
        "there); needed when count > 1. Empty: one node on 127.0.0.1.",
    )
    rendezvous: str | None = Field(
        None,
        description="HOST:PORT of the learner's torchrun c10d rendezvous (a learner node's address); needed when "
        "count > 1. null on one node: 127.0.0.1 and a free port (or the last of --port-base's).",
    )
    rendezvous_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="torchrun's `--rdzv-id`: two jobs whose learners meet at one HOST:PORT join only their own "
        "rendezvous. null: a random id on one node; on several nodes `rollmatch-<hash of training.output_dir "
        "and the rendezvous>` (the same on every node). The script of `--emit slurm` sets the Slurm job id.",
    )
    roles: list[NodeRole] = Field(
        default_factory=list,
        description="What each node runs, in rank order: `servers`, `learner` or `both`. Empty: every node runs both.",
    )
    join_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="How long torchrun waits for every learner node to join the rendezvous, and every launcher "
        "for every node's first heartbeat.",
    )
    heartbeat_port: int | None = Field(
        None,
        ge=1024,
        lt=65536,
        description="Port on hosts[0] where node 0's launcher collects every node's heartbeat (count > 1). "
        "null: the rendezvous port + 1.",
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="A node silent this long is lost: every other node stops its processes and exits non-zero "
        "naming it (count > 1).",
    )

    def heartbeat_endpoint(self) -> tuple[str, int]:
        """Where node 0's launcher collects the heartbeats (``count`` > 1, hosts and rendezvous set)."""
        port = self.heartbeat_port or int((self.rendezvous or ":0").rpartition(":")[2]) + 1
        return self.hosts[0], port

    def role(self, rank: int) -> NodeRole:
        """What node ``rank`` runs (``both`` when ``roles`` is empty)."""
        return self.roles[rank] if self.roles else "both"


class SlurmSettings(Section):
    """What the script of `rollmatch launch --emit slurm` asks Slurm for, per node (docs/runbook.md, "Slurm").
    `sbatch --<option>=... job.sbatch` still overrides any of them at submission."""

    exclusive: bool = Field(
        True,
        description="`#SBATCH --exclusive`: every CPU of each node for its servers, learner ranks and actor "
        "threads. false: set cpus_per_task (Slurm's default is one CPU for the whole node's launch).",
    )
    cpus_per_task: int | None = Field(
        None,
        gt=0,
        description="`#SBATCH --cpus-per-task`: CPUs per node (one task per node). null: not written.",
    )
    mem: str | None = Field(
        "0",
        pattern=r"^[0-9]+[KMGT]?$",
        description="`#SBATCH --mem` per node, e.g. `480G`; `0`: all of each node's memory. null: not written "
        "(the partition's default, often a few GB per CPU).",
    )
    signal_warning_s: int | None = Field(
        120,
        gt=0,
        description="`#SBATCH --signal=USR1@<s>`: this long before the time limit Slurm signals every step (each "
        "node's `rollmatch launch`; not `B:USR1`, which would signal only the batch shell); the learner saves a "
        "complete checkpoint and stops, and the job requeues itself (`requeue`). Leave it above one save + one step "
        "+ `stage2_ab.channel_b.async.max_wait_s`: the learner measures the first two and warns when it is not. "
        "null: no warning signal.",
    )
    requeue: bool = Field(
        True,
        description="`#SBATCH --requeue`: a preempted job, or one stopped by the warning signal, goes back to the "
        "queue and resumes from its latest complete checkpoint (`training.resume_from_checkpoint=latest`); without "
        "it, resubmit the script: `auto` (the default) resumes as well.",
    )
    options: list[str] = Field(
        default_factory=list,
        description="Further `#SBATCH` options, written as given, e.g. [--partition=gpu, --time=24:00:00, "
        "--account=vision].",
    )


class LaunchSettings(Section):
    """`rollmatch launch`: which devices run rollout servers and the learner, on which nodes. The launch
    flags named beside a key set it (`--server-devices 0,1` is the override `launch.server_devices=[0,1]`,
    applied last), so the rules below judge flags and keys alike."""

    server_devices: list[int] = Field(
        default_factory=list,
        description="GPUs of the rollout servers on each node that runs servers (`--server-devices`).",
    )
    learner_devices: list[int] = Field(
        default_factory=list,
        description="GPUs of the learner on each node that runs it, one torchrun rank each (`--learner-devices`).",
    )
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="GPUs per rollout server; servers per node = server devices / this (`--tensor-parallel-size`). "
        "Its own default, independent of the colocated engine's `vllm.tensor_parallel_size`.",
    )
    servers_per_node: int | None = Field(
        None,
        gt=0,
        description="With `--cpu`: servers per server node (default 1, `--servers`). On GPUs the devices decide; "
        "when set it must equal server devices / tensor_parallel_size.",
    )
    learner_procs_per_node: int | None = Field(
        None,
        gt=0,
        description="With `--cpu`: learner ranks per learner node (default 1, `--learner-procs`). On GPUs the "
        "devices decide; when set beside learner devices it must equal their count.",
    )
    port_base: int | None = Field(
        None,
        ge=1024,
        lt=65536,
        description="Fixed ports from here: server i gets HTTP port_base+2i and group port +2i+1 on its node "
        "(`--port-base`). Needed when nodes.count > 1 (every node must know every server's port); null: free ports.",
    )
    engine: Literal["vllm", "hf"] = Field("vllm", description="Rollout server engine (`--engine`).")
    grace_s: float = Field(
        10.0, ge=0.0, description="Seconds between SIGTERM and SIGKILL at teardown (`--grace-s`)."
    )
    restart_servers: int = Field(
        0,
        ge=0,
        description="Restarts per rollout server that exits or stops answering /health/ for "
        "`vllm.server.timeout_s`, on the same devices and port, after a backoff (`restart_backoff_s`, doubled per "
        "restart of that server, at most 30 s); one that "
        "keeps dying is given up (exit 3). 0: a dead server ends the launch. Pair with "
        "`vllm.server.min_healthy` so the learner trains on while it is away (docs/runbook.md 'When a server "
        "dies').",
    )
    restart_backoff_s: float = Field(
        1.0,
        ge=0.0,
        le=30.0,
        description="Seconds before a server's first restart (`restart_servers`): 1, 2, 4 ... 30 s for the default. "
        "Lower only where a server can bind its port again at once (tests); a port still held makes the restart fail.",
    )
    nodes: NodesConfig = Field(default_factory=NodesConfig)
    slurm: SlurmSettings = Field(default_factory=SlurmSettings)
