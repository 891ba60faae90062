"""The checks of one ``/infer/`` call before anything reaches the engine: caps, cross-field rules, images.

Owns: :class:`InferChecks` (a call's caps the wire models cannot know: request count, ``max_tokens``,
the seed range, ``top_k``, prompt lengths within ``max_model_len``; its images checked from their
headers and their pixels and tensor bytes reserved before any is decoded; then the prepared prompts,
preprocessed for the engine) and :func:`engine_failure` (what a failed generation reports: the
request's fault, a 400, or the engine's, a 503). Leaves out: the order of the ``/infer/`` flow and
admission (``server.rollout_server``), decoding images (``server.media``) and preparing one prompt
(``server.prompt_preparer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from rollmatch.errors import BackendError
from rollmatch.protocol import SEED_MAX, InferBody, InferRequest, RequestConfig
from rollmatch.server.engines import ServerEngine
from rollmatch.server.limits import RequestTooLarge, ServerLimits
from rollmatch.server.media import PixelBudget, PixelLease, TensorBudget
from rollmatch.server.prompt_preparer import PreparedPrompt, chat_messages
from rollmatch.server.timing import PhaseTimes


class InferChecks:
    """The checks of one server (its engine, caps and pixel / tensor budgets); every method raises a
    ``ValueError`` (a 4xx naming the field) or a ``ServerBusy`` (429) and leaves nothing reserved."""

    def __init__(
        self, engine: ServerEngine, limits: ServerLimits, pixels: PixelBudget, tensors: TensorBudget
    ):
        self.engine, self.limits, self.pixels, self.tensors = engine, limits, pixels, tensors

    def check(
        self,
        body: InferBody,
        times: PhaseTimes,
        cancelled: Callable[[], bool] | None = None,
        *,
        preprocess: bool = True,
    ) -> tuple[RequestConfig, list[PreparedPrompt], PixelLease]:
        """Caps and cross-field checks the wire models cannot know; then the call's images checked from
        their headers and their pixels reserved before any is decoded (``server.media``); then the
        prepared prompts."""
        config = body.request_config or RequestConfig()
        count = len(body.infer_requests)
        if count > self.limits.max_requests_per_call:
            raise RequestTooLarge(
                "infer_requests",
                f"infer_requests holds {count} requests, over this server's limit of "
                f"{self.limits.max_requests_per_call} per call (rollmatch serve --max-requests-per-call); "
                "split the call",
            )
        if config.max_tokens is not None and config.max_tokens > self.limits.max_tokens:
            raise RequestTooLarge(
                "request_config.max_tokens",
                f"request_config.max_tokens = {config.max_tokens} is over this server's cap of "
                f"{self.limits.max_tokens} new tokens (rollmatch serve --max-tokens)",
                status=422,
            )
        if config.seed is not None and config.seed + max(count - 1, 0) > SEED_MAX:
            raise ValueError(
                f"request_config.seed = {config.seed}: request j samples with seed + j, which must stay within "
                f"[0, 2**63 - 1] for all {count} requests; send a smaller seed"
            )
        vocab = self.engine.preparer.vocab_size
        if config.top_k is not None and config.top_k > vocab:
            raise ValueError(
                f"request_config.top_k = {config.top_k} is larger than the vocabulary ({vocab}); send -1 to disable"
            )
        self._check_prompt_ids_fit(body.infer_requests)
        preparer = self.engine.preparer
        images = list(_image_sources(body.infer_requests, preparer.max_images))
        encoded: dict[str, bytes] = {}  # base64 decoded once: for the header check, then for decoding
        sizes: list[tuple[int, int]] = []
        pixels = self.pixels.reserve_call(images, preparer.media, encoded, sizes)
        try:
            # What the processor makes of them, before any is decoded (released with the pixels).
            pixels.linked.append(self.tensors.reserve(sum(preparer.tensor_bytes(w, h) for w, h in sizes)))
            self._check_chat_lengths(
                body.infer_requests, dict(zip((n for n, _ in images), sizes, strict=False))
            )
            prompts = [
                preparer.prepare(r, i, times, encoded, cancelled) for i, r in enumerate(body.infer_requests)
            ]
            pixels.cover(sum(image.width * image.height for p in prompts for image in p.images))
            if preprocess:
                with times.phase("preprocess"):
                    self._preprocess(prompts)
        except BaseException:
            pixels.release()
            raise
        return config, prompts, pixels

    def _preprocess(self, prompts: list[PreparedPrompt]) -> None:
        """The engine's image processing, here in the prepare hop so the engine thread only decodes;
        what the engine refuses is the request's fault (400), anything else the engine's (503)."""
        for prompt in prompts:
            try:
                self.engine.preprocess(prompt)
            except BackendError:
                raise
            except Exception as exc:
                raise engine_failure(exc) from exc

    def _check_chat_lengths(self, requests: list[InferRequest], sizes: dict[str, tuple[int, int]]) -> None:
        """Refuse a call whose chat prompt leaves no room within ``max_model_len``, each prompt
        tokenised in turn (its images counted from their header sizes) before any image is decoded."""
        for index, request in enumerate(requests):
            if request.prompt_token_ids:
                continue
            length = self.engine.preparer.chat_length(request, index, sizes)
            if length >= self.engine.max_model_len:
                raise ValueError(
                    f"prompt too long: infer_requests[{index}].messages make a prompt of {length} tokens, which "
                    f"leaves no room for new tokens within the server's max_model_len of "
                    f"{self.engine.max_model_len}; shorten it or serve with a larger --max-model-len"
                )

    def _check_prompt_ids_fit(self, requests: list[InferRequest]) -> None:
        """Refuse a call whose given prompt ids leave no room within ``max_model_len`` before any of
        its images is decoded."""
        longest = max((len(r.prompt_token_ids or ()) for r in requests), default=0)
        if longest >= self.engine.max_model_len:
            index = next(i for i, r in enumerate(requests) if len(r.prompt_token_ids or ()) == longest)
            raise ValueError(
                f"prompt too long: a prompt of {longest} tokens leaves no room for new tokens within the server's "
                f"max_model_len of {self.engine.max_model_len} (infer_requests[{index}].prompt_token_ids); "
                "shorten it or serve with a larger --max-model-len"
            )


def _image_sources(requests: list[InferRequest], max_images: int) -> Iterator[tuple[str, str]]:
    """``(field name, value)`` of every image the call's prompts use, as ``PromptPreparer.prepare``
    takes them; a prompt over ``max_images`` is left out (prepare refuses it before decoding)."""
    for index, request in enumerate(requests):
        where = f"infer_requests[{index}]"
        if request.prompt_token_ids:
            sources = [(f"{where}.images[{i}]", value) for i, value in enumerate(request.images)]
        else:
            sources = chat_messages(request.messages, request.images, where)[1]
        if len(sources) <= max_images:
            yield from sources


def engine_failure(exc: Exception) -> Exception:
    """What a failed generation reports: the engine refusing this request's values is the client's
    problem (400); anything else is the engine's (503). Either way the engine was recovered."""
    if isinstance(exc, ValueError | TypeError | OverflowError):
        return ValueError(
            f"the engine refused the request ({type(exc).__name__}: {exc}); nothing was generated"
        )
    if isinstance(exc, BackendError):
        return exc
    return BackendError(
        f"generation failed ({type(exc).__name__}: {exc}); the engine was reset and keeps serving"
    )
