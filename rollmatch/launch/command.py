"""``rollmatch launch``: read the config, refuse what cannot run, print the plan, then run it.

Owns: :func:`launch_command` (top to bottom: config (the flags that name a ``launch.*`` key applied as
its last overrides, checked by the config's rules) -> request (``--cpu``, roles) -> checks ->
``--emit slurm`` (``launch.slurm``), or ports and key -> plan -> dry run (every node's plan) or
:func:`~rollmatch.launch.supervisor.run_plan` (this node's)) and where the API key comes from. Leaves out:
layout rules (``launch.layout``), commands (``launch.plan``) and processes (``launch.supervisor``).

API key: every launch that starts servers generates a fresh key (``secrets.token_urlsafe``) and hands
it to every server and the learner in the environment (``ROLLMATCH_API_KEY``), never on a command
line, never printed. Several nodes share one key: ``ROLLMATCH_API_KEY`` from the environment, required
unless every node is a loopback address. ``--servers-only`` also writes it to
``<output_dir>/launch/api_key`` (mode 0600), where a later ``--learner-only`` launch on the same output directory finds it (unless
``ROLLMATCH_API_KEY`` is set in its environment).

One launch per output directory: its launch record (``launch/pids.json``; ``pids-learner.json`` for
``--learner-only``) names the launcher by pid and start time. A launch refuses to start while that
launcher runs; a record whose launcher is gone (killed before its teardown) is taken over, and
whatever it left running is stopped first (every process is recorded with its start time, so a
reused pid is never signalled).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import NoReturn

from rollmatch.config.schema import NodesConfig
from rollmatch.data.input_checks import run_input_problems
from rollmatch.errors import ConfigError, ConfigProblem, LaunchError
from rollmatch.launch.heartbeat import NodeHeartbeat
from rollmatch.launch.layout import (
    LaunchRequest,
    derive_layout,
    launch_overrides,
    parse_devices,
    request_problems,
    with_settings,
)
from rollmatch.launch.plan import (
    API_KEY_ENV,
    LaunchConfig,
    LaunchPlan,
    build_plan,
    free_ports,
    load_launch_config,
    node_launch_dir,
    ports_needed,
    render_plan,
    sequential_ports,
)
from rollmatch.launch.processes import previous_launch, write_pids
from rollmatch.launch.slurm import slurm_placeholders, slurm_script
from rollmatch.launch.supervisor import PIDS_NAME, run_plan
from rollmatch.launch.watchdog import stop_trees

API_KEY_FILE = "api_key"


def launch_command(args: argparse.Namespace) -> int:
    """Build -> check -> plan -> run (or print, with ``--dry-run``); the exit code (see ``launch.supervisor``)."""
    emit = getattr(args, "emit", None)
    placeholders = slurm_placeholders(args.config, args.overrides) if emit == "slurm" else []
    overrides = (*args.overrides, *launch_overrides(flags_with_keys(args)))  # a flag wins over the file
    try:  # the flags' problems are the config's: one rule, one message, every one at once
        launch = load_launch_config(args.config, (*overrides, *placeholders))
    except ConfigError as exc:
        raise LaunchError(exc.problems) from None
    request = with_settings(request_from_args(args), launch.cfg.launch)
    planned = request.dry_run or request.cpu or emit is not None  # no devices needed here
    device_count, visible = (None, None) if planned else cuda_devices()
    problems = request_problems(
        request, launch.cfg, launch.named_servers, device_count=device_count, visible_devices=visible
    )
    if problems:
        raise LaunchError(problems)
    if emit == "slurm":
        script = slurm_script(launch.cfg, request)
        # sbatch opens --output before the job runs: its folder must exist at submission
        log_dir = Path(launch.cfg.training.output_dir).resolve() / "launch"
        log_dir.mkdir(parents=True, exist_ok=True)
        print(script, end="", flush=True)
        print(f"[launch] {log_dir} holds the job's log (#SBATCH --output)", file=sys.stderr, flush=True)
        return 0

    if request.dry_run:
        for rank in range(launch.cfg.launch.nodes.count):  # every node's commands, this one's included
            node = with_settings(request_from_args(args), launch.cfg.launch, rank)
            problems = request_problems(node, launch.cfg, launch.named_servers, device_count=None)
            if problems:
                raise LaunchError(problems)
            print(render_plan(_node_plan(launch, node, check_ports=False)[0]), end="", flush=True)
        print("dry run: nothing started, nothing written")
        return 0
    if launch.cfg.launch.nodes.count > 1:
        problems = own_host_problems(list(launch.cfg.launch.nodes.hosts), request.node_rank)
        if problems:
            raise LaunchError(problems)
    plan, launch_dir = _node_plan(launch, request, check_ports=True)
    print(render_plan(plan), end="", flush=True)
    pids_name = "pids-learner.json" if request.learner_only else PIDS_NAME
    claim_launch_dir(launch_dir / pids_name, grace_s=request.grace_s)
    # check-config's input checks (files, record lengths) before any server starts; a servers-only
    # node needs only the model. A refused launch leaves no claim behind.
    problems, _ = run_input_problems(launch.cfg)
    if request.servers_only:
        problems = [p for p in problems if p.key == "model.path"]
    if problems:
        (launch_dir / pids_name).unlink()
        raise LaunchError(problems)
    api_key = plan.servers[0].env.get(API_KEY_ENV) if plan.servers else None
    if request.servers_only and api_key is not None:
        _write_key_file(launch_dir / API_KEY_FILE, api_key)
    return run_plan(
        plan,
        grace_s=request.grace_s,
        pids_name=pids_name,
        heartbeat=_heartbeat(launch.cfg.launch.nodes, request, api_key),
    )


def exit_launcher(code: int) -> NoReturn:
    """End the ``rollmatch launch`` process with ``code`` once the command returned (its teardown done:
    children stopped, watchdog and heartbeat closed), skipping the interpreter's own teardown. The input
    checks import torch and transformers (thousands of modules), whose teardown took 1-3 s at every
    launcher exit and does nothing a finished launch needs; logging and output are flushed first.
    Only for the launcher's own process (``python -m rollmatch.cli launch``), never in-process callers."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _node_plan(launch: LaunchConfig, request: LaunchRequest, *, check_ports: bool) -> tuple[LaunchPlan, Path]:
    layout = derive_layout(request, launch.cfg)
    launch_dir = node_launch_dir(launch.cfg, request.node_rank)
    count = ports_needed(layout)
    if request.port_base is not None:
        ports = sequential_ports(request.port_base)(max(count, 1))
        if count:
            _check_port_base(request.port_base, ports[:count], check_free=check_ports)
    else:
        ports = free_ports(count)
    api_key = _launch_key(launch.cfg.launch.nodes, request, launch_dir)
    return build_plan(launch, request, layout, ports, api_key=api_key), launch_dir


