"""What the model decodes while it trains: a few of the rollouts an optimizer step trains on, logged.

Owns :class:`RolloutLog` (``training.log_rollouts_every``, ``training.log_rollouts_count``; rank 0 only).
Two calls feed it:

- :meth:`RolloutLog.rolled_out` — from ``training.segment_producers`` after every rollout call, in whichever thread
  rolls out (the learner, the step-mode pipeline, the async actor): it remembers, per segment, the record
  and the raw rollout behind it. Nothing is scored or drawn here; an entry lives as long as its segment
  (a weak reference), so segments dropped from a queue or buffer take their entry with them.
- :meth:`RolloutLog.trained` — from the learner with the segments an optimizer step trains (the step
  planner; step mode as its rollouts arrive): at a logged step it scores the first
  ``log_rollouts_count`` of them again (strict parse + Hungarian match with ``matching.*``, as training
  did), draws each with :func:`rollmatch.viz.draw_detections` (the pictures of ``rollmatch viz``) and
  writes them: ``<output_dir>/rollouts/step-N.jsonl`` (one line per rollout), ``step-N/<i>-<id>.png``,
  TensorBoard images ``rollouts/<i>`` and a text ``rollouts/text`` at step N (HF's own writer, so they
  land in the run's event file), and W&B images when ``wandb`` is in ``training.report_to``.

Steps are numbered as HF logs them: step N is the N-th optimizer step (``global_step + 1`` while it is
planned). Logged steps: the first step that trains rollouts, then the first such step at or after each
multiple of ``log_rollouts_every``. Leaves out: the drawing (``viz``) and the scoring (``detection.scoring``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.prompts import EncodedPrompt, PromptEncoder
from rollmatch.data.records import Record, RecordObject, load_image
from rollmatch.detection.codec import ObjectCodec
from rollmatch.detection.objects import DetObject, from_frame
from rollmatch.detection.scoring import ScoredResponse, score_response
from rollmatch.packing.segment import Segment
from rollmatch.rollout.types import Rollout
from rollmatch.viz import Picture, draw_detections, file_stem, parse_note

log = logging.getLogger(__name__)
ROLLOUTS_DIR = "rollouts"


@dataclass(frozen=True)
class _Source:
    """What made one segment: the record, which of its K rollouts, and the frame the rollout answered in."""

    record: Record
    sample: int
    rollout: Rollout
    gt_frame: tuple[DetObject, ...]  # the record's GT in the frame, canonical order (what matching saw)
    frame_size: tuple[int, int]
    extent: tuple[int, int]
    prompt_length: int


@dataclass(frozen=True)
class _Logged:
    """One logged rollout: its index in the step, picture, JSONL line and the picture's PNG bytes."""

    index: int
    picture: Picture
    line: dict[str, Any]
    png: bytes


