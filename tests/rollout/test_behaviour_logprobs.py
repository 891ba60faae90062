"""Behaviour log-probs travel with every HF rollout and equal the learner's recomputation at the
sampling temperature (``log_softmax(logits / T)``: the distribution the token was drawn from).

Tolerance (relative, per token): ``|engine - learner| <= TOLERANCE * max(1, |learner|)``. The HF engine
is the training model itself (a left-padded, KV-cached generate against one packed training forward):
float rounding only. The vLLM and rollout-server checks live beside their backends' tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from rollmatch.config.schema import DataConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding, Rollout, RolloutRequest
from rollmatch.training.grpo_loss import recompute_logprobs

TOLERANCE = 1e-4


def sampled_tokens(rollout: Rollout, eos_token_id: int) -> tuple[list[int], list[float]]:
    assert rollout.response_logprobs is not None
    assert len(rollout.response_logprobs) == len(rollout.response_token_ids)
    assert (rollout.stop_logprob is not None) == (rollout.finish_reason == "stop")
    ids, values = list(rollout.response_token_ids), list(rollout.response_logprobs)
    if rollout.stop_logprob is not None:
        assert rollout.stop_token_id == eos_token_id
        ids.append(rollout.stop_token_id)
        values.append(rollout.stop_logprob)
    return ids, values


def worst_relative_gap(model, requests, rollouts, eos_token_id: int, temperature: float = 1.0) -> float:
    worst = 0.0
    for request, rollout in zip(requests, rollouts, strict=True):
        ids, engine = sampled_tokens(rollout, eos_token_id)
        learner = recompute_logprobs(model, request, ids, temperature)
        worst = max([worst, *(abs(e - v) / max(1.0, abs(v)) for e, v in zip(engine, learner, strict=True))])
    return worst


@pytest.fixture(scope="module")
def requests_(tiny_model_dir, tmp_path_factory) -> tuple[PromptEncoder, list[RolloutRequest]]:
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), DataConfig())
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(1)
    out = []
    for i, (w, h) in enumerate([(120, 90), (64, 160), (96, 96)]):
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
        out.append(encoder.encode(Record(id=f"s{i}", images=(str(path),), width=w, height=h)).to_request())
    return encoder, out


@pytest.mark.parametrize(
    "decoding",
    [
        Decoding(temperature=1.0, max_new_tokens=12),
        Decoding(temperature=0.7, max_new_tokens=12),
        Decoding(max_new_tokens=12),
    ],
)
def test_hf_rollouts_carry_the_learners_logprobs(loaded_tiny, requests_, decoding: Decoding) -> None:
    model, _ = loaded_tiny
    encoder, requests = requests_
    backend = HFBackend(
        model, encoder.tokenizer, eos_token_id=encoder.eos_token_id, pad_token_id=encoder.pad_token_id
    )
    rollouts = backend.generate(requests, decoding, seed=11)
    assert all(len(r.response_token_ids) > 0 for r in rollouts)
    temperature = 1.0 if decoding.greedy else decoding.temperature  # greedy: the untempered distribution
    assert worst_relative_gap(model, requests, rollouts, encoder.eos_token_id, temperature) <= TOLERANCE
    if decoding.temperature not in (0.0, 1.0):  # the temperature-1 log-probs are not what was sampled
        assert worst_relative_gap(model, requests, rollouts, encoder.eos_token_id) > 1e-2
    if decoding.greedy:  # greedy takes the most likely token: its log-prob is the row's maximum
        assert all(v > -20 for r in rollouts for v in r.response_logprobs or [])
