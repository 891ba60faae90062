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

from rollmatch.collectives import LocalCollectives
from rollmatch.config.resolved import resolve_run_on_this_machine
from rollmatch.errors import BackendError, SyncError
from rollmatch.rollout.client import ServerBackend
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding
from rollmatch.sync.transport import GroupTransport

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


def _flip_first_bit(flat: torch.Tensor) -> torch.Tensor:
    flat[0] ^= 0x01
    return flat


def _compensating_words(flat: torch.Tensor) -> torch.Tensor:
    words = flat[:16].view(torch.int64)
    words[0] += 1
    words[1] -= 1
    return flat


def _ids(rollouts: list[Any]) -> list[list[int]]:
    return [r.response_token_ids for r in rollouts]


@pytest.mark.heavy
def test_sync_after_training_makes_server_greedy_equal_trainer_greedy(
    hf_sync_server: Any,
    trainer_side: Callable[..., Any],
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = trainer_side(hf_sync_server.url)
    model, backend, trainer = side.model, side.backend, side.reference
    requests = raccoon_requests[:2]
    before = hf_sync_server.get("/stats/")
    start_version = before["weight_version"]
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
    pushed = str(start_version + 1)
    assert stats["pushes_by_version"][pushed] - before["pushes_by_version"].get(pushed, 0) == 1

    # Bytes altered in transit on the real gloo stream (a flipped bit; +1 / -1 on two 64-bit words,
    # which a sum of words cannot see): detected at finish, the server keeps the previous version.
    _train_steps(model, prompt_encoder, requests, steps=1)
    original = GroupTransport.broadcast_async
    for tamper in (_flip_first_bit, _compensating_words):

        def corrupt(self: GroupTransport, tensor: torch.Tensor, src: int, tamper: Any = tamper) -> Any:
            return original(self, tamper(tensor.clone()), src)

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


def _lora_config(tiny_model_dir: Path, url: str, group_port: int, fallback: bool) -> Any:
    from rollmatch.config.schema import RollmatchConfig

    vllm = {
        "mode": "server",
        "enable_lora": True,
        "sync": {"mode": "adapter", "fallback_to_full": fallback},
        "server": {"servers": [{"base_url": url, "group_port": group_port}]},
    }
    return RollmatchConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "lora": {"enabled": True}},
            "custom": {"extra": {"rollout_matching": {"vllm": vllm}}},
        }
    )


@pytest.mark.heavy
def test_adapter_sync_falls_back_to_full_once_or_fails_fast(
    hf_sync_server: Any,
    tiny_model_dir: Path,
    raccoon_requests: list[Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # lora_B starts at zero: make the adapter change outputs
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    kwargs = {"model": model, "tokenizer": prompt_encoder.tokenizer, "processor": prompt_encoder.processor}

    strict = _lora_config(tiny_model_dir, hf_sync_server.url, free_port(), fallback=False)
    with pytest.raises(BackendError, match=r"sync modes: trainer needs adapter, server offers \['full'\]"):
        ServerBackend.connect(resolve_run_on_this_machine(strict), collectives=LocalCollectives(), **kwargs)

    lenient = _lora_config(tiny_model_dir, hf_sync_server.url, free_port(), fallback=True)
    backend = ServerBackend.connect(
        resolve_run_on_this_machine(lenient), collectives=LocalCollectives(), **kwargs
    )
    version = hf_sync_server.get("/info/")["weight_version"] + 1
    with caplog.at_level("WARNING", logger="rollmatch.rollout.weight_push"):
        report = backend.sync_weights(model, version)
        backend.sync_weights(model, version + 1)
    assert report.mode == "full" and backend.sync_mode == "full"
    assert caplog.text.count("adapter sync failed") == 1 and "does not serve adapters" in caplog.text
    trainer = HFBackend(
        model,
        prompt_encoder.tokenizer,
        eos_token_id=prompt_encoder.eos_token_id,
        pad_token_id=prompt_encoder.pad_token_id,
    )
    requests = raccoon_requests[:2]
    assert _ids(backend.generate(requests, DECODING, seed=0)) == _ids(trainer.generate(requests, DECODING, 0))
