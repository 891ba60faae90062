"""The ``launch:`` config section and several nodes: config rules, every node's dry-run commands from the
config alone, and the sbatch script of ``--emit slurm`` (golden file, ``bash -n``). No GPU, no Slurm."""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from resolved_runs import resolve_for

from rollmatch.cli import main
from rollmatch.config.load import load_config
from rollmatch.config.resume import resolve_resume
from rollmatch.errors import ConfigError
from rollmatch.launch.plan import load_launch_config
from rollmatch.training.checkpoints import write_complete_marker

GOLDEN = Path(__file__).parent / "golden"
TWO_NODES = {
    "server_devices": [0, 1, 2, 3, 4, 5],
    "learner_devices": [6, 7],
    "tensor_parallel_size": 2,
    "port_base": 8000,
    "nodes": {"count": 2, "hosts": ["node0.cluster", "node1.cluster"], "rendezvous": "node0.cluster:29500"},
}


@pytest.fixture
def write(tmp_path: Path, config_writer: Callable[..., Path]) -> Callable[..., Path]:
    def make(**launch: Any) -> Path:
        return config_writer(
            tmp_path / "cfg.yaml",
            model="/ckpt/stage1",
            train_jsonl="/data/train.jsonl",
            output_dir=tmp_path / "out",
            launch=launch,
        )

    return make


