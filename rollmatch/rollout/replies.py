"""What a rollout server's answers become on the trainer's side: ``/infer/`` items -> :class:`Rollout`.

Owns: :func:`reply_rollout` (one ``/infer/`` reply item, with its behaviour log-probs checked),
:func:`behaviour_logprobs`, :func:`parse_infer_reply` (a whole ``/infer/`` answer, checked against the
requests sent) and :func:`init_reply` (the ``/init_communicator/`` answer). Leaves out:
sending the calls (``rollout.client``, ``rollout.connection``) and the wire shapes (``rollmatch.protocol``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from rollmatch.errors import BackendError, SyncError
from rollmatch.protocol import INFER_REPLY, InitCommunicatorReply, RolloutOutput
from rollmatch.rollout.connection import ServerConnection
from rollmatch.rollout.types import Rollout, RolloutProvenance, RolloutRequest


def init_reply(conn: ServerConnection, answer: Any) -> InitCommunicatorReply:
    try:
        return InitCommunicatorReply.model_validate(answer)
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        raise SyncError(
            f"rollout server {conn.url}: /init_communicator/ answered no sync lease and digest key "
            f"({'.'.join(map(str, first['loc'])) or 'answer'}: {first['msg']}); is it a rollmatch server of the "
            "same protocol version?"
        ) from None


def reply_rollout(
    conn: ServerConnection, request: RolloutRequest, output: RolloutOutput, provenance: RolloutProvenance
) -> Rollout:
    choice = output.response.choices[0]
    if choice.token_ids is None or output.response.prompt_token_ids is None:
        raise BackendError(f"rollout server {conn.url} returned no token ids (return_details ignored)")
    return Rollout(
        sample_id=request.sample_id,
        prompt_token_ids=output.response.prompt_token_ids,
        response_token_ids=choice.token_ids,
        text=choice.message.content,
        finish_reason=choice.finish_reason,
        weight_version=output.weight_version,
        provenance=provenance,
        **behaviour_logprobs(
            conn, choice.token_ids, choice.finish_reason, choice.logprobs, output.rollout_logprobs
        ),
    )


def behaviour_logprobs(
    conn: ServerConnection,
    token_ids: list[int],
    finish_reason: str,
    content: dict[str, list[dict[str, Any]]] | None,
    rollout_logprobs: list[list[float]],
) -> dict[str, Any]:
    """``response_logprobs`` / ``stop_token_id`` / ``stop_logprob`` of a reply item (asked with
    ``request_config.logprobs``): one value per response token, then the stop token's (its id from the
    ``token_id:<id>`` of the last ``choice.logprobs`` entry) when the server sent one more."""
    if not rollout_logprobs:
        raise BackendError(
            f"rollout server {conn.url} returned no log-probs although request_config.logprobs was set; "
            "update the server (rollmatch serve records the sampled tokens' log-probs)"
        )
    values = rollout_logprobs[0]
    extra = len(values) - len(token_ids)
    if extra not in (0, 1) or (extra == 1 and finish_reason != "stop"):
        raise BackendError(
            f"rollout server {conn.url} returned {len(values)} log-probs for {len(token_ids)} response tokens "
            f"(finish_reason {finish_reason!r}); expected one per token, plus one for a stop token"
        )
    stop_token_id = None
    if extra:
        token = str((content or {}).get("content", [{}])[-1].get("token", ""))
        if not token.startswith("token_id:") or not token[len("token_id:") :].isdigit():
            raise BackendError(
                f"rollout server {conn.url} sent a stop token's log-prob without its id (choice.logprobs "
                f"entry {token[:40]!r}, expected 'token_id:<id>')"
            )
        stop_token_id = int(token[len("token_id:") :])
    return {
        "response_logprobs": values[: len(token_ids)],
        "stop_token_id": stop_token_id,
        "stop_logprob": values[-1] if extra else None,
    }


def parse_infer_reply(conn: ServerConnection, content: bytes, expected: int) -> list[RolloutOutput]:
    """``/infer/``'s answer as rollout outputs, one per request sent; anything else names the server."""
    try:
        outputs = INFER_REPLY.validate_json(content)
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        raise BackendError(
            f"rollout server {conn.url}: /infer/ answered something that is not a list of rollout outputs "
            f"({'.'.join(map(str, first['loc'])) or 'answer'}: {first['msg']}); is it a rollmatch server?"
        ) from None
    if len(outputs) != expected:
        raise BackendError(f"rollout server {conn.url}: sent {expected} requests, got {len(outputs)} outputs")
    return outputs
