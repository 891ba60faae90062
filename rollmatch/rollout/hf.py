"""HF ``generate`` rollout backend: the training model itself, batched, left-padded, no grad.

Owns: batching requests, left padding of ids / ``mm_token_type_ids``, stop-trimming responses at
the first EOS, finish reasons and seeded sampling that does not disturb the trainer's RNG.
Leaves out: prompt encoding (the trainer's ``PromptEncoder``) and the alignment check
(``rollout.alignment``). Weights are shared with the trainer, so ``sync_weights`` only records the
version.

Every rollout carries its behaviour log-probs (``Rollout.response_logprobs``, ``stop_logprob``) of the
distribution each token was drawn from (tempered, truncated), recorded while generating
(:class:`TokenChooser`): no second forward.

Seeds, as in the vLLM backends: request ``i`` of a ``generate(requests, decoding, seed)`` call
samples from its own generator seeded with ``seed + i`` (:class:`PerRequestSampler`), so its random
draws do not depend on ``batch_size`` or on how a caller splits a step into calls (a chunk that
starts at request ``s`` is called with ``step_seed + s``). What a batch can still change is the
logits themselves: a left-padded batched forward can differ from an unbatched one in the last
float bits, which changes a sampled token only when a draw lands within that rounding of a
cumulative-probability boundary. Greedy rollouts do not sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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

    @property
    def weight_version(self) -> int:
        return self._version

    def sync_weights(self, model: object, version: int) -> SyncReport:
        self._version = int(version)
        return SyncReport(version=self._version, num_bytes=0, seconds=0.0, mode="none")

    def close(self) -> None:
        return None

    def generate(self, requests: Sequence[RolloutRequest], decoding: Decoding, seed: int) -> list[Rollout]:
        return self.generate_seeded(requests, decoding, [seed + i for i in range(len(requests))])

    def generate_seeded(
        self,
        requests: Sequence[RolloutRequest],
        decoding: Decoding,
        seeds: Sequence[int],
        should_stop: Callable[[int], bool] | None = None,
    ) -> list[Rollout]:
        """:meth:`generate` with request ``i`` sampling from ``seeds[i]`` (the rollout server batches
        requests of several calls, each call with its own seeds). ``should_stop(i)``, asked once per
        decoding step, ends request ``i`` there (the rollout server's abort; its rollout is cut short)."""
        model = strip_parallel_wrappers(self.model)
        was_training = model.training
        model.eval()
        rollouts: list[Rollout] = []
        try:
            # fork_rng: sampling must not shift the trainer's RNG stream (resume determinism).
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for offset in range(0, len(requests), self.batch_size):
                    chunk = requests[offset : offset + self.batch_size]
                    chunk_seeds = seeds[offset : offset + self.batch_size]
                    stop = None if should_stop is None else _RowsStopped(should_stop, offset, len(chunk))
                    rollouts.extend(self._generate_batch(model, chunk, decoding, chunk_seeds, stop))
        finally:
            model.train(was_training)
        return rollouts

    def _generate_batch(
        self,
        model: torch.nn.Module,
        requests: Sequence[RolloutRequest],
        decoding: Decoding,
        seeds: Sequence[int],
        stop: StoppingCriteria | None = None,
    ) -> list[Rollout]:
        device = next(model.parameters()).device
        inputs = left_padded_inputs(requests, self.pad_token_id, device)
        # HF's own sampling draws from one global stream for the whole batch; ours picks each
        # row's token from that row's generator and hands generate a one-hot row to take greedily.
        chooser: TokenChooser = (
            GreedyChooser() if decoding.greedy else PerRequestSampler(decoding, seeds, device)
        )
        processors = LogitsProcessorList([chooser])
        output = model.generate(
            **inputs,
            do_sample=False,
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([stop] if stop is not None else []),
            max_new_tokens=decoding.max_new_tokens,
            repetition_penalty=decoding.repetition_penalty,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        prompt_width = inputs["input_ids"].shape[1]
        results = []
        logprobs = torch.stack(chooser.logprobs, dim=1).tolist() if chooser.logprobs else [[]] * len(requests)
        for i, (row, request) in enumerate(zip(output[:, prompt_width:].tolist(), requests, strict=True)):
            response, finish = trim_at_eos(row, self.eos_token_id, decoding.max_new_tokens)
            row_logprobs = logprobs[i][: len(response) + 1]
            results.append(
                Rollout(
                    sample_id=request.sample_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    response_token_ids=response,
                    text=self.tokenizer.decode(response, skip_special_tokens=False),
                    finish_reason=finish,
                    weight_version=self._version,
                    provenance=RolloutProvenance(backend=self.name, seed=int(seeds[i]), decoding=decoding),
                    response_logprobs=row_logprobs[: len(response)],
                    stop_token_id=self.eos_token_id if finish == "stop" else None,
                    stop_logprob=row_logprobs[len(response)] if finish == "stop" else None,
                )
            )
        return results


class TokenChooser(LogitsProcessor):
    """Picks each row's next token (returns scores that are ``-inf`` except at it, so greedy generation
    takes it) and records its log-prob under the distribution it was drawn from: ``log_softmax`` of the
    scores after HF's repetition penalty and this chooser's temperature / top-k / top-p (masked tokens
    ``-inf``, the rest renormalised), as vLLM's ``processed_logprobs``; one (B,) tensor per generated
    position in :attr:`logprobs`. Greedy decoding records the untempered distribution."""

    logprobs: list[torch.Tensor]

    def choose(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen (B, 1), the scores it was drawn from (B, V))``."""
        raise NotImplementedError

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen, sampled_from = self.choose(input_ids, scores)
        self.logprobs.append(torch.log_softmax(sampled_from.float(), dim=-1).gather(1, chosen)[:, 0].cpu())
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


class GreedyChooser(TokenChooser):
    """Greedy decoding: each row's most likely token."""

    def __init__(self) -> None:
        self.logprobs = []

    def choose(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return scores.argmax(dim=-1, keepdim=True), scores


class PerRequestSampler(TokenChooser):
    """Samples row ``i`` of a generate batch from its own generator, seeded with ``seeds[i]``.

    Runs after HF's processors (repetition penalty), applies temperature, top-k and top-p like
    vLLM and draws one token per row. A row's draws depend only on its seed and its own logits.
    """

    def __init__(self, decoding: Decoding, seeds: Sequence[int], device: torch.device):
        self.logprobs = []
        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(decoding.temperature)])
        if decoding.top_k > 0:
            self.warpers.append(TopKLogitsWarper(decoding.top_k))
        if decoding.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(decoding.top_p))
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def choose(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        warped = self.warpers(input_ids, scores.clone()).float()
        probs = torch.softmax(warped, dim=-1)
        chosen = torch.stack(
            [
                torch.multinomial(row, 1, generator=gen)
                for row, gen in zip(probs, self.generators, strict=True)
            ]
        )
        return chosen, warped


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


class _RowsStopped(StoppingCriteria):
    """Ends the rows of one batch whose request ``should_stop(offset + row)`` says so, checked after
    every decoding step (``generate`` keeps going for the other rows)."""

    def __init__(self, should_stop: Callable[[int], bool], offset: int, rows: int):
        self.should_stop, self.offset, self.rows = should_stop, offset, rows

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object
    ) -> torch.BoolTensor:
        stopped = [self.should_stop(self.offset + row) for row in range(self.rows)]
        return torch.tensor(stopped, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]