class RolloutLog:
    """Remembers the rollout behind each segment; logs a few of those a logged step trains (module docstring)."""

    def __init__(
        self,
        cfg: RollmatchConfig,
        encoder: PromptEncoder,
        codec: ObjectCodec,
        *,
        writers: Callable[[], Sequence[Any]] = tuple,
    ):
        t = cfg.training
        if t.log_rollouts_every <= 0:
            raise ValueError("RolloutLog needs training.log_rollouts_every > 0 (0 turns it off: build none)")
        self.every = t.log_rollouts_every
        self.count = t.log_rollouts_count
        self.out_dir = os.path.join(t.output_dir, ROLLOUTS_DIR)
        self.report_to = list(t.report_to)
        self.matching = cfg.matching
        self.encoder = encoder
        self.codec = codec
        self.writers = writers  # HF's callbacks once the trainer exists (TensorBoard's holds the writer)
        self._lock = threading.RLock()  # rolled_out runs in rollout threads; weakref callbacks anywhere
        self._sources: dict[int, tuple[weakref.ref[Segment], _Source]] = {}
        self._next_due = 1
        self._open_step: int | None = None  # the logged step still taking rollouts, and how many it has
        self._logged: list[str] = []  # "<record id>#<sample>" of the open step

    # ------------------------------------------------------------------------------- producers
    def rolled_out(
        self,
        records: Sequence[Record],
        encoded: Sequence[EncodedPrompt],
        rollouts: Sequence[Rollout],
        segments: Sequence[Segment],
    ) -> None:
        """One rollout call: record ``i``'s sample ``k`` is ``rollouts[i * K + k]`` and made ``segments[i * K + k]``."""
        per_record = len(rollouts) // max(len(records), 1)
        gts = [tuple(self.encoder.gt_objects(r, e)) for r, e in zip(records, encoded, strict=True)]
        with self._lock:
            for index, (rollout, segment) in enumerate(zip(rollouts, segments, strict=True)):
                record, enc = records[index // per_record], encoded[index // per_record]
                source = _Source(
                    record=record,
                    sample=index % per_record,
                    rollout=rollout,
                    gt_frame=gts[index // per_record],
                    frame_size=enc.frame_sizes[0],
                    extent=self.encoder.frame_extent(enc),
                    prompt_length=len(enc.input_ids),
                )
                key = id(segment)
                self._sources[key] = (weakref.ref(segment, partial(self._forget, key)), source)

    def trained(self, global_step: int, segments: Sequence[Segment]) -> None:
        """The learner trains ``segments`` in optimizer step ``global_step + 1``: log some if it is due."""
        step = global_step + 1
        if step != self._open_step:
            if step < self._next_due:
                return
            self._open_step, self._logged = step, []
        room = self.count - len(self._logged)
        if room <= 0:
            return
        chosen = self._choose(segments, room)
        if not chosen:
            return
        start = time.perf_counter()
        self._write(step, chosen, first_index=len(self._logged))
        self._logged.extend(_key(source) for _, source in chosen)
        self._next_due = (step // self.every + 1) * self.every
        elapsed = time.perf_counter() - start
        log.info(
            "logged %d rollouts of step %d to %s (%.2fs)",
            len(chosen),
            step,
            os.path.join(self.out_dir, f"step-{step}.jsonl"),
            elapsed,
        )

    @property
    def remembered(self) -> int:
        """Segments whose rollout is remembered now (bounded by the segments alive)."""
        with self._lock:
            return len(self._sources)

    # ------------------------------------------------------------------------------- internals
    def _forget(self, key: int, ref: weakref.ref[Segment]) -> None:
        with self._lock:
            entry = self._sources.get(key)
            if entry is not None and entry[0] is ref:
                del self._sources[key]

    def _choose(self, segments: Sequence[Segment], room: int) -> list[tuple[Segment, _Source]]:
        """Up to ``room`` not yet logged this step, records not logged yet first (K samples of one record
        show less than K records)."""
        known: list[tuple[Segment, _Source]] = []
        with self._lock:
            for segment in segments:
                entry = self._sources.get(id(segment))
                if entry is not None and entry[0]() is segment and _key(entry[1]) not in self._logged:
                    known.append((segment, entry[1]))
        seen = {key.rsplit("#", 1)[0] for key in self._logged}
        fresh, again = [], []
        for item in known:
            record_id = item[1].record.id
            (again if record_id in seen else fresh).append(item)
            seen.add(record_id)
        return (fresh + again)[:room]

    def _write(self, step: int, chosen: Sequence[tuple[Segment, _Source]], *, first_index: int) -> None:
        folder = os.path.join(self.out_dir, f"step-{step}")
        os.makedirs(folder, exist_ok=True)
        lines, pictures = [], []
        for offset, (segment, source) in enumerate(chosen):
            index = first_index + offset
            line, picture = self._describe(step, segment, source)
            png = _png(picture)
            with open(os.path.join(folder, f"{index:02d}-{file_stem(source.record.id)}.png"), "wb") as fh:
                fh.write(png)
            lines.append(line)
            pictures.append(_Logged(index, picture, line, png))
        # A step's first lines start its file (a resumed run that trains the step again rewrites it).
        with open(os.path.join(self.out_dir, f"step-{step}.jsonl"), "w" if first_index == 0 else "a") as fh:
            fh.writelines(json.dumps(line) + "\n" for line in lines)
        self._to_trackers(step, pictures)

    def _describe(self, step: int, segment: Segment, source: _Source) -> tuple[dict[str, Any], Picture]:
        """The JSONL line and the picture of one rollout."""
        rollout, record = source.rollout, source.record
        scored = score_response(
            self.codec,
            rollout.response_token_ids,
            source.gt_frame,
            extent=source.extent,
            hit_max_tokens=rollout.hit_max_tokens,
            matching=self.matching,
        )
        parse = scored.parse
        failure = parse_note(parse.invalid, parse.truncated)
        predictions = self._pixels(parse.objects, source)
        gt = self._pixels(source.gt_frame, source)
        target = segment.input_ids[source.prompt_length :].tolist()
        weights = segment.weights[source.prompt_length :]
        line: dict[str, Any] = {
            "step": step,
            "id": record.id,
            "image": record.images[0],
            "sample": source.sample,
            "weight_version": rollout.weight_version,
            "finish_reason": rollout.finish_reason,
            "text": rollout.text,
            "response_token_ids": list(rollout.response_token_ids),
            "objects": [_box(o) for o in predictions],  # as `rollmatch eval` writes: `rollmatch viz` reads it
            "truncated": parse.truncated,
            "invalid": dict(parse.invalid),
            "parse_failure": failure,
            "gt": [_box(o) for o in gt],
            **_match_summary(scored),
            "target": {
                "tokens": len(target),
                "supervised_tokens": int((weights > 0).sum()),
                "loss_weight": round(float(weights.sum()), 4),
                "text": self.encoder.tokenizer.decode(target, skip_special_tokens=False),
            },
        }
        if segment.advantages is not None:  # loss.objective: grpo
            line["target"]["advantage"] = round(float(segment.advantages[source.prompt_length :].mean()), 4)
        counts = line["counts"]
        note = [
            f"step {step}  {record.id}  sample {source.sample}  v{rollout.weight_version}",
            f"TP {counts['tp']}  FP {counts['fp']}  FN {counts['fn']}  {len(rollout.response_token_ids)} tokens "
            f"({rollout.finish_reason})",
        ]
        if failure is not None:
            note.append(f"parse: {failure}")
        picture = draw_detections(
            load_image(record.images[0]),
            record.objects,
            predictions,
            record_id=record.id,
            matching=self.matching,
            note=note,
        )
        return line, picture

    def _pixels(self, objects: Sequence[DetObject], source: _Source) -> list[RecordObject]:
        """Frame boxes back in pixels of the original image (as ``rollmatch eval``'s predictions)."""
        frame, size = self.encoder.coord_frame, source.record.image_size
        return [
            RecordObject(o.label, from_frame(o.bbox, size, frame, source.frame_size))  # type: ignore[arg-type]
            for o in objects
        ]

    def _to_trackers(self, step: int, pictures: Sequence[_Logged]) -> None:
        if "tensorboard" in self.report_to:
            writer = next((w for w in (getattr(c, "tb_writer", None) for c in self.writers()) if w), None)
            if writer is None:
                raise RuntimeError(
                    "training.report_to has tensorboard but the trainer has no TensorBoard writer open; "
                    "RolloutLog.trained must run inside Trainer.train (after on_train_begin)"
                )
            from tensorboard.compat.proto.summary_pb2 import Summary

            # The PNG already written, as the image summary (writer.add_image would encode it again, at
            # zlib's default level: most of the cost of a logged step on noisy images).
            values = [
                Summary.Value(
                    tag=f"rollouts/{item.index}",
                    image=Summary.Image(
                        height=item.picture.image.height,
                        width=item.picture.image.width,
                        colorspace=3,
                        encoded_image_string=item.png,
                    ),
                )
                for item in pictures
            ]
            # torch's and tensorboardX's SummaryWriter both take raw summaries through their file writer
            writer._get_file_writer().add_summary(Summary(value=values), step)
            writer.add_text("rollouts/text", _markdown(pictures), step)  # flushed with HF's next log line
        if "wandb" in self.report_to:
            import wandb

            images = {
                f"rollouts/{item.index}": wandb.Image(item.picture.image, caption=item.picture.caption)
                for item in pictures
            }
            wandb.log({**images, "train/global_step": step})


def _match_summary(scored: ScoredResponse) -> dict[str, Any]:
    match = scored.match
    return {
        "matched": [{"prediction": p, "gt": g, "iou": round(iou, 4)} for p, g, iou in match.pairs],
        "false_positives": list(match.fp),
        "missed": list(match.fn),
        "counts": {"tp": len(match.pairs), "fp": len(match.fp), "fn": len(match.fn)},
    }


def _box(obj: RecordObject) -> dict[str, Any]:
    return {"label": obj.label, "bbox": [round(v, 2) for v in obj.bbox]}


def _png(picture: Picture) -> bytes:
    """The picture as PNG at zlib level 1: several times faster than the default on noisy photos."""
    buffer = io.BytesIO()
    picture.image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _markdown(pictures: Sequence[_Logged]) -> str:
    """One block per rollout: record, counts, parse failure, the raw text (TensorBoard renders markdown)."""
    blocks = []
    for item in pictures:
        failure = f", parse: {item.line['parse_failure']}" if item.line["parse_failure"] else ""
        blocks.append(f"**{item.index}** {item.picture.caption}{failure}\n\n    {item.line['text']}")
    return "\n\n".join(blocks)


def _key(source: _Source) -> str:
    return f"{source.record.id}#{source.sample}"
