"""Launch plans: exact dry-run output of a GPU layout, the learner's written config, pinned server flags,
ports, and the API key kept out of every printed line."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.cli import build_parser
from rollmatch.config.load import load_config
from rollmatch.errors import ConfigError, LaunchError
from rollmatch.launch.command import launch_command
from rollmatch.launch.layout import LaunchRequest, derive_layout
from rollmatch.launch.plan import (
    API_KEY_ENV,
    build_plan,
    free_ports,
    load_launch_config,
    ports_needed,
    render_plan,
    rendezvous_id,
    shell_line,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED_SERVER_CONFIG = REPO / "configs" / "stage2_ab_server.yaml"


def test_dry_run_prints_the_exact_gpu_plan_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "rollmatch.cli",
        "launch",
        str(SHIPPED_SERVER_CONFIG),
        f"training.output_dir={out}",
        "--server-devices",
        "0,1,2,3,4,5",
        "--learner-devices",
        "6,7",
        "--tensor-parallel-size",
        "2",
        "--port-base",
        "8000",
        "--dry-run",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    py, launch_dir = shlex.quote(sys.executable), out / "launch"
    env = "PYTHONUNBUFFERED=1 ROLLMATCH_API_KEY='<redacted>'"
    serve = "-m rollmatch.cli serve --model /ckpt/stage1 --host 127.0.0.1"
    pinned = (  # ... and the config's vLLM engine settings (vllm.gpu_memory_utilization 0.9)
        "--engine vllm --tensor-parallel-size 2 --max-model-len 4096 --dtype bfloat16 --gpu-memory-utilization 0.9"
    )
    # one node: torchrun's store binds a port of the OS's choosing (127.0.0.1:0), none of the port base's
    cfg = load_launch_config(str(SHIPPED_SERVER_CONFIG), [f"training.output_dir={out}"]).cfg
    rdzv_id = rendezvous_id(cfg, "127.0.0.1:0")
    expected = f"""\