def flags_with_keys(args: argparse.Namespace) -> dict[str, object]:
    """The launch flags that name a ``launch.*`` key, parsed (device lists as tuples; ``None``: not
    given); :func:`~rollmatch.launch.layout.launch_overrides` turns them into overrides."""
    problems: list[ConfigProblem] = []
    flags: dict[str, object] = {}
    for flag in ("server_devices", "learner_devices"):
        text = getattr(args, flag)
        try:
            flags[flag] = parse_devices(text) if text else None
        except ValueError as exc:
            problems.append(ConfigProblem(f"--{flag.replace('_', '-')}", text, str(exc)))
    if problems:
        raise LaunchError(problems)
    for flag in ("tensor_parallel_size", "servers", "learner_procs", "engine", "port_base", "grace_s"):
        flags[flag] = getattr(args, flag)
    return flags


def request_from_args(args: argparse.Namespace) -> LaunchRequest:
    """The flags without a config key (``--cpu``, the roles, ``--dry-run``) and the config's own
    overrides as a :class:`LaunchRequest`; :func:`~rollmatch.launch.layout.with_settings` fills in the
    node's ``launch:`` values (the flags with keys among them)."""
    return LaunchRequest(
        config=args.config,
        overrides=tuple(args.overrides),
        cpu=args.cpu,
        servers_only=args.servers_only,
        learner_only=args.learner_only,
        dry_run=args.dry_run,
    )


