"""Tiny random-initialised Qwen-VL models, built offline in seconds (no model hub needed).

Owns: a locally trained byte-level BPE tokenizer with the Qwen special tokens and a Qwen-style chat
template (:func:`build_tokenizer`), and a tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint directory
(model + tokenizer + processor) that ``AutoModelForImageTextToText``, ``AutoProcessor`` and vLLM
load like a real one (:func:`build_tiny_model`). Leaves out: environment workarounds
(:mod:`rollmatch.models.compat`, applied by ``import rollmatch``) and prompt encoding
(:mod:`rollmatch.data.prompts`).

The models are random: they exist so every part of the pipeline (rollouts, parsing, packing,
training, weight sync, vLLM) runs for real on CPU in tests and the demo.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rollmatch.errors import ConfigError, ConfigProblem
from rollmatch.models.compat import torchvision_status

Family = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
FAMILIES: tuple[Family, ...] = get_args(Family)


@dataclass(frozen=True)
class TinySize:
    """How big a tiny model is. The defaults build the 865k-parameter model the tests use.

    Text attention heads follow from ``text_hidden / 32`` (head_dim 32, half as many KV heads);
    ``rope_theta`` ``None`` keeps the family's default (1e6 Qwen2/2.5-VL, 5e6 Qwen3-VL). A small theta
    (e.g. 10) lets a tiny Qwen2.5-VL tell image-token positions apart (see docs/models.md).
    """

    text_hidden: int = 128
    text_layers: int = 2
    text_intermediate: int = 256
    vision_hidden: int = 64
    vision_depth: int = 2
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.text_hidden <= 0 or self.text_hidden % (2 * HEAD_DIM):
            problems.append(
                ConfigProblem(
                    "text_hidden", self.text_hidden, f"must be a positive multiple of {2 * HEAD_DIM}"
                )
            )
        if self.vision_hidden <= 0 or self.vision_hidden % HEAD_DIM:
            problems.append(
                ConfigProblem(
                    "vision_hidden", self.vision_hidden, f"must be a positive multiple of {HEAD_DIM}"
                )
            )
        for key in ("text_layers", "text_intermediate", "vision_depth"):
            if getattr(self, key) <= 0:
                problems.append(ConfigProblem(key, getattr(self, key), "must be >= 1"))
        if self.rope_theta is not None and self.rope_theta <= 0:
            problems.append(ConfigProblem("rope_theta", self.rope_theta, "must be > 0 (or unset)"))
        if problems:
            raise ConfigError(problems)

    @property
    def text_heads(self) -> int:
        return self.text_hidden // HEAD_DIM

    @property
    def vision_heads(self) -> int:
        return self.vision_hidden // HEAD_DIM


@dataclass(frozen=True)
class _FamilyClasses:
    """The transformers class names of one family (looked up lazily: importing them is slow)."""

    config: str
    model: str
    processor: str
    video_processor: str
    patch_size: int


_CLASSES: dict[Family, _FamilyClasses] = {
    "qwen2_vl": _FamilyClasses(
        "Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", "Qwen2VLVideoProcessor", 14
    ),
    "qwen2_5_vl": _FamilyClasses(
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLProcessor",
        "Qwen2VLVideoProcessor",
        14,
    ),
    "qwen3_vl": _FamilyClasses(
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", 16
    ),
}

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BPE_VOCAB_SIZE = 1536
# head_dim 32 everywhere: vLLM's CPU attention needs head_dim in {32, 64, 80, ...}.
HEAD_DIM = 32
# Real Qwen checkpoints split head_dim/2 = 64 rotary pairs as [16, 24, 24] (t, h, w); scaled to 16.
MROPE_SECTION = [4, 6, 6]
# Images: a 224x224 image becomes 16x16 patches of 14 px (64 merged tokens); larger images shrink.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224

# The pre-tokenizer split of the real Qwen2 tokenizer: digits are single tokens, words keep a leading space.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The Qwen2-VL chat template (images/videos as vision_start + pad + vision_end).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Label vocabulary of the corpus: shapes/colours (synthetic set), the real datasets, COCO classes.
_LABEL_TEXT = (
    "red green blue yellow orange purple pink brown black white gray grey cyan magenta dark "
    "light square circle triangle rectangle star ellipse hexagon diamond cross ring box shape "
    "object raccoon fish jellyfish penguin puffin shark starfish stingray cat dog bird horse "
    "sheep cow person car bus truck bicycle motorcycle boat airplane train bottle chair table "
    "plant tv fire hydrant stop sign parking meter bench elephant bear zebra giraffe backpack "
    "umbrella handbag tie suitcase frisbee skis snowboard kite baseball bat glove skateboard "
    "surfboard tennis racket wine glass cup fork knife spoon bowl banana apple sandwich broccoli "
    "carrot hot pizza donut cake couch potted bed dining toilet laptop mouse remote keyboard "
    "cell phone microwave oven toaster sink refrigerator clock vase scissors teddy hair drier "
    "toothbrush"
)
_CORPUS_TEXTS = (
    "You are a helpful assistant. Detect every object in the image. Answer with a JSON list of "
    '{"bbox_2d": [x1, y1, x2, y2], "label": "..."}. Locate all objects and output their bounding '
    "box coordinates and labels in JSON format. Find the objects in this picture and describe them. "
    "What is in the image? There is no object here. The image shows several items.",
    "A detection model reads a photograph and writes one line of text: a list of boxes, each with "
    "the top left corner and the bottom right corner in image coordinates, followed by a short "
    "description of the thing inside the box. The boxes are sorted from top to bottom, then from "
    "left to right. When the model misses an object, training adds the missing boxes after its own "
    "answer, so it learns to continue the list instead of starting again.",
    "The quick brown fox jumps over the lazy dog. A small animal climbs a tree near the river while "
    "people walk along the road. Two children play with a ball in the garden behind the house; a "
    "woman reads a book on a bench, and a man rides a bicycle past the shop at the corner of the "
    "street. Under the water, many creatures swim between the rocks: a large shark, a group of "
    "little fish and a bright jellyfish that floats near the surface.",
    "Please look carefully at this image and tell me where each animal, vehicle, person or shape "
    "is located. Count how many there are, give their positions and name their colours. If "
    "nothing can be found, return an empty list. Do not explain your answer; only write the list.",
)


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer for JSON detection output and English prompts.

    Vocab: 256 byte symbols + merges up to ``BPE_VOCAB_SIZE``, then the Qwen special tokens.
    eos = ``<|im_end|>``, pad = ``<|endoftext|>``; the chat template is the Qwen2-VL one.
    ``seed`` draws the corpus' example boxes and its order; the same seed gives the same tokenizer.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(seed), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _training_corpus(seed: int) -> list[str]:
    words = _LABEL_TEXT.split()
    rng = torch.Generator().manual_seed(seed)
    lines = [text for text in _CORPUS_TEXTS for _ in range(8)]
    coords = torch.randint(0, 1001, (400, 4), generator=rng).tolist()
    for i, (x1, y1, x2, y2) in enumerate(coords):
        a, b = words[i % len(words)], words[(i * 7 + 3) % len(words)]
        lines.append(f'[{{"bbox_2d": [{x1}, {y1}, {x2}, {y2}], "label": "{a} {b}"}}, ')
        lines.append(f'{{"bbox_2d": [{x2}, {y2}, {x1}, {y1}], "label": "{b}"}}]')
    lines.extend(" ".join(words[i:] + words[:i]) for i in range(0, len(words), 5))
    lines.append(" ".join(str(n) for n in range(1001)))
    order = torch.randperm(len(lines), generator=rng).tolist()
    return [lines[i] for i in order]


def build_tiny_model(
    family: Family,
    out_dir: str | Path,
    seed: int = 0,
    size: TinySize | None = None,
    *,
    coord_tokens: bool = False,
) -> Path:
    """Write a random-initialised tiny ``family`` checkpoint (float32) with tokenizer and processor.

    ``size`` (default :class:`TinySize`) sets widths, depths and the text rope theta;
    ``coord_tokens`` adds the coordinate tokens as ``rollmatch add-coord-tokens`` does.

    The directory loads with ``AutoModelForImageTextToText.from_pretrained`` and
    ``AutoProcessor.from_pretrained``; returns it.
    """
    if family not in FAMILIES:
        raise ConfigError(
            [
                ConfigProblem(
                    "family", family, f"use one of {', '.join(FAMILIES)} (the supported Qwen-VL families)"
                )
            ]
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    classes = _CLASSES[family]
    size = size or TinySize()
    tokenizer = build_tokenizer(seed)
    config = getattr(transformers, classes.config)(
        text_config=_text_config(family, tokenizer, size),
        vision_config=_vision_config(family, size),
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = getattr(transformers, classes.model)(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    _processor(classes, tokenizer).save_pretrained(out)
    if coord_tokens:
        from rollmatch.models.coord_vocab import add_coord_tokens

        add_coord_tokens(out, out)
    return out


def make_tiny_model_command(args: argparse.Namespace) -> int:
    """``rollmatch make-tiny-model --family F --out DIR --seed S [size flags]``."""
    size = TinySize(
        text_hidden=args.text_hidden,
        text_layers=args.text_layers,
        text_intermediate=args.text_intermediate,
        vision_hidden=args.vision_hidden,
        vision_depth=args.vision_depth,
        rope_theta=args.rope_theta,
    )
    out = build_tiny_model(args.family, args.out, seed=args.seed, size=size, coord_tokens=args.coord_tokens)
    print(
        f"tiny {args.family} model ({size}{', coordinate tokens' if args.coord_tokens else ''}) written to {out}"
    )
    return 0


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def _padded_vocab_size(num_tokens: int) -> int:
    # Like real Qwen checkpoints, the embedding is larger than the tokenizer (rounded up to 64 rows),
    # so code that confuses len(tokenizer) with config.vocab_size fails here too.
    return (num_tokens + 63) // 64 * 64


def _text_config(family: Family, tokenizer: PreTrainedTokenizerFast, size: TinySize) -> dict[str, Any]:
    text: dict[str, Any] = {
        "vocab_size": _padded_vocab_size(len(tokenizer)),
        "hidden_size": size.text_hidden,
        "intermediate_size": size.text_intermediate,
        "num_hidden_layers": size.text_layers,
        "num_attention_heads": size.text_heads,
        "num_key_value_heads": size.text_heads // 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    if family == "qwen3_vl":
        text["head_dim"] = HEAD_DIM
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": size.rope_theta or 5_000_000.0,
            "mrope_section": [6, 5, 5],  # Qwen3-VL's [24, 20, 20], scaled to 16 pairs
            "mrope_interleaved": True,
        }
    else:
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": size.rope_theta or 1_000_000.0,
            "mrope_section": MROPE_SECTION,
        }
    return text


def _vision_config(family: Family, size: TinySize) -> dict[str, Any]:
    depth, width, heads = size.vision_depth, size.vision_hidden, size.vision_heads
    if family == "qwen2_vl":
        return {
            "depth": depth,
            "embed_dim": width,
            "hidden_size": size.text_hidden,
            "num_heads": heads,
            "mlp_ratio": 2,
        }
    if family == "qwen2_5_vl":
        return {
            "depth": depth,
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_heads": heads,
            "out_hidden_size": size.text_hidden,
            "window_size": 112,
            "fullatt_block_indexes": [depth - 1],
        }
    return {
        "depth": depth,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_heads": heads,
        "out_hidden_size": size.text_hidden,
        "patch_size": 16,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }


def _processor(classes: _FamilyClasses, tokenizer: PreTrainedTokenizerFast) -> Any:
    patch = classes.patch_size
    sizes = {
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS * patch * patch // (14 * 14),  # the same patch count for every family
        "patch_size": patch,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }
    # Without torchvision, transformers has only the PIL image backend and no video processor; the
    # compat module then drops the processors' video slot. Classes are looked up by name because
    # touching a torchvision-backed name without torchvision logs a warning.
    has_torchvision = torchvision_status() != "absent"
    image_class = "Qwen2VLImageProcessor" if has_torchvision else "Qwen2VLImageProcessorPil"
    video_processor = getattr(transformers, classes.video_processor)(**sizes) if has_torchvision else None
    return getattr(transformers, classes.processor)(
        image_processor=getattr(transformers, image_class)(**sizes),
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
