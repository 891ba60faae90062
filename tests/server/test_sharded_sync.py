"""Weight export from sharded parameters, on 2 real gloo ranks (forked from the test process,
``fork_ranks.py``).

- FSDP2 (``fully_shard``: real DTensor shards) and a ZeRO-3-like partition (each rank keeps a real flat
  shard in ``ds_tensor``; the stand-in for ``deepspeed.zero.GatheredParameters`` all-gathers those shards
  over gloo, because DeepSpeed cannot run here): rank 0's export equals the unsharded model's, every rank
  runs the same number of gathers, and a consumer that stops early (a failed push) drains, so no rank
  hangs;
- FSDP2 end to end, in the same 2-rank run: ``ServerBackend.sync_weights`` on both ranks pushes the
  gathered weights to a real ``rollmatch serve`` process (rank 0 sends, rank 1 joins the gathers); the
  server verifies the checksum and serves the new version. A second, killed server (``min_healthy: 1``)
  makes the first attempt fail; the push goes again to the live one, every rank gathering again.

One 2-rank run serves the three tests: the ranks run the ZeRO-3 export on one model, then the FSDP2
export and push on a second one (a start costs more than the exports).

Teardown. ``fully_shard`` keeps the gloo process group alive after ``destroy_process_group`` (its two
worker threads and its transport thread still run: 4 threads per rank afterwards, 1 without
``fully_shard``, even with the model deleted and collected), so an FSDP2 rank that exits normally has
those threads torn down during interpreter finalization, racing the other rank's exit: now and then a
rank aborted there with "terminate called without an active exception" (PyTorch issue 190489). The
probe therefore leaves with ``os._exit(0)`` once its result file is written and the group destroyed;
every check runs before that.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fork_ranks import run_forked_ranks
from local_ports import free_tcp_port
from server_processes import launch_server

pytestmark = pytest.mark.heavy

PROBE = r'''
import contextlib, datetime, gc, json, os, sys
import torch
import torch.distributed as dist
import rollmatch  # noqa: F401
from transformers import AutoModelForImageTextToText
from rollmatch.sync.weights import SyncTensors, Zero3Gather, iter_sync_tensors

model_dir, modes, out_path = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
server_url = sys.argv[4] if len(sys.argv) > 4 else None  # the FSDP2 run pushes to it


class FakeGatheredParameters:
    """deepspeed.zero.GatheredParameters over real shards: all-gather ds_tensor, whole .data inside."""

    def __init__(self, params, modifier_rank=None):
        self.params = params

    def __enter__(self):
        world = dist.get_world_size()
        for p in self.params:
            parts = [torch.empty_like(p.ds_tensor) for _ in range(world)]
            dist.all_gather(parts, p.ds_tensor)
            p.data = torch.cat(parts)[: p.ds_numel].view(p.ds_shape)

    def __exit__(self, *exc):
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype)


def export_and_push(rank, world, mode):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # trained weights: differ from the directory the server loaded
            param.add_(0.01 * torch.randn_like(param))
    reference = {name: tensor.clone() for name, tensor in iter_sync_tensors(model, "full")}
    gather = None
    if mode == "zero3":
        for index, p in enumerate(model.parameters()):
            flat = p.data.reshape(-1)
            per_rank = -(-flat.numel() // world)
            padded = torch.cat([flat, flat.new_zeros(per_rank * world - flat.numel())])
            p.ds_id, p.ds_numel, p.ds_shape = index, flat.numel(), p.shape
            p.ds_tensor = padded[rank * per_rank : (rank + 1) * per_rank].clone()
            p.data = torch.empty(0, dtype=p.dtype)
        gather = Zero3Gather(gathered_parameters=FakeGatheredParameters)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.language_model.layers:
            fully_shard(layer)
        fully_shard(model)
    result = {"rank": rank}
    first = next(model.parameters())
    result["local_numel"] = int(first.ds_tensor.numel() if mode == "zero3" else first.to_local().numel())
    result["full_numel"] = int(first.ds_numel if mode == "zero3" else first.numel())

    export = SyncTensors(model, "full", gather=gather, gather_bytes=256 << 10)
    if rank == 0:
        exported = {name: tensor for name, tensor in export}
        result["names_equal"] = list(exported) == list(reference)
        result["mismatched"] = [n for n in reference if not torch.equal(exported.get(n, torch.empty(0)), reference[n])]
    else:
        export.drain()
    result["gathers"] = export.gathers_run
    # A consumer that stops after three tensors (a failed push) drains the rest.
    stopped = SyncTensors(model, "full", gather=gather, gather_bytes=256 << 10)
    if rank == 0:
        for _ in range(3):
            next(stopped)
    stopped.drain()
    result["gathers_after_fault"] = stopped.gathers_run

    if server_url is not None and mode == "fsdp2":
        from rollmatch.collectives import TorchCollectives
        from rollmatch.rollout.client import ServerBackend, ServerConnection
        collectives = TorchCollectives(timeout_s=60)
        connection = ServerConnection(server_url, int(sys.argv[5]), timeout_s=30, infer_timeout_s=None)
        connections = [connection]
        if len(sys.argv) > 6:  # a second server, killed: nothing listens on its port any more
            connections.append(ServerConnection(sys.argv[6], int(sys.argv[7]), timeout_s=30, infer_timeout_s=None))
        backend = ServerBackend(connections, collectives=collectives, tokenizer=None, min_healthy=1)
        report = backend.sync_weights(model, 7)
        result["version"] = report.version
        result["bytes"] = report.num_bytes
        result["servers"] = list(report.servers)
        result["down"] = [c.url for c in connections if backend.pool.is_down(c)]
        result["served"] = connection.get("/info/", "version check")["weight_version"] if rank == 0 else None
        backend.close()
        if len(sys.argv) > 8:  # a server that dies after bucket 0 of a push (dying_sync_server.py)
            connections = [
                ServerConnection(server_url, int(sys.argv[10]), timeout_s=30, infer_timeout_s=None),
                ServerConnection(sys.argv[8], int(sys.argv[9]), timeout_s=30, infer_timeout_s=None),
            ]
            backend = ServerBackend(
                connections, collectives=collectives, tokenizer=None, min_healthy=1, bucket_bytes=256 << 10
            )
            mid_push = backend.sync_weights(model, 8)  # fails mid-transfer on the second, goes on without it
            result["mid_push_servers"] = list(mid_push.servers)
            result["mid_push_down"] = [c.url for c in connections if backend.pool.is_down(c)]
            result["next_push_servers"] = list(backend.sync_weights(model, 9).servers)  # at min_healthy
            backend.close()
    return result


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
results = {}
for mode in modes:  # fsdp2 last: fully_shard keeps the group's threads alive (module docstring)
    results[mode] = export_and_push(rank, dist.get_world_size(), mode)
    gc.collect()  # the sharded model and its iterators are gone before the next mode, or the teardown
    dist.barrier()
dist.destroy_process_group()
results["threads_after_destroy"] = len(os.listdir("/proc/self/task"))  # > 1 under fully_shard (docstring)
with open(os.path.join(out_path, f"rank{rank}.json"), "w") as fh:
    json.dump(results, fh)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # no interpreter teardown of gloo threads that fully_shard kept alive (module docstring)
'''


def run_probe(tmp_path: Path, model_dir: Path, modes: str, *extra: str) -> list[dict[str, Any]]:
    """Both ranks' results (``{mode: result}``) of one 2-rank run of ``modes`` (comma-separated): the
    probe runs as ``__main__`` in two gloo ranks forked from this process (``fork_ranks.py``; it ends
    each rank with ``os._exit(0)`` itself)."""
    import json

    import torch.distributed  # noqa: F401  (imported once here, not in every rank)
    import transformers

    import rollmatch.rollout.client
    import rollmatch.sync.weights

    _ = (transformers.AutoModelForImageTextToText, rollmatch.rollout.client, rollmatch.sync.weights)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "results"
    out.mkdir()
    code = compile(PROBE, str(probe), "exec")

    def rank_main(rank: int) -> None:
        sys.argv = [str(probe), str(model_dir), modes, str(out), *extra]
        exec(code, {"__name__": "__main__", "__file__": str(probe)})

    codes = run_forked_ranks(rank_main, timeout_s=300, check=False)
    assert codes == {0: 0, 1: 0}, (
        f"probe ranks (exit codes {codes}): their tracebacks are in the captured output"
    )
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def assert_export_gathers_on_every_rank(rank0: dict[str, Any], rank1: dict[str, Any]) -> None:
    assert rank0["local_numel"] < rank0["full_numel"]  # the parameters really are sharded
    assert rank0["names_equal"] and rank0["mismatched"] == []
    assert rank0["gathers"] == rank1["gathers"] > 1  # the same per-bucket gathers on both ranks
    assert rank0["gathers_after_fault"] == rank1["gathers_after_fault"] == rank0["gathers"]


@pytest.fixture(scope="module")
def probe_results(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, hf_sync_server: Any
) -> list[dict[str, Any]]:
    """The two ranks' results of the module's one 2-rank run: ZeRO-3 export, then FSDP2 export and push."""
    folder = tmp_path_factory.mktemp("sharded_sync")
    killed = f"http://127.0.0.1:{free_tcp_port()}"  # a server that died: its port refuses connections
    dying = launch_server(
        tiny_model_dir,
        free_tcp_port(),
        folder / "dying.log",
        "--engine",
        "hf",
        command=[sys.executable, str(Path(__file__).with_name("dying_sync_server.py"))],
    )
    try:
        results = run_probe(
            folder,
            tiny_model_dir,
            "zero3,fsdp2",
            hf_sync_server.url,
            str(free_tcp_port()),
            killed,
            str(free_tcp_port()),
            dying.url,
            str(free_tcp_port()),
            str(free_tcp_port()),
        )
        dying.process.wait(timeout=60)
    finally:
        dying.stop()
    for rank in results:
        rank["dying_url"], rank["dying_exit"], rank["dying_log"] = (
            dying.url,
            dying.process.returncode,
            dying.log_tail(),
        )
    return results


def test_zero3_export_gathers_sharded_parameters_on_every_rank(probe_results: list[dict[str, Any]]) -> None:
    assert_export_gathers_on_every_rank(*(rank["zero3"] for rank in probe_results))


def test_fsdp2_export_gathers_on_every_rank_and_pushes_gathered_weights_to_a_server(
    probe_results: list[dict[str, Any]], hf_sync_server: Any
) -> None:
    """The export checks, then a real push from the same ranks."""
    rank0, rank1 = (rank["fsdp2"] for rank in probe_results)
    assert_export_gathers_on_every_rank(rank0, rank1)
    assert rank0["version"] == rank1["version"] == 7  # both ranks learn the outcome
    assert rank0["bytes"] > 0
    assert rank0["served"] == 7  # the server verified and serves it
    # The second server was dead (min_healthy 1): its group could not form, every rank gathered again and
    # the push went to the live one; both ranks drop the dead server.
    assert rank0["servers"] == rank1["servers"] == [hf_sync_server.url]
    assert len(rank0["down"]) == len(rank1["down"]) == 1 and rank0["down"] == rank1["down"]


def test_a_server_dying_mid_way_through_a_sharded_push_leaves_the_pushes_going_at_min_healthy(
    probe_results: list[dict[str, Any]], hf_sync_server: Any
) -> None:
    """FSDP2 on 2 gloo ranks, two servers (``min_healthy: 1``, 256 KiB buckets): the second takes bucket 0
    of version 8 and dies when bucket 1 arrives (``dying_sync_server.py``). Both ranks learn that the push
    went to the live server alone (every rank gathered again for the re-sent push), both drop the dead one,
    and the next push (version 9) goes to the live server in one attempt: the pushes go on at min_healthy."""
    rank0, rank1 = (rank["fsdp2"] for rank in probe_results)
    dying = probe_results[0]
    assert dying["dying_exit"] == 9 and "dying mid-push: bucket 1 arrived" in dying["dying_log"], dying
    assert rank0["mid_push_servers"] == rank1["mid_push_servers"] == [hf_sync_server.url]
    assert rank0["mid_push_down"] == rank1["mid_push_down"] == [dying["dying_url"]]
    assert rank0["next_push_servers"] == rank1["next_push_servers"] == [hf_sync_server.url]
    assert hf_sync_server.get("/info/")["weight_version"] == 9  # verified and served
