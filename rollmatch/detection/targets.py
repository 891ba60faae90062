"""Teacher-forcing targets and per-token loss weights (pure: token ids in, token ids out).

Owns: :class:`TargetSequence`, :func:`build_rollout_target` (rollout prefix + missed GT + EOS,
the rollout-matching target) and :func:`build_gt_target` (GT serialization + EOS, Channel-A /
``sft``). Leaves out: the prompt (its tokens carry weight 0 and are added by the trainer), loss
reduction (``training.losses``) and packing.

Weights, one per response token (the weight of the loss for predicting that token):

- rollout prefix: 0, except *structure* tokens, which get ``prefix_weight`` (default 0);
- appended tail and the whole GT serialization: 1, except *label* tokens, which get ``desc_weight``;
- EOS: 1.

Tokens are classified through the characters they decode to (``json_scan.char_roles``). A token
is a *label* token if any of its characters lies inside a string value (the label text, not its
quotes), and a *structure* token if all its characters are structure (brackets, separators,
whitespace, keys, quotes). A token fused across a label and structure (e.g. ``."}`` after a
label ending in ``.``) is a label token: a token is predicted as a whole. Tokens that together
decode to one multi-byte character share that character's role.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollmatch.config.schema import LossConfig
from rollmatch.detection.codec import ObjectCodec, ParseResult, Tokenizer, decode_with_offsets
from rollmatch.detection.json_scan import STRUCTURE, TEXT
from rollmatch.detection.objects import DetObject
from rollmatch.errors import DataError

_DEFAULTS = LossConfig()


@dataclass
class TargetSequence:
    """The assistant response to teacher-force, with a loss weight per token."""

    token_ids: list[int]  # prefix ids + tail ids + [eos]
    weights: list[float]  # one per token id: weight of the loss for predicting that token
    num_prefix_tokens: int  # leading tokens copied from the rollout (0 for a GT target)
    text: str  # the decoded response without EOS (for logs and tests)


def build_rollout_target(
    parse: ParseResult,
    fn_objects: Sequence[DetObject],
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    prefix_weight: float = _DEFAULTS.prefix_weight,
    desc_weight: float = _DEFAULTS.desc_weight,
) -> TargetSequence:
    """``Y_train = parse.prefix_token_ids + encode(append_fragment(fn_objects)) + [eos]``.

    The prefix ids are kept exactly as the rollout produced them; only the fragment is encoded.
    """
    fragment = codec.append_fragment(fn_objects, after_element=parse.has_complete_element)
    tail_ids = list(tokenizer.encode(fragment, add_special_tokens=False))
    return _weighted_target(
        prefix_ids=list(parse.prefix_token_ids),
        tail_ids=tail_ids,
        expected_text=parse.prefix_text + fragment,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=prefix_weight,
        desc_weight=desc_weight,
    )


def build_gt_target(
    gt_objects: Sequence[DetObject],
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    desc_weight: float = _DEFAULTS.desc_weight,
) -> TargetSequence:
    """The whole GT serialization (canonical order) + EOS, weighted like an appended tail."""
    text = codec.serialize(gt_objects)
    return _weighted_target(
        prefix_ids=[],
        tail_ids=list(tokenizer.encode(text, add_special_tokens=False)),
        expected_text=text,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=0.0,
        desc_weight=desc_weight,
    )


def _weighted_target(
    *,
    prefix_ids: list[int],
    tail_ids: list[int],
    expected_text: str,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    prefix_weight: float,
    desc_weight: float,
) -> TargetSequence:
    token_ids = prefix_ids + tail_ids
    decoded = decode_with_offsets(tokenizer, token_ids)
    if decoded.text != expected_text:
        # Only a tokenizer that cannot represent some label text (no byte fallback) gets here.
        raise DataError(
            f"the tokenizer does not round-trip the target text: encoded {expected_text!r} but it "
            f"decodes to {decoded.text!r}; use labels the tokenizer can encode (a byte-level BPE "
            "tokenizer, as in every Qwen-VL checkpoint, encodes any text)"
        )
    roles = codec.char_roles(decoded.text)
    weights: list[float] = []
    for index, (start, stop) in enumerate(decoded.token_spans()):
        token_roles = roles[start:stop]
        if index < len(prefix_ids):
            is_structure = stop > start and all(r == STRUCTURE for r in token_roles)
            weights.append(prefix_weight if is_structure else 0.0)
        else:
            weights.append(desc_weight if TEXT in token_roles else 1.0)
    return TargetSequence(
        token_ids=[*token_ids, int(eos_token_id)],
        weights=[*weights, 1.0],
        num_prefix_tokens=len(prefix_ids),
        text=decoded.text,
    )