rollmatch launch plan: 3 rollout server(s) (vllm engine, tensor parallel 2) + learner (torchrun, 2 process(es))
learner config: {launch_dir}/learner.yaml
  custom.extra.rollout_matching.vllm.server.servers:
    - {{base_url: http://127.0.0.1:8000, group_port: 8001}}
    - {{base_url: http://127.0.0.1:8002, group_port: 8003}}
    - {{base_url: http://127.0.0.1:8004, group_port: 8005}}
server-0 (log {launch_dir}/server-0.log):
  CUDA_VISIBLE_DEVICES=0,1 {env} {py} {serve} --port 8000 {pinned}
server-1 (log {launch_dir}/server-1.log):
  CUDA_VISIBLE_DEVICES=2,3 {env} {py} {serve} --port 8002 {pinned}
server-2 (log {launch_dir}/server-2.log):
  CUDA_VISIBLE_DEVICES=4,5 {env} {py} {serve} --port 8004 {pinned}
learner-0 (log {launch_dir}/learner-0.log):
  CUDA_VISIBLE_DEVICES=6,7 {env} {py} -m torch.distributed.run --nproc_per_node 2 --nnodes 1 --node-rank 0 \
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 --rdzv-id {rdzv_id} --rdzv-conf join_timeout=600 \
--local-addr 127.0.0.1 -m rollmatch.cli train {launch_dir}/learner.yaml
dry run: nothing started, nothing written
"""
    assert done.stdout == expected
    assert not out.exists()  # no launch directory, no config, no logs


def test_refusals_exit_2_with_every_problem_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "rollmatch.cli",
        "launch",
        str(SHIPPED_SERVER_CONFIG),
        f"training.output_dir={out}",
        "--server-devices",
        "0,1,2",
        "--learner-devices",
        "2,3",
        "--tensor-parallel-size",
        "2",
        "--dry-run",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2
    assert "launch refused before starting anything (2 problem(s))" in done.stderr
    assert (
        "device(s) [2] are also in launch.server_devices [0, 1, 2]" in done.stderr
    )  # --server-devices is it
    assert "3 device(s) do not split into servers of launch.tensor_parallel_size 2" in done.stderr
    assert done.stdout == "" and not out.exists()


def _plan(config_path: Path, *overrides: str, ports: list[int] | None = None, **request: Any) -> Any:
    launch = load_launch_config(str(config_path), overrides)
    req = LaunchRequest(config=str(config_path), **request)
    layout = derive_layout(req, launch.cfg)
    ports = ports or free_ports(ports_needed(layout))
    return build_plan(launch, req, layout, ports, api_key="s3cret-key", cpu_count=4)


def test_the_one_node_rendezvous_never_joins_a_store_that_took_its_port(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    """The launch picks its ports at start; torchrun binds the rendezvous only once the servers are healthy,
    tens of seconds later. Another process may take a picked port meanwhile (two launches at once: a
    pytest-xdist worker's test, another job), and torch's c10d backend then does not fail: it joins the
    store it finds there as a client, and the learner waits for a rendezvous that never comes (join_timeout,
    600 s) with an empty log. Here another run's c10d store holds the port the plan used to give the
    rendezvous (the one after the servers'); the learner's rendezvous, built from the plan's own torchrun
    arguments the way torchrun builds it, must host its own store, not write into that one."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    foreign = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    path = config_writer(tmp_path / "c.yaml", model="/m", train_jsonl="/t.jsonl", output_dir=tmp_path / "o")
    plan = _plan(path, cpu=True, servers=1, learner_procs=2, ports=[*free_ports(2), foreign.port])
    command = plan.learner.command

    def arg(flag: str) -> str:
        return command[command.index(flag) + 1]

    conf = dict(item.split("=", 1) for item in arg("--rdzv-conf").split(","))
    params = RendezvousParameters(
        backend=arg("--rdzv-backend"),
        endpoint=arg("--rdzv-endpoint"),
        run_id=arg("--rdzv-id"),
        min_nodes=1,
        max_nodes=1,
        local_addr=arg("--local-addr"),
        **conf,
    )
    _, store = create_backend(params)
    store.set("rollmatch-probe", "the learner's key")
    assert not foreign.check(["rollmatch-probe"]), "the rendezvous joined another process's store"


def test_the_learner_config_gets_the_started_servers_and_loads_back(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    path = config_writer(tmp_path / "c.yaml", model="/m", train_jsonl="/t.jsonl", output_dir=tmp_path / "o")
    plan = _plan(path, cpu=True, servers=2, learner_procs=2)
    endpoints = [(e.base_url, e.group_port) for e in plan.endpoints]
    ports = [int(url.rsplit(":", 1)[1]) for url, _ in endpoints] + [g for _, g in endpoints]
    rdzv = plan.learner.command[plan.learner.command.index("--rdzv-endpoint") + 1]
    assert rdzv == "127.0.0.1:0"  # torchrun's store picks its port when it binds it (see the next test)
    assert len(set(ports)) == 4  # every HTTP and group port distinct
    assert [s.url for s in plan.servers] == [url for url, _ in endpoints]

    from rollmatch.config.load import config_to_yaml

    written = tmp_path / "learner.yaml"
    written.write_text(config_to_yaml(plan.learner_config))
    loaded = load_config(str(written))
    assert [(s.base_url, s.group_port) for s in loaded.rollout.vllm.server.servers] == endpoints
    assert loaded.rollout.vllm.server.base_url is None and loaded.training.output_dir == str(tmp_path / "o")
    assert plan.learner.command[-1] == str(tmp_path / "o" / "launch" / "learner.yaml")
    assert plan.learner.command[:4] == (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node")


def test_a_healthy_floor_above_the_servers_a_launch_starts_is_refused_naming_the_key(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    path = config_writer(tmp_path / "c.yaml", model="/m", train_jsonl="/t.jsonl", output_dir=tmp_path / "o")
    key = "custom.extra.rollout_matching.vllm.server.min_healthy"
    assert len(_plan(path, f"{key}=2", cpu=True, servers=2, learner_procs=1).endpoints) == 2
    with pytest.raises(ConfigError, match=rf"{key} = 3: the run has 2 rollout server\(s\)"):
        _plan(path, f"{key}=3", cpu=True, servers=2, learner_procs=1)


def test_servers_pin_what_the_trainer_cross_checks(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    path = config_writer(
        tmp_path / "c.yaml",
        model="/m",
        train_jsonl="/t.jsonl",
        output_dir=tmp_path / "o",
        data={"min_pixels": 3136, "max_pixels": 6272},
    )
    lora = (
        "model.lora.enabled=true",
        "custom.extra.rollout_matching.vllm.enable_lora=true",
        "custom.extra.rollout_matching.vllm.max_model_len=3000",
        "model.dtype=bfloat16",
    )
    gpu = _plan(path, *lora, server_devices=(0,), learner_devices=(1,), tensor_parallel_size=1)
    flags = gpu.servers[0].command[4:]
    assert _flag(flags, "--model") == "/m" and _flag(flags, "--dtype") == "bfloat16"
    assert _flag(flags, "--max-model-len") == "3000"  # vllm.max_model_len wins over global_max_length
    assert _flag(flags, "--min-pixels") == "3136" and _flag(flags, "--max-pixels") == "6272"
    assert "--enable-lora" in flags
    cpu = _plan(path, "model.dtype=bfloat16", cpu=True, servers=1, learner_procs=1)
    flags = cpu.servers[0].command[4:]
    assert _flag(flags, "--dtype") == "float32"  # CPU engines run float32
    assert _flag(flags, "--max-model-len") == "1024" and "--enable-lora" not in flags
    assert cpu.servers[0].env["CUDA_VISIBLE_DEVICES"] == "" and cpu.servers[0].env["OMP_NUM_THREADS"] == "2"
    parsed = build_parser().parse_args(["serve", *gpu.servers[0].command[4:]])  # `serve` accepts every flag
    assert (parsed.min_pixels, parsed.max_pixels, parsed.enable_lora) == (3136, 6272, True)
    assert "--coord-frame" not in flags and parsed.coord_frame == "auto"  # the server resolves auto itself
    explicit = _plan(path, "data.coord_frame=norm1000", cpu=True, servers=1, learner_procs=1)
    flags = explicit.servers[0].command[4:]
    assert _flag(flags, "--coord-frame") == "norm1000"
    assert build_parser().parse_args(["serve", *flags]).coord_frame == "norm1000"


def test_the_api_key_travels_in_the_environment_only(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    path = config_writer(tmp_path / "c.yaml", model="/m", train_jsonl="/t.jsonl", output_dir=tmp_path / "o")
    plan = _plan(path, cpu=True)
    for spec in plan.processes:
        assert spec.env[API_KEY_ENV] == "s3cret-key"
        assert "s3cret-key" not in " ".join(spec.command)
        assert "s3cret-key" not in repr(spec) and "s3cret-key" not in shell_line(spec)
    assert "s3cret-key" not in render_plan(plan) and "ROLLMATCH_API_KEY='<redacted>'" in render_plan(plan)


def test_named_hosts_are_bound_and_ports_still_chosen_by_launch(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    servers = [{"base_url": "http://10.1.2.3:9000", "group_port": 9001}]
    path = config_writer(
        tmp_path / "c.yaml",
        model="/m",
        train_jsonl="/t.jsonl",
        output_dir=tmp_path / "o",
        custom={"extra": {"rollout_matching": {"vllm": {"server": {"servers": servers}}}}},
    )
    plan = _plan(
        path,
        ports=[7000, 7001, 7002, 7003, 7004],
        server_devices=(0, 1),
        learner_devices=(2,),
        tensor_parallel_size=1,
    )
    assert [(e.base_url, e.group_port) for e in plan.endpoints] == [
        ("http://10.1.2.3:7000", 7001),
        ("http://10.1.2.3:7002", 7003),
    ]
    assert _flag(plan.servers[1].command, "--host") == "10.1.2.3"


def test_learner_only_uses_the_named_servers_and_the_key_servers_only_wrote(
    tmp_path: Path, config_writer: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    servers = [{"base_url": "http://127.0.0.1:9000", "group_port": 9001}]
    path = config_writer(
        tmp_path / "c.yaml",
        model="/m",
        train_jsonl="/t.jsonl",
        output_dir=tmp_path / "o",
        custom={"extra": {"rollout_matching": {"vllm": {"server": {"servers": servers}}}}},
    )
    plan = _plan(path, learner_only=True, cpu=True, learner_procs=1)
    assert plan.servers == () and [e.base_url for e in plan.endpoints] == ["http://127.0.0.1:9000"]
    assert plan.learner is not None

    from rollmatch.launch.command import _learner_only_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _learner_only_key(tmp_path / "o" / "launch") is None
    (tmp_path / "o" / "launch").mkdir(parents=True)
    (tmp_path / "o" / "launch" / "api_key").write_text("from-file\n")
    assert _learner_only_key(tmp_path / "o" / "launch") == "from-file"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _learner_only_key(tmp_path / "o" / "launch") == "from-env"


def test_a_busy_port_base_is_refused_before_anything_starts(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    path = config_writer(tmp_path / "c.yaml", model="/m", train_jsonl="/t.jsonl", output_dir=tmp_path / "o")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        base = busy.getsockname()[1]
        args = build_parser().parse_args(["launch", str(path), "--cpu", "--port-base", str(base)])
        with pytest.raises(
            LaunchError, match=rf"port\(s\) {base} of {base}-{base + 1} are in use"
        ):  # HTTP, group
            launch_command(args)
    assert not (tmp_path / "o").exists()
    with pytest.raises(LaunchError, match="--port-base"):
        launch_command(build_parser().parse_args(["launch", str(path), "--cpu", "--port-base", "80"]))


def _flag(command: tuple[str, ...] | list[str], name: str) -> str:
    return command[list(command).index(name) + 1]


def test_a_second_launch_on_a_running_output_directory_is_refused(
    tmp_path: Path, config_writer: Callable[..., Path]
) -> None:
    import json
    import os

    import psutil

    path = config_writer(tmp_path / "c.yaml", model="/m", train_jsonl="/t.jsonl", output_dir=tmp_path / "o")
    (tmp_path / "o" / "launch").mkdir(parents=True)
    started = psutil.Process().create_time()
    me = {"pid": os.getpid(), "pgid": os.getpgid(0), "create_time": started, "descendants": []}
    record = {
        "launcher": os.getpid(),
        "launcher_create_time": started,
        "processes": [{"name": "server-0", **me}],
    }
    (tmp_path / "o" / "launch" / "pids.json").write_text(json.dumps(record))
    with pytest.raises(LaunchError, match=rf"a launch \(pid {os.getpid()}\) still runs here \(server-0: pid"):
        launch_command(build_parser().parse_args(["launch", str(path), "--cpu"]))
    assert sorted(p.name for p in (tmp_path / "o" / "launch").iterdir()) == ["pids.json"]  # nothing started
