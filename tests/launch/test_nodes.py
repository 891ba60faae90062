"""The ``launch:`` config section and several nodes: config rules, every node's dry-run commands from the
config alone, and the sbatch script of ``--emit slurm`` (golden file, ``bash -n``). No GPU, no Slurm."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.cli import main
from rollmatch.config.load import load_config
from rollmatch.errors import ConfigError

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
        load_config(None, list(overrides))
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
    assert "--nnodes 1 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:8012 " in out
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
            f"node0.cluster:29500 --rdzv-id rollmatch --rdzv-conf join_timeout=600 --local-addr node{rank}.cluster "
        ) in plan  # a 4-rank learner; rank 0's host is a node address, never a wildcard
        assert f"/launch/node-{rank}/learner.yaml" in plan
    assert out.endswith("dry run: nothing started, nothing written\n")


def test_roles_split_servers_and_learner_over_the_nodes(write: Callable[..., Path], capsys: Any) -> None:
    config = write(**{**TWO_NODES, "nodes": {**TWO_NODES["nodes"], "roles": ["servers", "learner"]}})
    assert main(["launch", str(config), "--dry-run"]) == 0
    node0, node1 = capsys.readouterr().out.split("rollmatch launch plan: ")[1:]
    assert node0.startswith("node 0 of 2: 3 rollout server(s)") and "learner-0" not in node0
    assert node1.startswith("node 1 of 2: learner (torchrun, 2 process(es))") and "server-0" not in node1
    assert "--nnodes 1 --node-rank 0 " in node1 and "http://node1.cluster" not in node1


def test_emit_slurm_writes_the_golden_sbatch_script(
    write: Callable[..., Path], capsys: Any, tmp_path: Path
) -> None:
    config = write(**TWO_NODES)
    assert main(["launch", str(config), "--emit", "slurm"]) == 0
    script = capsys.readouterr().out
    text = script.replace(sys.executable, "{python}").replace(str(tmp_path), "{tmp}")
    assert text == (GOLDEN / "two_nodes.sbatch").read_text()
    if shutil.which("bash") is None:
        pytest.skip("no bash to syntax-check the script")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


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
