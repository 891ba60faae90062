"""Prompt encoding: the trainer owns the chat template and image processing of every prompt.

Owns: :func:`load_rgb`, :func:`load_processor` (the one processor loader), :class:`EncodedPrompt`
(token ids + processor outputs of one record, exactly what the HF model consumes) and
:class:`PromptEncoder` (record -> encoded prompt, record boxes -> GT objects in the configured
coordinate frame). Rollout backends receive these ids and must use them (see
:class:`rollmatch.data.requests.RolloutRequest`).
Leaves out: reading JSONL records (``data.records``), serializing objects (``detection.codec``) and
building training targets (``detection.targets``).

Frames: ``norm1000`` boxes are 0..1000 of the original image; ``pixels`` boxes are pixels of the
processor-resized image, whose size is ``image_grid_thw`` (h, w) times the patch size. The encoder
takes a resolved frame: the trainer's comes from the run resolved at start-up
(``config.resolved``); :meth:`PromptEncoder.from_pretrained` resolves ``auto`` itself for a
standalone encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from rollmatch.config.frames import resolve_coord_frame
from rollmatch.data.labels import LABELS_PLACEHOLDER, PromptLabels, prompt_labels
from rollmatch.data.records import load_image
from rollmatch.data.requests import RolloutRequest
from rollmatch.detection.objects import CoordFrame, DetObject, canonical_order, to_frame
from rollmatch.detection.objects import frame_extent as _frame_extent
from rollmatch.errors import ConfigError, ConfigProblem, DataError

if TYPE_CHECKING:
    from rollmatch.config.schema import DataConfig
    from rollmatch.data.records import Record

IMAGE_TOKEN = "<|image_pad|>"  # Qwen-VL's image placeholder; a prompt holds one run per image


def load_rgb(path: str | Path) -> Image.Image:
    """Open an image file fully decoded as RGB (grayscale, palette and RGBA images are converted).

    The one image loader of the data package (:func:`rollmatch.data.records.load_image`); errors
    are :class:`~rollmatch.errors.DataError` naming the file.
    """
    return load_image(path)


@dataclass
class EncodedPrompt:
    """One record's prompt as the model consumes it (batch dimension dropped).

    ``input_ids`` include the chat template and the generation prompt ``<|im_start|>assistant\\n``;
    ``pixel_values``/``image_grid_thw``/``mm_token_type_ids`` are the processor outputs for
    ``images``. ``image_sizes`` are the original ``(W, H)``; ``frame_sizes`` the resized ``(W, H)``.
    """

    sample_id: str
    input_ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    mm_token_type_ids: list[int]
    images: list[Image.Image]
    image_sizes: list[tuple[int, int]]
    frame_sizes: list[tuple[int, int]]
    messages: list[dict[str, Any]]

    def to_request(self) -> RolloutRequest:
        """The rollout request for this prompt (the ids are authoritative for every backend)."""
        return RolloutRequest(
            sample_id=self.sample_id,
            prompt_token_ids=list(self.input_ids),
            images=list(self.images),
            messages=self.messages,
            pixel_values=self.pixel_values,
            image_grid_thw=self.image_grid_thw,
            mm_token_type_ids=list(self.mm_token_type_ids),
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Batch-of-one tensors for ``model(**inputs)`` / ``model.generate(**inputs)``."""
        return {
            "input_ids": torch.tensor([self.input_ids], dtype=torch.long),
            "attention_mask": torch.ones(1, len(self.input_ids), dtype=torch.long),
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "mm_token_type_ids": torch.tensor([self.mm_token_type_ids], dtype=torch.long),
        }


