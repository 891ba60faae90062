"""What a done ``/infer/`` call answers: engine outputs -> reply items (``RolloutOutput``).

Owns: :func:`rollout_output` (one reply item, with the weight versions that produced it and, when asked,
the sampled tokens' log-probs), :func:`apply_stops` (stop strings) and :func:`sampled_logprobs`.
Leaves out: the ``/infer/`` flow (``server.rollout_server``) and the wire shapes (``rollmatch.protocol``).
"""

from __future__ import annotations

from typing import Any

from rollmatch.errors import BackendError
from rollmatch.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    RolloutOutput,
    Usage,
    logprob_content,
)
from rollmatch.server.engines import EngineOutput
from rollmatch.server.prompt_preparer import PreparedPrompt, trim_at_stop_strings


def apply_stops(out: EngineOutput, stops: list[str], tokenizer: Any) -> EngineOutput:
    """``out`` cut at the first of ``stops`` in its text (finish reason ``stop``), or unchanged."""
    trimmed = trim_at_stop_strings(out.token_ids, out.text, stops, tokenizer)
    if trimmed is None:
        return out
    kept = len(trimmed[0])  # the log-probs of the kept tokens; the stop string is no stop token
    logprobs = None if out.logprobs is None else out.logprobs[:kept]
    return EngineOutput(out.prompt_token_ids, trimmed[0], trimmed[1], "stop", logprobs)


def rollout_output(
    model: str,
    prompt: PreparedPrompt,
    out: EngineOutput,
    versions: tuple[int, int],
    details: bool,
    logprobs: bool = False,
) -> RolloutOutput:
    """One reply item; ``weight_version`` is the oldest version that produced it (what freshness
    gates use), ``weight_version_last`` the newest (they differ only in the ``keep`` update mode).
    With ``logprobs`` the sampled tokens' log-probs (the stop token's last, when it stopped on one) go in
    ``choice.logprobs`` (swift / OpenAI form) and ``rollout_logprobs``."""
    first, last = versions
    sampled, values = sampled_logprobs(out) if logprobs else (None, None)
    return RolloutOutput(
        response=ChatCompletionResponse(
            model=model,
            choices=[
                ChatChoice(
                    index=0,
                    message=ChatMessage(content=out.text),
                    finish_reason=out.finish_reason,
                    logprobs=None if sampled is None else logprob_content(sampled, values),
                    token_ids=out.token_ids if details else None,
                )
            ],
            usage=Usage(
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=len(out.token_ids),
                total_tokens=len(out.prompt_token_ids) + len(out.token_ids),
            ),
            prompt_token_ids=out.prompt_token_ids if details else None,
        ),
        response_token_ids=[out.token_ids] if details else [],
        rollout_logprobs=[] if values is None else [values],
        rollout_infos={"weight_version": first, "weight_version_last": last},
        weight_version=first,
        weight_version_last=last,
        sample_id=prompt.sample_id,
    )


def sampled_logprobs(out: EngineOutput) -> tuple[list[int], list[float]]:
    """The sampled token ids and their log-probs: the response's, then the stop token's (not in the
    stop-trimmed ``token_ids``)."""
    if out.logprobs is None or len(out.logprobs) != len(out.token_ids):
        raise BackendError(
            f"the {type(out).__name__} of this engine carries no log-probs for its {len(out.token_ids)} tokens; "
            "request_config.logprobs needs an engine that records them"
        )
    if out.stop_logprob is None or out.stop_token_id is None:
        return list(out.token_ids), list(out.logprobs)
    return [*out.token_ids, out.stop_token_id], [*out.logprobs, out.stop_logprob]
