"""Teacher-forcing targets and per-token loss weights (pure: token ids in, token ids out).

Owns: :class:`TargetSequence`, :func:`build_matched_target` (the rollout-matching target under
``loss.target``: ``prefix_fn`` keeps part of the rollout (``loss.keep_prefix``, its matched elements
supervised by default, ``loss.matched_prefix``) and appends the GT not in it; ``reordered_gt`` is the
matched GT in the rollout's order then the missed GT), the builders it dispatches to (among them
:func:`build_supervised_context_target`, training after the model's own mistakes),
:func:`build_gt_target` (GT serialization + EOS, Channel-A / ``sft``) and
:func:`target_differs_from_sft`. Leaves out: the prompt (its tokens carry weight 0 and are added by
the trainer), where a kept mistake first goes wrong (``detection.mistakes``), loss reduction
(``training.losses``) and packing. Why ``prefix_fn`` keeps the rollout only up to its first unmatched
element by default: docs/detection.md, "the truncation ratchet".

Weights, one per response token (the weight of the loss for predicting that token):

- rollout prefix: 0, except *structure* tokens, which get ``prefix_weight`` (default 0);
- a supervised (rewritten) matched prefix: coordinates 1, labels ``desc_weight``, structure
  ``prefix_weight``;
- appended tail, the whole GT serialization and a reordered-GT target: 1, except *label* tokens,
  which get ``desc_weight``; in a rollout target the appended missed objects are multiplied by
  ``missed_weight`` (the closing ``]`` is not);
- a kept false positive, duplicate or invalid element under ``keep_prefix: all`` + ``supervise``: 0;
- noise objects after the real ones in a GT target (``loss.noise_objects``): any token touching their
  coordinates 0, their label tokens ``noise_objects.label_weight``, their structure 1;
- EOS: 1.

``unlikelihood_weights`` (``loss.fp_unlikelihood_weight``): one token per kept false positive or
duplicate, the weight of ``-log(1 - p(token))`` there (``detection.mistakes``). A prediction on an
ignore (crowd) region (``MatchResult.ignored``) is no false positive: it is kept or cut like one, at
weight 0, but never flagged.

Tokens are classified through the characters they decode to (``json_scan.char_roles``). A token
is a *label* token if any of its characters lies inside a string value (the label text, not its
quotes), and a *structure* token if all its characters are structure (brackets, separators,
whitespace, keys, quotes). A token fused across a label and structure (e.g. ``."}`` after a
label ending in ``.``) is a label token: a token is predicted as a whole. Tokens that together
decode to one multi-byte character share that character's role.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollmatch.config.schema import LossConfig
from rollmatch.detection.codec import DecodedTokens, ObjectCodec, ParseResult, Tokenizer, decode_with_offsets
from rollmatch.detection.json_scan import STRUCTURE, TEXT, VALUE
from rollmatch.detection.matching import MatchResult
from rollmatch.detection.mistakes import divergence, fp_divergences, unlikelihood_flags, walk_elements
from rollmatch.detection.objects import DetObject, canonical_order
from rollmatch.errors import DataError

_DEFAULTS = LossConfig()


@dataclass
class TargetSequence:
    """The assistant response to teacher-force, with a loss weight per token."""

    token_ids: list[int]  # prefix ids + tail ids + [eos]
    weights: list[float]  # one per token id: weight of the loss for predicting that token
    num_prefix_tokens: int  # leading tokens copied from the rollout (0 for a GT target)
    text: str  # the decoded response without EOS (for logs and tests)
    dropped_elements: int = 0  # complete rollout elements left out of the target
    # one per token id, or empty (no unlikelihood term): weight of -log(1 - p(token)) for predicting it
    unlikelihood_weights: list[float] = field(default_factory=list)

    @property
    def supervised_tokens(self) -> int:
        """Tokens with a non-zero loss weight (metric ``target/supervised_tokens``)."""
        return sum(1 for w in self.weights if w > 0)


def build_matched_target(
    parse: ParseResult,
    gts: Sequence[DetObject],
    match: MatchResult,
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    loss: LossConfig = _DEFAULTS,
) -> TargetSequence:
    """The rollout-matching target of one rollout under ``loss.target`` (the trainer's entry).

    ``reordered_gt``: :func:`build_reordered_gt_target`. ``prefix_fn``: the kept prefix
    (``loss.keep_prefix``) then the GT objects not matched inside it. ``keep_prefix: all`` keeps the
    whole parsed prefix; ``matched`` keeps it up to the first element that is not a matched
    prediction (a false positive, a duplicate or an invalid element). With ``loss.matched_prefix:
    supervise`` the kept elements are rewritten to their matched GT (:func:`build_supervised_prefix_target`).
    Either way the list closes with a supervised ``]`` and EOS.
    """
    if loss.target == "reordered_gt":
        return build_reordered_gt_target(
            parse, gts, match, codec=codec, tokenizer=tokenizer, eos_token_id=eos_token_id, loss=loss
        )
    if loss.keep_prefix == "all" and loss.matched_prefix == "supervise":
        return build_supervised_context_target(
            parse, gts, match, codec=codec, tokenizer=tokenizer, eos_token_id=eos_token_id, loss=loss
        )
    keep = parse.num_complete if loss.keep_prefix == "all" else leading_matched_elements(parse, match)
    kept_objects = _objects_in(parse, keep)
    matched_gt = {g for p, g, _ in match.pairs if p < kept_objects}
    missed = [gt for g, gt in enumerate(gts) if g not in matched_gt]
    if loss.matched_prefix == "supervise":
        gt_of = {p: g for p, g, _ in match.pairs}
        target = build_supervised_prefix_target(
            [gts[gt_of[p]] for p in range(kept_objects)],
            missed,
            codec=codec,
            tokenizer=tokenizer,
            eos_token_id=eos_token_id,
            loss=loss,
        )
    else:
        target = build_rollout_target(
            parse,
            missed,
            codec=codec,
            tokenizer=tokenizer,
            eos_token_id=eos_token_id,
            prefix_weight=loss.prefix_weight,
            desc_weight=loss.desc_weight,
            keep_elements=keep,
            missed_weight=loss.missed_weight,
        )
        if loss.fp_unlikelihood_weight > 0:
            divergences = fp_divergences(parse, gts, match, codec, keep)
            _flag_unlikelihood(target, divergences, tokenizer, loss.fp_unlikelihood_weight)
    target.dropped_elements = parse.num_complete - keep
    return target


def build_supervised_context_target(
    parse: ParseResult,
    gts: Sequence[DetObject],
    match: MatchResult,
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    loss: LossConfig = _DEFAULTS,
) -> TargetSequence:
    """``prefix_fn`` + ``keep_prefix: all`` + ``matched_prefix: supervise``: training after own mistakes.

    Every complete element of the rollout stays in the context, in the rollout's order: a matched
    element is rewritten to its GT (coordinates 1, labels ``desc_weight``, structure ``prefix_weight``),
    also after a false positive; a false positive, a duplicate or an invalid element keeps the
    rollout's own text at weight 0 (any token touching it weighs 0). Then the missed GT (canonical
    order, ``missed_weight``), ``]`` and EOS (1). The text is encoded whole, as in
    :func:`build_supervised_prefix_target`. With ``loss.fp_unlikelihood_weight > 0`` the first token
    of each false positive or duplicate that no correct continuation shares is flagged for the
    unlikelihood term (:func:`fp_divergences`).
    """
    gt_of = {p: g for p, g, _ in match.pairs}
    text = "["
    context_spans: list[tuple[int, int]] = []
    divergences: list[int] = []
    for element in walk_elements(parse, gt_of, len(gts), frozenset(match.ignored)):
        after = element.index > 0
        if element.gt is not None:
            text += codec.append_fragment([gts[element.gt]], after_element=after)[:-1]
            continue
        raw = parse.prefix_text[element.start : element.end]
        if element.valid and not element.ignored and loss.fp_unlikelihood_weight > 0:
            first = divergence(raw, [gts[g] for g in element.remaining], codec, after_element=after)
            if first is not None:
                divergences.append(len(text) + first)
        context_spans.append((len(text), len(text) + len(raw)))
        text += raw
    rewritten = len(text)
    missed = [gts[g] for g in match.fn]
    text += codec.append_fragment(missed, after_element=parse.num_complete > 0)
    target = _text_target(
        text,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=loss.prefix_weight,
        desc_weight=loss.desc_weight,
        rewritten_chars=rewritten,
        context_spans=context_spans,
        missed_weight=loss.missed_weight,
        missed_start=rewritten,
    )
    _flag_unlikelihood(target, divergences, tokenizer, loss.fp_unlikelihood_weight)
    return target


def _flag_unlikelihood(
    target: TargetSequence, divergences: Sequence[int], tokenizer: Tokenizer, weight: float
) -> None:
    """Set ``target.unlikelihood_weights`` from the divergence characters (none when ``weight`` is 0)."""
    if weight > 0:
        target.unlikelihood_weights = unlikelihood_flags(
            target.token_ids, target.weights, divergences, tokenizer, weight
        )


def build_reordered_gt_target(
    parse: ParseResult,
    gts: Sequence[DetObject],
    match: MatchResult,
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    loss: LossConfig = _DEFAULTS,
) -> TargetSequence:
    """The GT objects the rollout matched, in the rollout's order, then the missed GT (canonical
    order), + EOS; every token supervised (label tokens at ``desc_weight``).

    False positives, duplicates (a second prediction of one GT object is unmatched) and invalid
    elements are left out, and counted in ``dropped_elements``. No rollout token is copied: the
    rollout contributes only the order in which it found the objects.
    """
    found = [gts[g] for _, g, _ in sorted(match.pairs)]
    missed = [gts[g] for g in match.fn]
    text = codec.serialize_in_order([*found, *canonical_order(missed)])
    target = _text_target(
        text,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=0.0,
        desc_weight=loss.desc_weight,
        missed_weight=loss.missed_weight,
        missed_start=len(codec.serialize_in_order(found)) - 1,
    )
    target.dropped_elements = parse.num_complete - len(match.pairs)
    return target


def build_supervised_prefix_target(
    prefix_gts: Sequence[DetObject],
    missed: Sequence[DetObject],
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    loss: LossConfig = _DEFAULTS,
) -> TargetSequence:
    """``prefix_fn`` with the matched prefix supervised: the kept elements rewritten to their matched
    GT (``prefix_gts``, in the rollout's order), then ``missed`` (canonical order) and EOS.

    In the rewritten prefix, coordinate tokens weigh 1, label tokens ``desc_weight`` and structure
    tokens ``prefix_weight``; the tail is weighted as in every target. Every kept element is
    rewritten, never patched token by token: with digit coordinates a prediction and its GT differ in
    token count whenever their digit counts differ (``99`` vs ``100``), so a per-token substitution
    would supervise some elements in place and rewrite others. For the model's own canonical output
    the rewrite equals the substitution wherever the lengths agree.
    """
    text = codec.serialize_in_order([*prefix_gts, *canonical_order(missed)])
    prefix_text = codec.serialize_in_order(prefix_gts)
    # just after the last prefix element's "}" (0 with no prefix: the whole target is a tail)
    boundary = len(prefix_text) - 1 if prefix_gts else 0
    if not text.startswith(prefix_text[:boundary]):
        raise DataError(
            f"codec {codec.name!r}: the serialization of the prefix objects is not a prefix of the whole "
            "list's; a codec must serialize a list as the concatenation of its elements"
        )
    return _text_target(
        text,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=loss.prefix_weight,
        desc_weight=loss.desc_weight,
        rewritten_chars=boundary,
        missed_weight=loss.missed_weight,
        missed_start=len(prefix_text) - 1,
    )


def target_differs_from_sft(
    target: TargetSequence, gts: Sequence[DetObject], codec: ObjectCodec, tokenizer: Tokenizer
) -> bool:
    """Does ``target`` hold another token-id sequence than the SFT target of ``gts`` (EOS aside)?

    Token ids, never weights: a target equal to SFT's in ids trains on SFT's own states, whatever it
    weighs.
    """
    return target.token_ids[:-1] != list(tokenizer.encode(codec.serialize(gts), add_special_tokens=False))


def leading_matched_elements(parse: ParseResult, match: MatchResult) -> int:
    """How many leading complete elements of the prefix are valid, matched predictions."""
    matched = {p for p, _, _ in match.pairs}
    count = obj = 0
    for valid in parse.element_valid:
        if not valid or obj not in matched:
            break
        count, obj = count + 1, obj + 1
    return count


def build_rollout_target(
    parse: ParseResult,
    fn_objects: Sequence[DetObject],
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    prefix_weight: float = _DEFAULTS.prefix_weight,
    desc_weight: float = _DEFAULTS.desc_weight,
    keep_elements: int | None = None,
    missed_weight: float = _DEFAULTS.missed_weight,
) -> TargetSequence:
    """``Y_train = rollout prefix + encode(append_fragment(fn_objects)) + [eos]``.

    The prefix is the rollout's first ``keep_elements`` complete elements (default: all of
    ``parse.num_complete``), its token ids copied as the rollout produced them, except the token
    group that closes the last kept element (``"}`` or the bare ``[``): that one is encoded
    together with the fragment, so the target holds the token the model really chooses at that
    point at inference (``"}]`` to stop, ``"},`` to go on), with weight 1, instead of a ``"}``
    followed by ``]`` that free decoding never produces. When that token group also holds label
    text (a tokenizer fusing ``e"}``), it stays in the prefix and the fragment follows it.
    """
    keep = parse.num_complete if keep_elements is None else keep_elements
    if len(parse.element_ends) != parse.num_complete:
        raise DataError(
            f"ParseResult has num_complete = {parse.num_complete} but {len(parse.element_ends)} element_ends; "
            "build it with codec.parse, which records where each complete element ends"
        )
    if not 0 <= keep <= parse.num_complete:
        raise DataError(f"keep_elements = {keep}: use 0..{parse.num_complete} (the complete elements)")
    prefix_ids, prefix_text, carried = _kept_prefix(parse, keep, codec, tokenizer)
    fragment = codec.append_fragment(fn_objects, after_element=keep > 0)
    tail_ids = list(tokenizer.encode(carried + fragment, add_special_tokens=False))
    target = _weighted_target(
        prefix_ids=prefix_ids,
        tail_ids=tail_ids,
        expected_text=prefix_text + carried + fragment,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=prefix_weight,
        desc_weight=desc_weight,
        missed_weight=missed_weight,
        missed_start=len(prefix_text) + len(carried),
    )
    target.dropped_elements = parse.num_complete - keep
    return target


def _objects_in(parse: ParseResult, elements: int) -> int:
    """How many of ``parse.objects`` lie in the first ``elements`` complete elements."""
    return sum(parse.element_valid[:elements])


def _kept_prefix(
    parse: ParseResult, keep: int, codec: ObjectCodec, tokenizer: Tokenizer
) -> tuple[list[int], str, str]:
    """``(prefix ids, their text, carried text)``: the rollout through its ``keep``-th element.

    The carried text is the closing token group's text, handed to the tail encoding; it is empty
    when that group holds a non-structure character.
    """
    ids = list(parse.prefix_token_ids)
    decoded = decode_with_offsets(tokenizer, ids)
    cut = parse.element_ends[keep - 1] if keep else 1  # just after the element's "}" / the "["
    first, end, start, stop = next(g for g in decoded.groups if g[2] < cut <= g[3])
    closing = decoded.text[start:cut]
    if all(role == STRUCTURE for role in codec.char_roles(decoded.text[:cut])[start:cut]):
        return ids[:first], decoded.text[:start], closing
    # Label text shares the closing token group: it stays in the prefix (re-encoded up to the cut
    # when the cut falls inside it, as the parser does) and the fragment follows it.
    kept = (
        ids[:end] if stop == cut else ids[:first] + list(tokenizer.encode(closing, add_special_tokens=False))
    )
    return kept, decoded.text[:cut], ""


def build_gt_target(
    gt_objects: Sequence[DetObject],
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    desc_weight: float = _DEFAULTS.desc_weight,
    noise: Sequence[DetObject] = (),
    noise_label_weight: float = _DEFAULTS.noise_objects.label_weight,
) -> TargetSequence:
    """The whole GT serialization (canonical order) + EOS, weighted like an appended tail.

    ``noise`` (``loss.noise_objects``, ``detection.noise_objects``) follows the real objects in the
    list, in the order given: any token touching a noise object's coordinate characters weighs 0, its
    label tokens ``noise_label_weight``, its structure (separators, braces, keys) 1 like the list's.
    """
    real = canonical_order(gt_objects)
    text = codec.serialize_in_order([*real, *noise])
    return _text_target(
        text,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=0.0,
        desc_weight=desc_weight,
        # where the real list would close: the noise objects' separator (or first "{") starts there
        noise_start=len(codec.serialize_in_order(real)) - 1 if noise else None,
        noise_label_weight=noise_label_weight,
    )


def _text_target(
    text: str,
    *,
    codec: ObjectCodec,
    tokenizer: Tokenizer,
    eos_token_id: int,
    prefix_weight: float,
    desc_weight: float,
    rewritten_chars: int = 0,
    context_spans: Sequence[tuple[int, int]] = (),
    missed_weight: float = 1.0,
    missed_start: int | None = None,
    noise_start: int | None = None,
    noise_label_weight: float = 1.0,
) -> TargetSequence:
    """A target that is ``text`` encoded whole (no rollout tokens copied), weighted by the rules."""
    return _weighted_target(
        prefix_ids=[],
        tail_ids=list(tokenizer.encode(text, add_special_tokens=False)),
        expected_text=text,
        codec=codec,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        prefix_weight=prefix_weight,
        desc_weight=desc_weight,
        rewritten_chars=rewritten_chars,
        context_spans=context_spans,
        missed_weight=missed_weight,
        missed_start=missed_start,
        noise_start=noise_start,
        noise_label_weight=noise_label_weight,
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
    rewritten_chars: int = 0,
    context_spans: Sequence[tuple[int, int]] = (),
    missed_weight: float = 1.0,
    missed_start: int | None = None,
    noise_start: int | None = None,
    noise_label_weight: float = 1.0,
) -> TargetSequence:
    """Weights of ``prefix_ids`` (copied from the rollout) + ``tail_ids`` (encoded) by the module's
    rules; the first ``rewritten_chars`` characters of the tail are a rewritten matched prefix.

    A token touching a ``context_spans`` range (a kept false positive, duplicate or invalid element)
    weighs 0. A token touching the appended missed GT (from ``missed_start`` to the closing ``]``) is
    multiplied by ``missed_weight``, unless it holds that ``]`` (the decision to stop weighs 1). From
    ``noise_start`` to the closing ``]`` the list holds noise objects: a token touching one of their
    coordinate characters weighs 0, a token touching their label ``noise_label_weight``.
    """
    token_ids = prefix_ids + tail_ids
    decoded = _checked_decode(tokenizer, token_ids, expected_text)
    roles = codec.char_roles(decoded.text)
    close = len(decoded.text) - 1  # the list's closing "]"
    missed_from = close if missed_start is None else missed_start
    weights: list[float] = []
    for index, (start, stop) in enumerate(decoded.token_spans()):
        token_roles = roles[start:stop]
        is_structure = stop > start and all(r == STRUCTURE for r in token_roles)
        if index < len(prefix_ids):
            weights.append(prefix_weight if is_structure else 0.0)
            continue
        if any(start < b and a < stop for a, b in context_spans):
            weights.append(0.0)
            continue
        if noise_start is not None and stop > noise_start and start < close:
            noise_roles = roles[max(start, noise_start) : min(stop, close)]
            if VALUE in noise_roles:
                weights.append(0.0)  # a noise object's coordinates are not supervised
                continue
            if TEXT in noise_roles:
                weights.append(noise_label_weight)
                continue
        scale = missed_weight if start < close and stop > missed_from and stop <= close else 1.0
        if TEXT in token_roles:
            weights.append(desc_weight * scale)
        elif is_structure and stop <= rewritten_chars:
            weights.append(prefix_weight)
        else:
            weights.append(scale)
    return TargetSequence(
        token_ids=[*token_ids, int(eos_token_id)],
        weights=[*weights, 1.0],
        num_prefix_tokens=len(prefix_ids),
        text=decoded.text,
    )


def _checked_decode(tokenizer: Tokenizer, token_ids: list[int], expected_text: str) -> DecodedTokens:
    decoded = decode_with_offsets(tokenizer, token_ids)
    if decoded.text != expected_text:
        # Only a tokenizer that cannot represent some label text (no byte fallback) gets here.
        raise DataError(
            f"the tokenizer does not round-trip the target text: encoded {expected_text!r} but it "
            f"decodes to {decoded.text!r}; use labels the tokenizer can encode (a byte-level BPE "
            "tokenizer, as in every Qwen-VL checkpoint, encodes any text)"
        )
    return decoded
