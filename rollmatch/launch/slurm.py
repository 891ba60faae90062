"""``rollmatch launch --emit slurm``: the sbatch script that runs one launch per node of a config.

Owns: :func:`slurm_script`, :func:`slurm_placeholders` (a config may leave hosts and rendezvous to
the script) and :func:`node_devices`. The script asks Slurm for ``launch.nodes.count``
nodes with the CPUs, memory and GPUs each node's launch uses (``launch.slurm``; GPUs: the highest
device index any node uses, plus one), and starts one ``srun`` step per node (its role in a comment),
each running ``rollmatch launch`` on the same config with its node rank. When the job runs, the node
addresses (``launch.nodes.hosts``) come from ``SLURM_JOB_NODELIST``, the learner's rendezvous
(``launch.nodes.rendezvous``) is the first learner node at the config's port or one derived from the
job id, its id (``launch.nodes.rendezvous_id``) is the job id, and one API key is made for the whole
job (or taken from ``ROLLMATCH_API_KEY``).

Preemption: ``--signal=USR1@<launch.slurm.signal_warning_s>`` reaches every node's launcher; the
learner saves a complete checkpoint and stops, its launchers exit
:data:`~rollmatch.launch.supervisor.EXIT_PREEMPTED`, and the script requeues the job
(``launch.slurm.requeue``), which resumes from the latest complete checkpoint
(``training.resume_from_checkpoint=latest`` once ``SLURM_RESTART_COUNT`` > 0). A resubmitted script
(after a TIMEOUT, or with ``requeue: false``) resumes too: the key's default, ``auto``, goes on from the
newest complete checkpoint of ``training.output_dir`` (``config.resume``). Any other failing step
stops the others.
Leaves out: what each launch starts (``launch.plan``); Slurm itself is never called here.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollmatch.config.load import deep_merge, parse_overrides, read_config_layers
from rollmatch.config.schema import LaunchSettings, RollmatchConfig
from rollmatch.launch.layout import LaunchRequest, derive_layout, with_settings
from rollmatch.launch.supervisor import EXIT_PREEMPTED

# Without a rendezvous port in the config, the job's port is derived from its id in this range, so two
# jobs sharing a host rarely meet at one port (and, with their own ids, never join each other).
RDZV_PORT_SPAN = 10_000
_RDZV_PORT_BASES = (20_000, 40_000)  # the first whose range (and heartbeat port) misses the server ports
_PLACEHOLDER_HOST = "slurm-node-"
_PLACEHOLDER_PORT = 1  # never a rendezvous port anyone writes (below 1024)
_ROLE_TEXT = {"servers": "rollout servers", "learner": "learner", "both": "rollout servers + learner"}


def node_devices(launch: LaunchSettings, request: LaunchRequest) -> list[tuple[int, ...]]:
    """The device indices each node's launch uses (its role's lists), in node order."""
    used = []
    for rank in range(launch.nodes.count):
        node = with_settings(request, launch, rank)
        used.append(
            (
                *(node.server_devices if node.starts_servers else ()),
                *(node.learner_devices if node.starts_learner else ()),
            )
        )
    return used


def slurm_placeholders(config: str, overrides: Sequence[str]) -> list[str]:
    """Overrides that stand in for what the script fills in when the job runs, where the config leaves
    it out: ``launch.nodes.hosts`` (from ``SLURM_JOB_NODELIST``) and ``launch.nodes.rendezvous`` (the
    first learner node, at a port derived from the job id). Never written into the script."""
    merged: dict[str, Any] = {}
    for _, layer in read_config_layers(Path(config)):
        merged = deep_merge(merged, layer)
    merged = deep_merge(merged, parse_overrides(overrides)[0])
    nodes = (merged.get("launch") or {}).get("nodes") or {}
    count, roles = nodes.get("count") or 1, nodes.get("roles") or []
    if not isinstance(count, int) or count < 2:
        return []
    placeholders = []
    if not nodes.get("hosts"):
        placeholders.append(
            f"launch.nodes.hosts=[{','.join(f'{_PLACEHOLDER_HOST}{r}' for r in range(count))}]"
        )
    if not nodes.get("rendezvous"):
        first = next((r for r, role in enumerate(roles) if role != "servers"), 0)
        placeholders.append(f"launch.nodes.rendezvous={_PLACEHOLDER_HOST}{first}:{_PLACEHOLDER_PORT}")
    return placeholders


def slurm_script(cfg: RollmatchConfig, request: LaunchRequest, *, python: str = sys.executable) -> str:
    """The sbatch script of ``request`` (its flags written as ``launch.*`` overrides of the same config);
    ``cfg`` may hold :func:`slurm_placeholders`."""
    nodes, slurm = cfg.launch.nodes, cfg.launch.slurm
    count = nodes.count
    layout = derive_layout(request, cfg)
    learner_nodes = [r for r in range(count) if nodes.role(r) != "servers"]
    # --gpus-per-node is a count, devices are indices: a node using device 7 needs 8 GPUs.
    gpus = 0 if request.cpu else max((max(d) + 1 for d in node_devices(cfg.launch, request) if d), default=0)
    fixed = [
        f"launch.tensor_parallel_size={layout.tensor_parallel_size}",
        f"launch.engine={request.engine}",
        f"launch.grace_s={request.grace_s:g}",
    ]
    if not request.cpu:
        fixed += [
            f"launch.server_devices=[{','.join(map(str, request.server_devices))}]",
            f"launch.learner_devices=[{','.join(map(str, request.learner_devices))}]",
        ]
    else:
        fixed += [f"launch.servers_per_node={request.servers or 1}"]
        fixed += [f"launch.learner_procs_per_node={request.learner_procs or 1}"]
    if request.port_base is not None:
        fixed.append(f"launch.port_base={request.port_base}")
    command = [python, "-m", "rollmatch.cli", "launch", str(Path(request.config).resolve())]
    command += [*request.overrides, *fixed]
    flags = " --cpu" if request.cpu else ""  # after every override: they are positional
    out = Path(cfg.training.output_dir).resolve() / "launch"
    header = [
        "#!/bin/bash",
        f"# Written by `rollmatch launch --emit slurm`: {count} node(s), one `rollmatch launch` each, on",
        f"# {request.config}. Submit with `sbatch <this file>`; node ranks are positions in the allocation.",
        "# `sbatch --<option>=... <this file>` overrides any #SBATCH line below (or set launch.slurm.*).",
        "#SBATCH --job-name=rollmatch",
        f"#SBATCH --nodes={count}",
        "#SBATCH --ntasks-per-node=1",
        *_resource_lines(cfg, gpus),
        f"#SBATCH --output={out}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        *[f"#SBATCH {option}" for option in slurm.options],
        "set -euo pipefail",
        "",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'if [ "${{#HOSTS[@]}}" -ne {count} ]; then',
        f'  echo "rollmatch: the config runs {count} node(s) (launch.nodes.count), Slurm gave ${{#HOSTS[@]}}: '
        '$SLURM_JOB_NODELIST" >&2',
        "  exit 2",
        "fi",
        'NODE_HOSTS="[$(IFS=,; echo "${HOSTS[*]}")]"',
        *_rendezvous_lines(cfg, learner_nodes[0], layout.num_servers),
        f'export ROLLMATCH_API_KEY="${{ROLLMATCH_API_KEY:-$({shlex.quote(python)} -c '
        "'import secrets; print(secrets.token_urlsafe(32))')}\"",
        "",
        "LAUNCH=(",
        *(f"  {shlex.quote(part)}" for part in command),
        f"  launch.nodes.count={count}",
        '  "launch.nodes.hosts=$NODE_HOSTS"',
        '  "launch.nodes.rendezvous=$RDZV"',
        '  "launch.nodes.rendezvous_id=rollmatch-$SLURM_JOB_ID"',
        ")",
        "# a resubmitted job resumes as well: training.resume_from_checkpoint: auto (the default) goes on from",
        "# the newest complete checkpoint of training.output_dir",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then  # requeued: go on from the latest complete checkpoint',
        "  LAUNCH+=(training.resume_from_checkpoint=latest)",
        "fi",
        'echo "rollmatch: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${HOSTS[*]}; learner '
        'rendezvous $RDZV (id rollmatch-$SLURM_JOB_ID)"',
        "",
        "PIDS=()",
    ]
    steps = []
    for rank in range(count):
        steps += [
            f"# node {rank}: {_ROLE_TEXT[nodes.role(rank)]}",
            f'srun --nodes=1 --ntasks=1 --relative={rank} "${{LAUNCH[@]}}" launch.nodes.rank={rank}{flags} &',
            'PIDS+=("$!")',
        ]
    return "\n".join([*header, *steps, *_footer(slurm.requeue)]) + "\n"


# ------------------------------------------------------------------------------------ private helpers
def _resource_lines(cfg: RollmatchConfig, gpus: int) -> list[str]:
    slurm = cfg.launch.slurm
    lines = [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
    if slurm.exclusive:
        lines.append("#SBATCH --exclusive")
    if slurm.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={slurm.cpus_per_task}")
    if slurm.mem is not None:
        lines.append(f"#SBATCH --mem={slurm.mem}")
    if slurm.requeue:
        lines.append("#SBATCH --requeue")
    if slurm.signal_warning_s is not None:
        lines.append(f"#SBATCH --signal=USR1@{slurm.signal_warning_s}")
    return lines


def _rendezvous_lines(cfg: RollmatchConfig, first_learner: int, servers_per_node: int) -> list[str]:
    """``RDZV`` at the first learner node: the config's port, else one derived from the job id."""
    nodes = cfg.launch.nodes
    if nodes.rendezvous and nodes.rendezvous.rpartition(":")[2] != str(_PLACEHOLDER_PORT):
        return [f'RDZV="${{HOSTS[{first_learner}]}}:{nodes.rendezvous.rpartition(":")[2]}"']
    used = set()
    if cfg.launch.port_base is not None:  # the servers' HTTP + group ports
        used = set(range(cfg.launch.port_base, cfg.launch.port_base + 2 * max(servers_per_node, 1)))
    base = next(
        (b for b in _RDZV_PORT_BASES if not used & set(range(b, b + RDZV_PORT_SPAN + 1))),
        _RDZV_PORT_BASES[-1],
    )
    return [
        f"RDZV_PORT=$(({base} + SLURM_JOB_ID % {RDZV_PORT_SPAN}))  # the node-0 heartbeat listens on the next port",
        f'RDZV="${{HOSTS[{first_learner}]}}:$RDZV_PORT"',
    ]


