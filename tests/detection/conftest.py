"""Fixtures of the detection tests: real tokenizers built offline, codecs on top of them.

- ``qwen_tokenizer``: the tiny Qwen-style byte-level BPE (``rollmatch.models.tiny.build_tokenizer``);
  its merges fuse ``"},`` and ``"}]`` into single tokens, as the real Qwen tokenizers do.
- ``fused_tokenizer``: a byte-level BPE with *no* pre-tokenizer split, trained on serialized lists,
  so single tokens span element boundaries (e.g. ``"}, {"``): the hardest case for the cut.
- ``codec`` / ``fused_codec``: :class:`QwenJsonCodec` over each, EOS ``<|im_end|>`` (the
  tokenizers' ``eos_token``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rollmatch.detection.codec import QwenJsonCodec
from rollmatch.models.tiny import build_tokenizer

EOS = "<|im_end|>"
LABELS = ["red square", "blue circle", "green triangle", "fish", "raccoon", "star"]


def _random_list_text(rng: random.Random, max_objects: int = 4) -> str:
    objects = []
    for _ in range(rng.randint(1, max_objects)):
        x1, y1 = rng.randint(0, 900), rng.randint(0, 900)
        box = [x1, y1, rng.randint(x1 + 1, 1000), rng.randint(y1 + 1, 1000)]
        objects.append({"bbox_2d": box, "label": rng.choice(LABELS)})
    return json.dumps(objects, ensure_ascii=False)


@pytest.fixture(scope="session")
def random_list_text() -> Callable[[random.Random], str]:
    """``random_list_text(rng)``: a serialized list of 1-4 random valid objects (norm1000 boxes)."""
    return _random_list_text


@pytest.fixture(scope="session")
def qwen_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def fused_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    rng = random.Random(0)
    tokenizer.train_from_iterator([_random_list_text(rng) for _ in range(300)], trainer)
    tokenizer.add_special_tokens(["<|endoftext|>", EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="session")
def codec(qwen_tokenizer: PreTrainedTokenizerFast) -> QwenJsonCodec:
    return QwenJsonCodec(qwen_tokenizer, [qwen_tokenizer.convert_tokens_to_ids(EOS)])


@pytest.fixture(scope="session")
def fused_codec(fused_tokenizer: PreTrainedTokenizerFast) -> QwenJsonCodec:
    return QwenJsonCodec(fused_tokenizer, [fused_tokenizer.convert_tokens_to_ids(EOS)])
