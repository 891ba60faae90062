"""In-memory weight sync to a real server: after training steps the server's greedy equals the trainer's.

Also: the version advances once per push, a corrupted transfer is detected and the server keeps
serving its previous version, and the next push re-forms the group and succeeds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForImageTextToText

from rollmatch.errors import SyncError
from rollmatch.rollout.client import ServerBackend
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding
from rollmatch.sync.transport import GroupTransport
from rollmatch.training.dist import LocalCollectives

DECODING = Decoding(max_new_tokens=10)


def _train_steps(model: torch.nn.Module, prompt_encoder: Any, requests: list[Any], steps: int) -> None:
    """Real optimizer steps: next-token loss on the prompts (enough to change greedy outputs)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    model.train()
    for _ in range(steps):
        for request in requests:
            ids = torch.tensor([request.prompt_token_ids])
            loss = model(
                input_ids=ids,
                pixel_values=request.pixel_values,
                image_grid_thw=request.image_grid_thw,
                mm_token_type_ids=torch.tensor([request.mm_token_type_ids]),
                labels=ids,
            ).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _ids(rollouts: list[Any]) -> list[list[int]]:
    return [r.response_token_ids for r in rollouts]


@pytest.mark.heavy
def test_sync_after_training_makes_server_greedy_equal_trainer_greedy(
    hf_sync_server: Any,
    server_config: Callable[..., Any],
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    cfg = server_config(servers=[{"base_url": hf_sync_server.url, "group_port": free_port()}])
    backend = ServerBackend.from_config(
        cfg,
        model=model,
        tokenizer=prompt_encoder.tokenizer,
        model_dir=str(tiny_model_dir),
        collectives=LocalCollectives(),
    )
    trainer = HFBackend(
        model,
        prompt_encoder.tokenizer,
        eos_token_id=prompt_encoder.eos_token_id,
        pad_token_id=prompt_encoder.pad_token_id,
    )
    requests = raccoon_requests[:2]
    start_version = hf_sync_server.get("/info/")["weight_version"]
    assert _ids(backend.generate(requests, DECODING, seed=0)) == _ids(trainer.generate(requests, DECODING, 0))

    _train_steps(model, prompt_encoder, requests, steps=2)
    trained = _ids(trainer.generate(requests, DECODING, 0))
    stale = backend.generate(requests, DECODING, seed=0)
    assert _ids(stale) != trained, "training did not change greedy outputs; the test would prove nothing"

    report = backend.sync_weights(model, start_version + 1)
    assert report.mode == "full" and report.version == start_version + 1 and report.num_bytes > 1_000_000
    synced = backend.generate(requests, DECODING, seed=0)
    assert _ids(synced) == trained
    assert {r.weight_version for r in synced} == {
        start_version + 1
    } and backend.weight_version == start_version + 1
    stats = hf_sync_server.get("/stats/")
    assert stats["weight_version"] == start_version + 1
    assert stats["pushes_by_version"][str(start_version + 1)] == 1

    # A byte flipped in transit: detected at finish, the server keeps serving the previous version.
    _train_steps(model, prompt_encoder, requests, steps=1)
    original = GroupTransport.broadcast_async

    def corrupt(self: GroupTransport, tensor: torch.Tensor, src: int) -> Any:
        tensor = tensor.clone()
        tensor[0] ^= 0x01
        return original(self, tensor, src)

    monkeypatch.setattr(GroupTransport, "broadcast_async", corrupt)
    with pytest.raises(SyncError, match=r"checksum mismatch in bucket 0 .*keeps its previous weights"):
        backend.sync_weights(model, start_version + 2)
    monkeypatch.setattr(GroupTransport, "broadcast_async", original)
    stats = hf_sync_server.get("/stats/")
    assert stats["weight_version"] == start_version + 1 and stats["failed_pushes"] >= 1
    assert _ids(backend.generate(requests, DECODING, seed=0)) == trained  # still the previous weights

    backend.sync_weights(model, start_version + 2)  # the group is re-formed; the push goes through
    assert hf_sync_server.get("/info/")["weight_version"] == start_version + 2
    assert _ids(backend.generate(requests, DECODING, seed=0)) == _ids(trainer.generate(requests, DECODING, 0))
    backend.close()