def _footer(requeue: bool) -> list[str]:
    then = (
        [
            '  echo "rollmatch: stopped on the warning signal with a complete checkpoint: requeueing job '
            '$SLURM_JOB_ID"',
            '  scontrol requeue "$SLURM_JOB_ID"',
        ]
        if requeue
        else [
            '  echo "rollmatch: stopped on the warning signal with a complete checkpoint (launch.slurm.requeue '
            'is false: resubmit to resume)"'
        ]
    )
    return [
        "",
        f"# exit {EXIT_PREEMPTED}: the learner saved a checkpoint on the warning signal (SIGUSR1) and stopped;",
        "# any other failure stops the other steps (SIGTERM: each launch tears down its own processes)",
        "status=0",
        "preempted=0",
        'for _ in "${PIDS[@]}"; do',
        "  code=0",
        "  wait -n || code=$?",
        f'  if [ "$code" -eq {EXIT_PREEMPTED} ]; then',
        "    preempted=1",
        '  elif [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then',
        '    status="$code"',
        '    kill -TERM "${PIDS[@]}" 2>/dev/null || true',
        "  fi",
        "done",
        'if [ "$status" -eq 0 ] && [ "$preempted" -eq 1 ]; then',
        *then,
        "fi",
        'exit "$status"',
    ]