def cuda_devices() -> tuple[int, str | None]:
    """CUDA devices this process sees, and its own ``CUDA_VISIBLE_DEVICES`` (None when unset)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count, os.environ.get("CUDA_VISIBLE_DEVICES")


def claim_launch_dir(pids_path: Path, *, grace_s: float) -> None:
    """Make ``pids_path`` this launch's record, or refuse while the launcher that wrote it runs.

    Two launches on one output directory would overwrite each other's logs, config and pids. A record
    left by a launcher that died before its teardown is taken over (one ``[launch]`` line says so) once
    what that launch left running is stopped (SIGTERM, SIGKILL after ``grace_s``).
    """
    previous = previous_launch(pids_path)
    if previous is not None and previous.launcher_alive:
        still = f" ({', '.join(previous.running)})" if previous.running else ""
        raise LaunchError(
            [
                ConfigProblem(
                    "training.output_dir",
                    str(pids_path.parent.parent),
                    f"a launch (pid {previous.launcher}) still runs here{still}; stop it first "
                    f"(`kill {previous.launcher}` stops it and its processes), or give this run another "
                    "training.output_dir",
                )
            ]
        )
    if previous is not None and previous.stale:
        left = f"; stopping what it left running: {', '.join(previous.running)}" if previous.running else ""
        _say(f"taking over {pids_path}: the launch that wrote it (pid {previous.launcher}) is gone{left}")
        stop_trees(previous.processes, grace_s, _say)
    write_pids(pids_path, [], {})  # claimed: a launch started from now on sees this one


def own_host_problems(hosts: list[str], rank: int) -> list[ConfigProblem]:
    """This node's address as this node resolves it: one that resolves to loopback (Debian maps the
    machine's own name to 127.0.1.1 in /etc/hosts) while the other nodes are elsewhere would bind the
    heartbeat hub, servers and rendezvous where no other node reaches them, and fail only after
    ``launch.nodes.join_timeout_s``; refused at start, naming the host. Every host on loopback (one
    machine playing several nodes) is fine."""
    host = hosts[rank]
    mine = _resolved(host)
    if not mine or not all(ipaddress.ip_address(a).is_loopback for a in mine):
        return []
    if all(_resolved(h) and all(ipaddress.ip_address(a).is_loopback for a in _resolved(h)) for h in hosts):
        return []
    return [
        ConfigProblem(
            "launch.nodes.hosts",
            host,
            f"node {rank}'s address {host!r} resolves to {', '.join(sorted(mine))} (loopback) on this node, so "
            "its servers, heartbeat hub and rendezvous would listen where the other nodes cannot reach them: "
            "name an address the other nodes reach (its IP, or a name that resolves to it here too; check "
            f"`getent hosts {host}` and /etc/hosts)",
        )
    ]


# ------------------------------------------------------------------------------------ private helpers
def _resolved(host: str) -> set[str]:
    """The IPv4/IPv6 addresses ``host`` resolves to here (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return set()
    return {str(info[4][0]).split("%")[0] for info in infos}


def _check_port_base(base: int, ports: list[int], *, check_free: bool) -> None:
    if base < 1024 or ports[-1] > 65535:
        raise LaunchError(
            [
                ConfigProblem(
                    "--port-base",
                    base,
                    f"this launch needs ports {ports[0]}-{ports[-1]}; give a base in 1024..{65536 - len(ports)}",
                )
            ]
        )
    if not check_free:
        return
    busy = [port for port in ports if not _port_free(port)]
    if busy:
        raise LaunchError(
            [
                ConfigProblem(
                    "--port-base",
                    base,
                    f"port(s) {', '.join(map(str, busy))} of {ports[0]}-{ports[-1]} are in use; pick another "
                    "--port-base, or leave it out to use free ports",
                )
            ]
        )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _heartbeat(nodes: NodesConfig, request: LaunchRequest, key: str | None) -> NodeHeartbeat | None:
    """This node's side of the nodes' heartbeat (``launch.nodes``); None on one node."""
    if nodes.count == 1:
        return None
    _, port = nodes.heartbeat_endpoint()
    return NodeHeartbeat(
        node_rank=request.node_rank,
        hosts=list(nodes.hosts),
        port=port,
        timeout_s=nodes.heartbeat_timeout_s,
        join_timeout_s=nodes.join_timeout_s,
        key=key,
    )


def _say(message: str) -> None:
    print(f"[launch] {message}", flush=True)


def _launch_key(nodes: NodesConfig, request: LaunchRequest, launch_dir: Path) -> str | None:
    """A fresh key on one node; ``ROLLMATCH_API_KEY`` (or none) on several, which must share one key
    without a file; ``--learner-only``: :func:`_learner_only_key`."""
    if request.learner_only:
        return _learner_only_key(launch_dir)
    if nodes.count > 1:
        key = os.environ.get(API_KEY_ENV)
        if key or request.dry_run or all(h.startswith("127.") for h in nodes.hosts):
            return key or None
        raise LaunchError(
            [
                ConfigProblem(
                    f"${API_KEY_ENV}",
                    None,
                    f"{nodes.count} nodes share one key that servers and learner check: export the same "
                    f"{API_KEY_ENV} on every node (the script of `rollmatch launch --emit slurm` makes one per job)",
                )
            ]
        )
    return secrets.token_urlsafe(32)


def _learner_only_key(launch_dir: Path) -> str | None:
    """``--learner-only``: the environment's key, else the one ``--servers-only`` wrote, else none."""
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    key_file = launch_dir / API_KEY_FILE
    return key_file.read_text().strip() if key_file.is_file() else None


def _write_key_file(path: Path, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode on O_CREAT
