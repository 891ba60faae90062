"""Rollout-server request preparation: wire requests -> prompt token ids + decoded images.

Owns: :class:`PromptPreparer` (swift chat messages -> the model's chat template, or the trainer's
token ids verbatim after checking them against the vocabulary and the image placeholders), the
text cap of a conversation (:data:`MAX_TEXT_CHARS`, checked before the template renders it; the
wire bounds its messages and parts),
:func:`chat_messages` (swift / OpenAI message shapes -> chat-template messages and image slots)
and :func:`trim_at_stop_strings` (ms-swift ``stop`` strings applied to a response). Every
malformed request is a ``ValueError`` naming the field, checked here before any engine sees it,
so an engine never receives a request it could choke on. Leaves out: engines, HTTP and how the
template is rendered (``server.chat_template``: the model's own template only, with a bounded
number of steps).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollmatch.data.prompts import IMAGE_TOKEN
from rollmatch.protocol import ChatTurn, InferRequest, TextPart
from rollmatch.server.chat_template import ChatTemplate
from rollmatch.server.limits import RequestTooLarge
from rollmatch.server.media import MediaPolicy, decode_image
from rollmatch.server.timing import PhaseTimes

if TYPE_CHECKING:
    from PIL.Image import Image

VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
EOS_TOKEN = "<|im_end|>"
IMAGE_TAG = "<image>"
MAX_TEXT_CHARS = 1 << 21  # per prompt: over 500k tokens of English, twice a 256k context


@dataclass
class PreparedPrompt:
    """A request ready for an engine: the prompt ids it will use and the decoded images;
    ``engine_input`` holds what the engine made of them in the prepare hop (its image processor
    run off the engine thread, ``ServerEngine.preprocess``), or ``None``."""

    sample_id: str
    prompt_token_ids: list[int]
    images: list[Image]
    engine_input: Any = None


class PromptPreparer:
    """Turns wire requests into prompt ids + images with the model directory's processor."""

    def __init__(
        self,
        processor: Any,
        *,
        vocab_size: int | None = None,
        media: MediaPolicy | None = None,
        max_images: int = 8,
    ):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.media = media or MediaPolicy()
        self.max_images = max_images
        ids = self.tokenizer.convert_tokens_to_ids
        self.image_token_id = int(ids(IMAGE_TOKEN))
        self.video_token_id = int(ids(VIDEO_TOKEN))
        self.vision_start_id = int(ids(VISION_START))
        self.eos_token_id = int(ids(EOS_TOKEN))
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.template = ChatTemplate.of_tokenizer(self.tokenizer)
        # Ids the tokenizer can decode and the embedding holds (vLLM refuses ids past the tokenizer).
        self.vocab_size = min(len(self.tokenizer), vocab_size or len(self.tokenizer))

    def prepare(
        self,
        request: InferRequest,
        index: int,
        times: PhaseTimes | None = None,
        encoded: dict[str, bytes] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> PreparedPrompt:
        """Decode the images; take the trainer's ids (checked), or encode the chat messages.

        ``times`` (optional) gets the image decoding as its ``decode`` phase; ``encoded`` holds the
        images' bytes already decoded from base64 (``server.media.image_size``), by field name;
        ``cancelled`` (the client left?) is asked before every image.
        """
        times = times if times is not None else PhaseTimes()
        where = f"infer_requests[{index}]"
        sample_id = request.sample_id or request.uuid or f"request-{index}"
        if len(request.images) > self.max_images:
            raise RequestTooLarge(
                f"{where}.images",
                f"{where}.images holds {len(request.images)} images, over this server's limit of "
                f"{self.max_images} per prompt (rollmatch serve --max-images-per-request)",
            )
        if request.prompt_token_ids:
            self.check_token_ids(f"{where}.prompt_token_ids", request.prompt_token_ids, len(request.images))
            with times.phase("decode"):
                images = [
                    self._image(value, f"{where}.images[{i}]", encoded, cancelled)
                    for i, value in enumerate(request.images)
                ]
            return PreparedPrompt(sample_id, list(request.prompt_token_ids), images)
        self._check_text_size(request, where)
        messages, sources = chat_messages(request.messages, request.images, where)
        if len(sources) > self.max_images:
            raise RequestTooLarge(
                f"{where}.messages",
                f"{where} holds {len(sources)} images, over this server's limit of {self.max_images} per prompt "
                "(rollmatch serve --max-images-per-request)",
            )
        if self.template is None:
            raise ValueError(
                f"{where}.messages: the served model has no chat template; send the trainer's prompt_token_ids"
            )
        flags = {key: value for key, value in request.chat_template_kwargs.items() if value is not None}
        text = self.template.render(messages, flags, where=f"{where}.messages")  # before decoding: cheaper
        with times.phase("decode"):
            images = [self._image(value, name, encoded, cancelled) for name, value in sources]
        batch = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids = batch["input_ids"][0].tolist()
        self.check_token_ids(f"{where}.messages", ids, len(images))
        return PreparedPrompt(sample_id, ids, images)

    def tensor_bytes(self, width: int, height: int) -> int:
        """Bytes of what the image processor makes of a ``width`` x ``height`` image: its
        ``smart_resize``d size in patches x (channels x temporal patch x patch^2) float32 values. An
        aspect ratio the processor refuses is a ``ValueError`` here, before decoding."""
        image_processor = getattr(self.processor, "image_processor", None)
        patch = getattr(image_processor, "patch_size", None)
        if image_processor is None or patch is None:
            return width * height * 3 * 4  # no patch processor: the image as float32 RGB
        return (
            self._patches(width, height) * 3 * int(image_processor.temporal_patch_size) * int(patch) ** 2 * 4
        )

    def image_tokens(self, width: int, height: int) -> int:
        """The ``<|image_pad|>`` tokens the processor makes of a ``width`` x ``height`` image."""
        merge = int(self.processor.image_processor.merge_size)
        return self._patches(width, height) // (merge * merge)

    def _patches(self, width: int, height: int) -> int:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        image_processor = self.processor.image_processor
        patch, size = int(image_processor.patch_size), image_processor.size
        resized_h, resized_w = smart_resize(
            height,
            width,
            factor=patch * int(image_processor.merge_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
        )
        return (resized_h // patch) * (resized_w // patch)

    def chat_length(self, request: InferRequest, index: int, sizes: dict[str, tuple[int, int]]) -> int:
        """The prompt tokens a chat request will have, from its rendered text and its images' header
        sizes (``field name -> (width, height)``): nothing decoded. 0 when :meth:`prepare` will
        refuse the request anyway (no template, too many images)."""
        where = f"infer_requests[{index}]"
        self._check_text_size(request, where)
        messages, sources = chat_messages(request.messages, request.images, where)
        if (
            self.template is None
            or len(sources) > self.max_images
            or any(name not in sizes for name, _ in sources)
        ):
            return 0
        flags = {key: value for key, value in request.chat_template_kwargs.items() if value is not None}
        text = self.template.render(messages, flags, where=f"{where}.messages")
        text_tokens = len(self.tokenizer(text)["input_ids"])
        return text_tokens + sum(self.image_tokens(*sizes[name]) - 1 for name, _ in sources)

    def check_token_ids(self, where: str, ids: Sequence[int], num_images: int) -> None:
        """Ids inside the vocabulary; one ``<|vision_start|><|image_pad|>...`` block per image, no video."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab_size}) of the served model"
            )
        if self.video_token_id in ids:
            raise ValueError(f"{where}: holds {VIDEO_TOKEN} tokens; the rollout server takes no videos")
        starts = [i for i, t in enumerate(ids) if t == self.vision_start_id]
        if any(i + 1 >= len(ids) or ids[i + 1] != self.image_token_id for i in starts):
            raise ValueError(f"{where}: every {VISION_START} must be followed by {IMAGE_TOKEN} tokens")
        runs = sum(1 for a, b in itertools.pairwise([-1, *ids]) if b == self.image_token_id and a != b)
        if runs != len(starts) or runs != num_images:
            raise ValueError(
                f"{where}: the ids hold {len(starts)} image placeholder block(s) ({runs} {IMAGE_TOKEN} run(s)) but "
                f"the request carries {num_images} image(s); send one image per {VISION_START}{IMAGE_TOKEN}... block"
            )

    def _check_text_size(self, request: InferRequest, where: str) -> None:
        chars = sum(_text_chars(message) for message in request.messages)
        if chars > MAX_TEXT_CHARS:
            raise RequestTooLarge(
                f"{where}.messages",
                f"{where}.messages hold {chars} characters of text, over this server's limit of "
                f"{MAX_TEXT_CHARS} per prompt",
            )

    def _image(
        self,
        value: str,
        where: str,
        encoded: dict[str, bytes] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Image:
        if cancelled is not None and cancelled():
            raise ValueError(
                f"{where}: the client disconnected; the call was dropped before decoding this image"
            )
        return decode_image(value, self.media, where, encoded)


def chat_messages(
    messages: Sequence[ChatTurn], images: Sequence[str], where: str = "infer_request"
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """swift / OpenAI messages -> chat-template messages, plus ``(field name, value)`` per image slot.

    String content may hold ``<image>`` tags and list content ``image`` / ``image_url`` parts; a tag,
    or a part without a value, takes the next entry of the request's ``images`` (swift's rule). The
    number of such slots must equal ``len(images)``.
    """
    out: list[dict[str, Any]] = []
    sources: list[tuple[str, str]] = []
    pending = iter(enumerate(images))

    def next_image(slot: str) -> tuple[str, str]:
        index, value = next(pending, (None, ""))
        if index is None:
            tags = sum(_slots(m) for m in messages)
            raise ValueError(
                f"{slot}: the messages hold {tags} image slot(s) ({IMAGE_TAG} tags or image parts without a value) "
                f"but the request carries {len(images)} image(s)"
            )
        return f"{where}.images[{index}]", value

    for m, message in enumerate(messages):
        name = f"{where}.messages[{m}].content"
        parts: list[dict[str, Any]] = []
        if isinstance(message.content, str):
            for i, text in enumerate(message.content.split(IMAGE_TAG)):
                if i:
                    parts.append({"type": "image"})
                    sources.append(next_image(name))
                if text:
                    parts.append({"type": "text", "text": text})
        else:
            for p, part in enumerate(message.content):
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                    continue
                parts.append({"type": "image"})
                value = part.value
                sources.append(next_image(f"{name}[{p}]") if value is None else (f"{name}[{p}]", value))
        out.append({"role": message.role, "content": parts})
    unused = next(pending, None)
    if unused is not None:
        raise ValueError(
            f"{where}.images: the request carries {len(images)} image(s) but the messages use only "
            f"{unused[0]}: add an {IMAGE_TAG} tag (or image part) per image"
        )
    return out, sources


def _text_chars(message: ChatTurn) -> int:
    if isinstance(message.content, str):
        return len(message.content)
    return sum(len(part.text) for part in message.content if isinstance(part, TextPart))


def _slots(message: ChatTurn) -> int:
    if isinstance(message.content, str):
        return message.content.count(IMAGE_TAG)
    return sum(1 for part in message.content if not isinstance(part, TextPart) and part.value is None)


def trim_at_stop_strings(
    token_ids: list[int], text: str, stops: Sequence[str], tokenizer: Any
) -> tuple[list[int], str] | None:
    """The response cut before the first ``stop`` string, or ``None`` when none occurs.

    The text ends right before the stop string (OpenAI / vLLM semantics); the token ids keep only
    the tokens that end before it, so they never contain any part of the stop string. The cut is
    found by bisection on the decoded length (O(log N) decodes of the prefix, not one per token),
    then stepped back over tokens that end mid-character (they decode to U+FFFD, not a prefix).
    """
    cut = min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=-1)
    if cut < 0:
        return None
    before = text[:cut]

    def decoded(n: int) -> str:
        return str(tokenizer.decode(token_ids[:n], skip_special_tokens=False))

    low, high = 0, len(token_ids)  # the most tokens whose text is not longer than the cut
    while low < high:
        middle = (low + high + 1) // 2
        if len(decoded(middle)) <= cut:
            low = middle
        else:
            high = middle - 1
    kept = low
    while kept > 0 and not before.startswith(decoded(kept)):
        kept -= 1
    return token_ids[:kept], before