class PromptEncoder:
    """Encodes records into prompts with one processor, prompt text and coordinate frame."""

    def __init__(
        self, processor: Any, prompt: str, coord_frame: CoordFrame, labels: PromptLabels | None = None
    ):
        if coord_frame not in ("norm1000", "pixels"):
            raise ConfigError(
                [
                    ConfigProblem(
                        "data.coord_frame",
                        coord_frame,
                        "PromptEncoder takes a resolved frame: build it with PromptEncoder.from_pretrained "
                        "(resolves auto), or pass norm1000 / pixels",
                    )
                ]
            )
        if LABELS_PLACEHOLDER in prompt and labels is None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "data.labels",
                        None,
                        f"data.prompt lists {LABELS_PLACEHOLDER}: give the class names (data.labels)",
                    )
                ]
            )
        self.processor = processor
        self.prompt = prompt
        self.labels = labels  # the run's class names ({labels}); None: the prompt names none
        self.coord_frame: CoordFrame = coord_frame
        self.patch_size = int(processor.image_processor.patch_size)
        self.merge_size = int(processor.image_processor.merge_size)
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        data_cfg: DataConfig,
        *,
        object_format: str = "qwen_json",
        seed: int = 0,
    ) -> PromptEncoder:
        """Load the model directory's processor; ``data.min_pixels``/``max_pixels`` override its sizes.

        ``data.coord_frame: auto`` resolves from the directory's family
        (:func:`rollmatch.config.frames.resolve_coord_frame`; ``object_format`` is
        ``custom.object_format``, whose ``coord_tokens`` make ``auto`` norm1000).
        """
        frame = resolve_coord_frame(data_cfg.coord_frame, model_dir, object_format=object_format)
        return cls(
            load_processor(model_dir, data_cfg.min_pixels, data_cfg.max_pixels),
            data_cfg.prompt,
            frame,
            prompt_labels(data_cfg, seed),
        )

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def eos_token_id(self) -> int:
        """``<|im_end|>``: ends every assistant turn, hence every rollout and training target."""
        return int(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def pixel_bounds(self) -> tuple[int, int]:
        """The processor's ``(min_pixels, max_pixels)``; rollout engines must resize the same way."""
        size = self.processor.image_processor.size
        return int(size["shortest_edge"]), int(size["longest_edge"])

    def messages(self, record: Record) -> list[dict[str, Any]]:
        """The chat form of the prompt: the record's images (by path), then the prompt text (the
        record's own ``prompt`` when it has one, else ``data.prompt``; ``{labels}`` filled in)."""
        content: list[dict[str, Any]] = [{"type": "image", "image": str(path)} for path in record.images]
        text = record.prompt if record.prompt is not None else self.prompt
        if self.labels is not None:
            text = self.labels.fill(text, record.id, [obj.label for obj in record.objects])
        content.append({"type": "text", "text": text})
        return [{"role": "user", "content": content}]

    def encode(self, record: Record) -> EncodedPrompt:
        """Apply the chat template and the image processor to one record."""
        if not record.images:
            raise DataError(f"record {record.id!r} has no image; every detection record needs at least one")
        images = [load_rgb(path) for path in record.images]
        messages = self.messages(record)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        batch = self.processor(text=[text], images=images, return_tensors="pt")
        if "mm_token_type_ids" not in batch:
            raise ConfigError(
                [
                    ConfigProblem(
                        "model.path",
                        type(self.processor).__name__,
                        "use a Qwen-VL processor that returns mm_token_type_ids (transformers >= 5.16)",
                    )
                ]
            )
        grid = batch["image_grid_thw"]
        return EncodedPrompt(
            sample_id=record.id,
            input_ids=batch["input_ids"][0].tolist(),
            pixel_values=batch["pixel_values"],
            image_grid_thw=grid,
            mm_token_type_ids=batch["mm_token_type_ids"][0].tolist(),
            images=images,
            image_sizes=[image.size for image in images],
            frame_sizes=[(int(w) * self.patch_size, int(h) * self.patch_size) for _, h, w in grid.tolist()],
            messages=messages,
        )

    def gt_objects(self, record: Record, encoded: EncodedPrompt) -> list[DetObject]:
        """The record's boxes as integer frame coordinates, in canonical (serialization) order.

        Boxes refer to the first image; its decoded size must equal the record's width/height.
        """
        if encoded.image_sizes[0] != record.image_size:
            raise DataError(
                f"record {record.id!r}: width/height {record.image_size} differ from the decoded image "
                f"{record.images[0]!r} of size {encoded.image_sizes[0]}; fix the record's width and height"
            )
        objects = [
            DetObject(
                obj.label, to_frame(obj.bbox, record.image_size, self.coord_frame, encoded.frame_sizes[0])
            )
            for obj in record.objects
        ]
        return canonical_order(objects)

    def ignore_regions(self, record: Record, encoded: EncodedPrompt) -> list[DetObject]:
        """The record's ignore (crowd) regions in the frame of :meth:`gt_objects`."""
        return [
            DetObject(o.label, to_frame(o.bbox, record.image_size, self.coord_frame, encoded.frame_sizes[0]))
            for o in record.ignore
        ]

    def frame_extent(self, encoded: EncodedPrompt) -> tuple[int, int]:
        """The largest ``(x, y)`` coordinate of the frame: ``(1000, 1000)`` or the resized image size."""
        return _frame_extent(self.coord_frame, encoded.frame_sizes[0])


PROBE_IMAGE_SIZE = (1237, 411)  # (W, H): not a multiple of any patch size, aspect changed by the resize


def image_probe(processor: Any, size: tuple[int, int] = PROBE_IMAGE_SIZE) -> tuple[tuple[int, int], int]:
    """``((W, H) resized, image tokens)`` the processor makes of a ``size`` image: what trainer and
    rollout server must agree on (the ``pixels`` frame and the prompt length both follow from it)."""
    image_processor = processor.image_processor
    grid = image_processor(images=[Image.new("RGB", size)], return_tensors="pt")["image_grid_thw"][0]
    patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
    t, h, w = (int(v) for v in grid.tolist())
    return (w * patch, h * patch), t * h * w // (merge * merge)


def load_processor(
    model_dir: str | Path, min_pixels: int | None = None, max_pixels: int | None = None
) -> Any:
    """The model directory's processor with ``data.min_pixels`` / ``max_pixels`` applied (``None``
    keeps the saved value): the one processor loader of the trainer, evaluation and rollout servers.

    A process loads it once and hands it on (the prompt encoder, the server client's image wire and
    start-up cross-check, a server's prompt preparer).
    """
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_dir))
    if min_pixels is not None or max_pixels is not None:
        set_pixel_bounds(processor, min_pixels, max_pixels)
    return processor


def set_pixel_bounds(processor: Any, min_pixels: int | None, max_pixels: int | None) -> None:
    """Override the image processor's pixel budget (``None`` keeps the saved value)."""
    size = dict(processor.image_processor.size)
    low = min_pixels if min_pixels is not None else int(size["shortest_edge"])
    high = max_pixels if max_pixels is not None else int(size["longest_edge"])
    # Both bounds from the config: rule_pixels refused that when the run was resolved; one of them the
    # checkpoint's saved value: only known here.
    if (min_pixels is None or max_pixels is None) and low > high:
        raise ConfigError(
            [ConfigProblem("data.min_pixels", low, f"must not exceed data.max_pixels (= {high}); lower it")]
        )
    factor = int(processor.image_processor.patch_size) * int(processor.image_processor.merge_size)
    if high < factor * factor:
        raise ConfigError(
            [ConfigProblem("data.max_pixels", high, f"must be at least {factor * factor} (one merged patch)")]
        )
    processor.image_processor.size = {"shortest_edge": low, "longest_edge": high}
