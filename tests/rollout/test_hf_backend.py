"""HF rollout backend on a tiny real Qwen2.5-VL: batching, left padding, stop-trimming, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from rollmatch.config.schema import DataConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.rollout.hf import HFBackend, trim_at_eos
from rollmatch.rollout.types import Decoding

RACCOON = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "raccoon" / "images"


def _records(tmp_path: Path) -> list[Record]:
    sizes = [(224, 160), (120, 200), (96, 96)]
    records = []
    for i, (w, h) in enumerate(sizes):
        path = tmp_path / f"img{i}.png"
        Image.new("RGB", (w, h), color=(40 * i, 120, 200)).save(path)
        records.append(Record(id=f"s{i}", images=(str(path),), width=w, height=h))
    return records


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> PromptEncoder:
    return PromptEncoder.from_pretrained(str(tiny_model_dir), DataConfig())


def _backend(loaded_tiny, encoder: PromptEncoder, batch_size: int = 8) -> HFBackend:
    model, _ = loaded_tiny
    return HFBackend(
        model,
        encoder.tokenizer,
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
        batch_size=batch_size,
    )


def test_batched_greedy_equals_one_by_one(loaded_tiny, encoder, tmp_path):
    requests = [encoder.encode(r).to_request() for r in _records(tmp_path)]
    decoding = Decoding(max_new_tokens=12)
    batched = _backend(loaded_tiny, encoder, batch_size=2).generate(requests, decoding, seed=0)
    single = _backend(loaded_tiny, encoder, batch_size=1).generate(requests, decoding, seed=0)
    assert [r.response_token_ids for r in batched] == [r.response_token_ids for r in single]
    for rollout, request in zip(batched, requests, strict=True):
        assert rollout.prompt_token_ids == request.prompt_token_ids
        assert encoder.eos_token_id not in rollout.response_token_ids
        assert rollout.finish_reason in ("stop", "length")
        assert len(rollout.response_token_ids) <= 12
        assert rollout.provenance.backend == "hf"


def test_sampling_is_seeded_and_leaves_trainer_rng_alone(loaded_tiny, encoder, tmp_path):
    requests = [encoder.encode(r).to_request() for r in _records(tmp_path)]
    decoding = Decoding(temperature=1.0, top_p=1.0, max_new_tokens=10)
    backend = _backend(loaded_tiny, encoder)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = backend.generate(requests, decoding, seed=7)
    assert torch.equal(torch.rand(1), expected_next)  # fork_rng: the trainer's stream is untouched
    b = backend.generate(requests, decoding, seed=7)
    assert [r.response_token_ids for r in a] == [r.response_token_ids for r in b]


def test_sampled_rollouts_do_not_depend_on_batching_or_chunking(loaded_tiny, encoder, tmp_path):
    """Request i samples with seed + i whatever the batch size, and a chunk starting at request s
    called with seed + s gives the same rollouts (as the vLLM backends and servers do)."""
    requests = [encoder.encode(r).to_request() for r in _records(tmp_path)]
    decoding = Decoding(temperature=1.0, top_p=0.95, top_k=200, max_new_tokens=10)
    batched = _backend(loaded_tiny, encoder, batch_size=3).generate(requests, decoding, seed=11)
    single = _backend(loaded_tiny, encoder, batch_size=1).generate(requests, decoding, seed=11)
    backend = _backend(loaded_tiny, encoder, batch_size=2)
    chunked = backend.generate(requests[:1], decoding, seed=11) + backend.generate(requests[1:], decoding, 12)
    tokens = [r.response_token_ids for r in batched]
    assert [r.response_token_ids for r in single] == tokens
    assert [r.response_token_ids for r in chunked] == tokens
    assert [r.provenance.seed for r in batched] == [11, 12, 13]
    other_seed = backend.generate(requests[:1], decoding, seed=99)
    assert other_seed[0].response_token_ids != tokens[0]  # it does sample, and the seed matters


def test_model_mode_is_restored(loaded_tiny, encoder, tmp_path):
    model, _ = loaded_tiny
    model.train()
    try:
        _backend(loaded_tiny, encoder).generate(
            [encoder.encode(_records(tmp_path)[0]).to_request()], Decoding(max_new_tokens=3), seed=0
        )
        assert model.training
    finally:
        model.eval()


def test_trim_at_eos():
    assert trim_at_eos([5, 6, 2, 7, 2], eos_token_id=2, max_new_tokens=5) == ([5, 6], "stop")
    assert trim_at_eos([5, 6, 7], eos_token_id=2, max_new_tokens=3) == ([5, 6, 7], "length")
    assert trim_at_eos([2], eos_token_id=2, max_new_tokens=3) == ([], "stop")
