"""``rollmatch launch --emit slurm``: the sbatch script that runs one launch per node of a config.

Owns: :func:`slurm_script`. The script asks Slurm for ``launch.nodes.count`` nodes and starts one
``srun`` step per node (its role in a comment), each running ``rollmatch launch`` on the same config
with its node rank; the node addresses (``launch.nodes.hosts``) and the learner's rendezvous
(``launch.nodes.rendezvous``) come from ``SLURM_JOB_NODELIST`` when the job runs, and one API key is
made for the whole job (or taken from ``ROLLMATCH_API_KEY``). The first step to fail stops the others.
Leaves out: what each launch starts (``launch.plan``); Slurm itself is never called here.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rollmatch.config.schema import RollmatchConfig
from rollmatch.launch.layout import LaunchRequest, derive_layout, with_settings

DEFAULT_RDZV_PORT = 29500
_ROLE_TEXT = {"servers": "rollout servers", "learner": "learner", "both": "rollout servers + learner"}


def slurm_script(cfg: RollmatchConfig, request: LaunchRequest, *, python: str = sys.executable) -> str:
    """The sbatch script of ``request`` (its flags written as ``launch.*`` overrides of the same config)."""
    settings, nodes = cfg.launch, cfg.launch.nodes
    count = nodes.count
    layout = derive_layout(request, cfg)
    learner_nodes = [r for r in range(count) if nodes.role(r) != "servers"]
    rdzv_port = nodes.rendezvous.rpartition(":")[2] if nodes.rendezvous else str(DEFAULT_RDZV_PORT)
    gpus = max(
        len(node.server_devices if node.starts_servers else ())
        + len(node.learner_devices if node.starts_learner else ())
        for node in (with_settings(request, settings, r) for r in range(count))
    )
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
        "#SBATCH --job-name=rollmatch",
        f"#SBATCH --nodes={count}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={gpus}"] if gpus and not request.cpu else []),
        f"#SBATCH --output={out}/slurm-%j.out",
        "set -euo pipefail",
        "",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'if [ "${{#HOSTS[@]}}" -ne {count} ]; then',
        f'  echo "rollmatch: the config runs {count} node(s) (launch.nodes.count), Slurm gave ${{#HOSTS[@]}}: '
        '$SLURM_JOB_NODELIST" >&2',
        "  exit 2",
        "fi",
        'NODE_HOSTS="[$(IFS=,; echo "${HOSTS[*]}")]"',
        f'RDZV="${{HOSTS[{learner_nodes[0]}]}}:{rdzv_port}"',
        f'export ROLLMATCH_API_KEY="${{ROLLMATCH_API_KEY:-$({shlex.quote(python)} -c '
        "'import secrets; print(secrets.token_urlsafe(32))')}\"",
        "",
        "LAUNCH=(",
        *(f"  {shlex.quote(part)}" for part in command),
        f"  launch.nodes.count={count}",
        '  "launch.nodes.hosts=$NODE_HOSTS"',
        '  "launch.nodes.rendezvous=$RDZV"',
        ")",
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
    footer = [
        "",
        "# the first launch that fails stops the others (SIGTERM: each tears down its own processes)",
        "status=0",
        'for _ in "${PIDS[@]}"; do',
        "  if ! wait -n; then",
        "    status=1",
        '    kill -TERM "${PIDS[@]}" 2>/dev/null || true',
        "  fi",
        "done",
        'exit "$status"',
    ]
    return "\n".join([*header, *steps, *footer]) + "\n"