def _keys(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        resolve_for(load_config(None, list(overrides)), gpus=8)  # the one door to a run
    return {p.key: p.fix for p in caught.value.problems}


def test_config_rules_fail_fast_naming_the_key_and_the_fix() -> None:
    keys = _keys(
        "launch.server_devices=[0,1,2]",
        "launch.learner_devices=[2,3]",
        "launch.tensor_parallel_size=2",
        "launch.nodes.count=2",
        "launch.nodes.rank=2",
    )
    assert "device(s) [2] are also in launch.server_devices" in keys["launch.learner_devices"]
    assert "do not split into servers of launch.tensor_parallel_size 2" in keys["launch.server_devices"]
    assert "node ranks run 0..1" in keys["launch.nodes.rank"]
    assert "set launch.nodes.rendezvous: HOST:PORT" in keys["launch.nodes.rendezvous"]
    assert "2 nodes need 2 addresses" in keys["launch.nodes.hosts"]
    assert "set launch.port_base" in keys["launch.port_base"]
    wildcard = _keys("launch.nodes.hosts=['0.0.0.0']", "launch.nodes.rendezvous=x")
    assert "never a wildcard" in wildcard["launch.nodes.hosts"]
    assert "write HOST:PORT" in wildcard["launch.nodes.rendezvous"]
    nodes = ("launch.nodes.count=2", "launch.nodes.hosts=[a,b]", "launch.port_base=8000")
    top = _keys(*nodes, "launch.nodes.rendezvous=a:65535")  # the default heartbeat port would be 65536
    same = _keys(*nodes, "launch.nodes.rendezvous=a:29500", "launch.nodes.heartbeat_port=29500")
    for problems in (top, same):
        assert "set launch.nodes.heartbeat_port to another port" in problems["launch.nodes.heartbeat_port"]
    load_config(None, [*nodes, "launch.nodes.rendezvous=b:29500", "launch.nodes.heartbeat_port=29500"])


def test_seed_six_plus_two_layout_from_config_alone(write: Callable[..., Path], capsys: Any) -> None:
    # servers on GPUs 0-5 at the launch section's own tensor parallel default (1), learner on 6-7
    config = write(server_devices=[0, 1, 2, 3, 4, 5], learner_devices=[6, 7], port_base=8000)
    assert main(["launch", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "rollmatch launch plan: 6 rollout server(s) (vllm engine, tensor parallel 1) + learner (torchrun, 2 "
    )
    for i in range(6):
        assert f"CUDA_VISIBLE_DEVICES={i} " in out and f"--port {8000 + 2 * i} " in out
    assert "--tensor-parallel-size 1 " in out
    assert "CUDA_VISIBLE_DEVICES=6,7 " in out
    assert "--nnodes 1 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 " in out  # OS-picked
    # a flag still overrides the config
    assert main(["launch", str(config), "--tensor-parallel-size", "2", "--dry-run"]) == 0
    assert "3 rollout server(s) (vllm engine, tensor parallel 2)" in capsys.readouterr().out


def test_two_nodes_of_eight_gpus_print_every_nodes_commands(write: Callable[..., Path], capsys: Any) -> None:
    config = write(**TWO_NODES)
    assert main(["launch", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plans = out.split("rollmatch launch plan: ")[1:]
    assert [p.splitlines()[0] for p in plans] == [
        f"node {r} of 2: 3 rollout server(s) (vllm engine, tensor parallel 2) + learner (torchrun, 2 process(es))"
        for r in (0, 1)
    ]
    union = [
        f"{{base_url: http://node{n}.cluster:{8000 + 2 * i}, group_port: {8001 + 2 * i}}}"
        for n in (0, 1)
        for i in range(3)
    ]
    for rank, plan in enumerate(plans):
        assert [line.strip()[2:] for line in plan.splitlines() if line.startswith("    - ")] == union
        assert plan.count(f"--host node{rank}.cluster ") == 3  # 12 server GPUs: 6 servers of TP 2
        assert (
            f"--nproc_per_node 2 --nnodes 2 --node-rank {rank} --rdzv-backend c10d --rdzv-endpoint "
            f"node0.cluster:29500 --rdzv-id {rdzv_id(config, 'node0.cluster:29500')} --rdzv-conf join_timeout=600 "
            f"--local-addr node{rank}.cluster "
        ) in plan  # a 4-rank learner; rank 0's host is a node address, never a wildcard
        assert f"/launch/node-{rank}/learner.yaml" in plan
    assert out.endswith("dry run: nothing started, nothing written\n")


def rdzv_id(config: Path, endpoint: str) -> str:
    from rollmatch.launch.plan import load_launch_config, rendezvous_id

    return rendezvous_id(load_launch_config(str(config)).cfg, endpoint)


def test_the_rendezvous_id_is_the_runs_own(write: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    # two runs whose learners meet at one host and port never join each other's rendezvous
    config = write(**TWO_NODES)
    other = Path(str(config).replace("cfg.yaml", "other.yaml"))
    other.write_text(config.read_text().replace(str(tmp_path / "out"), str(tmp_path / "other")))
    ids = {rdzv_id(path, "node0.cluster:29500") for path in (config, other)}
    assert len(ids) == 2 and all(i.startswith("rollmatch-") for i in ids)
    assert main(["launch", str(config), "launch.nodes.rendezvous_id=job-1234", "--dry-run"]) == 0
    assert capsys.readouterr().out.count("--rdzv-id job-1234 ") == 2  # both learner nodes


def test_roles_split_servers_and_learner_over_the_nodes(write: Callable[..., Path], capsys: Any) -> None:
    nodes = {**TWO_NODES["nodes"], "roles": ["servers", "learner"], "rendezvous": "node1.cluster:29500"}
    config = write(**{**TWO_NODES, "nodes": nodes})
    assert main(["launch", str(config), "--dry-run"]) == 0
    node0, node1 = capsys.readouterr().out.split("rollmatch launch plan: ")[1:]
    assert node0.startswith("node 0 of 2: 3 rollout server(s)") and "learner-0" not in node0
    assert node1.startswith("node 1 of 2: learner (torchrun, 2 process(es))") and "server-0" not in node1
    assert "--nnodes 1 --node-rank 0 " in node1 and "http://node1.cluster" not in node1


SPLIT_2X8 = {  # 8 single-GPU servers on node 0, an 8-rank learner on node 1: every one of 16 GPUs used
    "server_devices": list(range(8)),
    "learner_devices": list(range(8)),
    "port_base": 8000,
    "nodes": {
        "count": 2,
        "hosts": ["node0.cluster", "node1.cluster"],
        "rendezvous": "node1.cluster:29500",
        "roles": ["servers", "learner"],
    },
}
# what a Slurm user writes: hosts and rendezvous are the script's (the job's nodes, a port from its id)
SPLIT_2X8_SLURM = {**SPLIT_2X8, "nodes": {"count": 2, "roles": ["servers", "learner"]}}
SPLIT_6_2 = {
    **TWO_NODES,
    "nodes": {**SPLIT_2X8["nodes"]},
}  # servers on GPUs 0-5 of node 0, learner on 6-7 of node 1


def check_script(script: str, tmp_path: Path) -> None:
    """``bash -n``, and every device index a node's launch uses is inside the GPUs the script asks for."""
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", script, re.M).group(1))  # type: ignore[union-attr]
    common = re.findall(r"'launch\.(server|learner)_devices=\[([\d,]*)\]'", script)
    devices = {role: [int(d) for d in text.split(",") if d] for role, text in common}
    for rank, role in re.findall(r"^# node (\d+): (.+)$", script, re.M):
        used = [
            *(devices["server"] if "servers" in role else []),
            *(devices["learner"] if "learner" in role else []),
        ]
        assert used and max(used) < gpus, f"node {rank} ({role}) uses devices {used}, asks for {gpus} GPU(s)"
    if shutil.which("bash") is None:
        pytest.skip("no bash to syntax-check the script")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("golden", "launch"),
    [("two_nodes.sbatch", TWO_NODES), ("split_2x8.sbatch", SPLIT_2X8_SLURM), ("split_6_2.sbatch", SPLIT_6_2)],
)
def test_emit_slurm_writes_the_golden_sbatch_script(
    write: Callable[..., Path], capsys: Any, tmp_path: Path, golden: str, launch: dict[str, Any]
) -> None:
    config = write(**launch)
    assert main(["launch", str(config), "--emit", "slurm"]) == 0
    script = capsys.readouterr().out
    text = script.replace(sys.executable, "{python}").replace(str(tmp_path), "{tmp}")
    assert text == (GOLDEN / golden).read_text()
    check_script(script, tmp_path)
    # sbatch opens --output before the job runs: its folder exists once the script is written
    assert (tmp_path / "out" / "launch").is_dir()


def test_the_split_layout_runs_on_every_node_with_disjoint_devices_per_node(
    write: Callable[..., Path], capsys: Any
) -> None:
    config = write(**SPLIT_2X8)
    assert main(["launch", str(config), "--dry-run"]) == 0
    node0, node1 = capsys.readouterr().out.split("rollmatch launch plan: ")[1:]
    assert node0.startswith("node 0 of 2: 8 rollout server(s)")
    assert [f"CUDA_VISIBLE_DEVICES={i} " in node0 for i in range(8)] == [True] * 8
    assert node1.startswith("node 1 of 2: learner (torchrun, 8 process(es))")
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 " in node1
    # a node that runs both roles still needs its own devices for each
    both = {**SPLIT_2X8, "nodes": {**SPLIT_2X8["nodes"], "roles": ["both", "learner"]}}
    assert main(["launch", str(write(**both)), "--dry-run"]) == 2
    assert "node(s) [0] run both roles; give each role its own devices" in capsys.readouterr().err


def test_the_sbatch_resources_are_set_and_overridable(write: Callable[..., Path], capsys: Any) -> None:
    config = write(**TWO_NODES)
    assert main(["launch", str(config), "--emit", "slurm"]) == 0
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#SBATCH")]
    for line in ("--exclusive", "--mem=0", "--requeue", "--signal=USR1@120"):
        assert f"#SBATCH {line}" in header
    overrides = [
        "launch.slurm.exclusive=false",
        "launch.slurm.cpus_per_task=48",
        "launch.slurm.mem=400G",
        "launch.slurm.signal_warning_s=600",
        "launch.slurm.options=[--partition=gpu,--time=24:00:00]",
    ]
    assert main(["launch", str(config), *overrides, "--emit", "slurm"]) == 0
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --exclusive" not in header
    for line in (
        "--cpus-per-task=48",
        "--mem=400G",
        "--signal=USR1@600",
        "--partition=gpu",
        "--time=24:00:00",
    ):
        assert f"#SBATCH {line}" in header
    assert main(["launch", str(config), "launch.slurm.exclusive=false", "--emit", "slurm"]) == 2
    assert "launch.slurm.cpus_per_task = None: launch.slurm.exclusive is false" in capsys.readouterr().err


def test_a_rendezvous_on_a_servers_only_node_is_refused(write: Callable[..., Path], capsys: Any) -> None:
    nodes = {**SPLIT_2X8["nodes"], "rendezvous": "node0.cluster:29500"}
    assert main(["launch", str(write(**{**SPLIT_2X8, "nodes": nodes})), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert (
        "launch.nodes.rendezvous = 'node0.cluster:29500': node0.cluster is node 0, which runs only servers"
        in err
    )
    assert "name a learner node, e.g. node1.cluster:29500" in err


def test_a_node_address_that_resolves_to_loopback_here_is_refused_at_start(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    # Debian's /etc/hosts maps the machine's own name to 127.0.1.1: the fault injected here
    real = socket.getaddrinfo
    where = {"node0.cluster": "127.0.1.1", "node1.cluster": "10.1.2.3"}

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host in where:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (where[host], 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setenv("ROLLMATCH_API_KEY", "k")
    started = time.monotonic()
    cpu_nodes = {"port_base": 8000, "nodes": TWO_NODES["nodes"]}
    assert main(["launch", str(write(**cpu_nodes)), "--cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        "launch.nodes.hosts = 'node0.cluster': node 0's address 'node0.cluster' resolves to 127.0.1.1" in err
    )
    assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()  # not after the join timeout


def test_several_nodes_off_loopback_need_one_shared_api_key(
    write: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    from rollmatch.launch.plan import free_ports

    monkeypatch.delenv("ROLLMATCH_API_KEY", raising=False)
    nodes = {**TWO_NODES["nodes"], "roles": ["both", "learner"]}
    config = write(port_base=free_ports(1)[0], nodes=nodes)
    assert main(["launch", str(config), "--cpu"]) == 2
    assert "$ROLLMATCH_API_KEY = None: 2 nodes share one key" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything started or was written


def test_the_learners_world_size_spans_every_learner_node(write: Callable[..., Path], capsys: Any) -> None:
    # one rank per node, two learner nodes: world size 2, so Channel-B step mode is refused up front
    config = write(port_base=8000, nodes={**TWO_NODES["nodes"], "roles": ["both", "learner"]})
    assert main(["launch", str(config), "stage2_ab.channel_b.mode=step", "--cpu", "--dry-run"]) == 2
    assert "world_size=2" in capsys.readouterr().err


STUB_SRUN = """#!/bin/bash
for arg in "$@"; do case "$arg" in --relative=*) node="${arg#--relative=}";; esac; done
echo "$*" >> "$STUB_DIR/srun-$node.args"
code_var="STUB_CODE_$node"
exit "${!code_var}"
"""
STUB_SCONTROL = """#!/bin/bash
case "$1" in
  show) printf 'gpu-a\\ngpu-b\\n';;
  requeue) echo "$2" >> "$STUB_DIR/requeued";;
esac
"""


@pytest.mark.parametrize(
    ("codes", "restart", "status", "requeued"),
    [((0, 5), "0", 0, True), ((0, 0), "0", 0, False), ((4, 5), "1", 4, False), ((0, 5), "1", 0, True)],
)
def test_the_script_requeues_a_job_whose_learner_stopped_on_the_warning(
    write: Callable[..., Path],
    capsys: Any,
    tmp_path: Path,
    codes: tuple[int, int],
    restart: str,
    status: int,
    requeued: bool,
) -> None:
    """The emitted script run by bash, with ``srun`` / ``scontrol`` stand-ins (no Slurm here): exit 5 from
    a launch (a checkpoint on the warning) requeues the job; a restarted job resumes from ``latest``."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    assert main(["launch", str(write(**SPLIT_2X8_SLURM)), "--emit", "slurm"]) == 0
    script = tmp_path / "job.sbatch"
    script.write_text(capsys.readouterr().out)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "STUB_DIR": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_RESTART_COUNT": restart,
        "ROLLMATCH_API_KEY": "k",
        "STUB_CODE_0": str(codes[0]),
        "STUB_CODE_1": str(codes[1]),
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stdout + done.stderr
    assert (tmp_path / "requeued").exists() == requeued, done.stdout
    if requeued:
        assert (tmp_path / "requeued").read_text() == "4242\n"
    args = (tmp_path / "srun-0.args").read_text()  # node 0 never is the one stopped (node 1 only exits 5)
    assert "launch.nodes.hosts=[gpu-a,gpu-b] " in args and "launch.nodes.rank=0" in args
    assert f"launch.nodes.rendezvous=gpu-b:{20000 + 4242} launch.nodes.rendezvous_id=rollmatch-4242" in args
    assert ("training.resume_from_checkpoint=latest" in args) == (restart != "0")
    # Resubmitted (restart 0) or requeued: the job's own command line, under the trainer's rule, resumes
    # from the newest complete checkpoint of the output directory instead of training over it.
    checkpoint = tmp_path / "out" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    write_complete_marker(str(checkpoint), 4, 8)
    words = shlex.split(args.splitlines()[0])
    at = words.index("launch")  # srun's options, then `python -m rollmatch.cli launch CONFIG key=value ...`
    overrides = [w for w in words[at + 2 :] if "=" in w and not w.startswith("-")]
    cfg = load_launch_config(words[at + 1], overrides).cfg
    spec = cfg.training.resume_from_checkpoint
    assert spec == ("auto" if restart == "0" else "latest")
    assert resolve_resume(
        spec, cfg.training.output_dir, 8, overwrite=cfg.training.overwrite_output_dir
    ) == str(checkpoint)
