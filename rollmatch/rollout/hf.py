"""HF ``generate`` rollout backend: the training model itself, batched, left-padded, no grad.

Owns: batching requests, left padding of ids / ``mm_token_type_ids``, stop-trimming responses at
the first EOS, finish reasons and seeded sampling that does not disturb the trainer's RNG.
Leaves out: prompt encoding (the trainer's ``PromptEncoder``) and the alignment check
(``rollout.alignment``). Weights are shared with the trainer, so ``sync_weights`` only records the
version.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from rollmatch.models.wrappers import strip_parallel_wrappers
from rollmatch.rollout.types import Decoding, Rollout, RolloutProvenance, RolloutRequest, SyncReport


class HFBackend:
    """Rollouts from an in-memory HF model with ``model.generate``."""

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        *,
        eos_token_id: int,
        pad_token_id: int,
        batch_size: int = 8,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.batch_size = int(batch_size)
        self._version = 0
        self.last_seconds = 0.0

    @property
    def weight_version(self) -> int:
        return self._version

    def sync_weights(self, model: object, version: int) -> SyncReport:
        self._version = int(version)
        return SyncReport(version=self._version, num_bytes=0, seconds=0.0, mode="none")

    def close(self) -> None:
        return None

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        start = time.perf_counter()
        model = strip_parallel_wrappers(self.model)
        was_training = model.training
        model.eval()
        rollouts: list[Rollout] = []
        try:
            # fork_rng: sampling must not shift the trainer's RNG stream (resume determinism).
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for offset in range(0, len(requests), self.batch_size):
                    torch.manual_seed(seed + offset)
                    chunk = requests[offset : offset + self.batch_size]
                    rollouts.extend(self._generate_batch(model, chunk, decoding, seed + offset))
        finally:
            model.train(was_training)
        self.last_seconds = time.perf_counter() - start
        return rollouts

    def _generate_batch(
        self, model: torch.nn.Module, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int
    ) -> list[Rollout]:
        device = next(model.parameters()).device
        inputs = left_padded_inputs(requests, self.pad_token_id, device)
        sampling = {"do_sample": False}
        if not decoding.greedy:
            sampling = {
                "do_sample": True,
                "temperature": decoding.temperature,
                "top_p": decoding.top_p,
                "top_k": decoding.top_k if decoding.top_k > 0 else 0,
            }
        output = model.generate(
            **inputs,
            **sampling,
            max_new_tokens=decoding.max_new_tokens,
            repetition_penalty=decoding.repetition_penalty,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        prompt_width = inputs["input_ids"].shape[1]
        provenance = RolloutProvenance(backend=self.name, seed=seed, decoding=decoding)
        results = []
        for row, request in zip(output[:, prompt_width:].tolist(), requests, strict=True):
            response, finish = trim_at_eos(row, self.eos_token_id, decoding.max_new_tokens)
            results.append(
                Rollout(
                    sample_id=request.sample_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    response_token_ids=response,
                    text=self.tokenizer.decode(response, skip_special_tokens=False),
                    finish_reason=finish,
                    weight_version=self._version,
                    provenance=provenance,
                )
            )
        return results


def trim_at_eos(token_ids: list[int], eos_token_id: int, max_new_tokens: int) -> tuple[list[int], str]:
    """Cut a generated row at its first EOS; ``length`` when no EOS came within the budget."""
    if eos_token_id in token_ids:
        return token_ids[: token_ids.index(eos_token_id)], "stop"
    return token_ids[:max_new_tokens], "length"


def left_padded_inputs(
    requests: Sequence[RolloutRequest], pad_token_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Left-pad prompt ids (and ``mm_token_type_ids``) into one generate batch with its images."""
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    mm_types = torch.zeros((len(requests), width), dtype=torch.long)
    for i, request in enumerate(requests):
        n = len(request.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(request.prompt_token_ids, dtype=torch.long)
        mask[i, width - n :] = 1
        if request.mm_token_type_ids is not None:
            mm_types[i, width - n :] = torch.tensor(request.mm_token_type_ids, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": mm_types}
    pixel = [r.pixel_values for r in requests if r.pixel_values is not None]
    if pixel:
        inputs["pixel_values"] = torch.cat(pixel, dim=0)
        inputs["image_grid_thw"] = torch.cat(
            [r.image_grid_thw for r in requests if r.image_grid_thw is not None]
        )
    return {k: v.to(device) for k, v in inputs.items()}
