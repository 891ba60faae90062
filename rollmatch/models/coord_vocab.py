"""Add the coordinate tokens of ``custom.object_format: coord_tokens`` to a checkpoint.

Owns: :func:`add_coord_tokens` (a model directory in, a directory with the tokens out) and the
``rollmatch add-coord-tokens`` command. Leaves out: the format and its parser
(``detection.coord_tokens``) and the losses on coordinate positions (``training.losses``).

What it does: ``<|coord_0|>`` ... ``<|coord_999|>`` are added to the tokenizer as special tokens
(never split, kept when a rollout is decoded with special tokens), the input embeddings and the LM
head grow to hold them (a checkpoint whose padded vocabulary already has room keeps its size), and
each new row starts as the **mean of the rows of the digit tokens of the value it stands for**:
``<|coord_512|>`` starts as the tokens of ``"513"`` (its ``norm1000`` value) average. A pretrained
model thus starts with coordinate tokens it already reads as numbers of the right size, neighbouring
bins start close together, and the first steps do not have to move rows from noise. Saved with
the processor, so HF, vLLM and the rollout server all load the directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoModelForImageTextToText, AutoProcessor

from rollmatch.detection.coord_tokens import NUM_BINS, coord_token_ids, coord_tokens, from_bin
from rollmatch.errors import ConfigError, ConfigProblem


def add_coord_tokens(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``model_dir`` with the 1,000 coordinate tokens into ``out_dir`` (may be the same)."""
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    vocab = tokenizer.get_vocab()
    present = [t for t in coord_tokens() if t in vocab]
    if present and len(present) != NUM_BINS:
        raise ConfigError(
            [
                ConfigProblem(
                    "model",
                    str(model_dir),
                    f"the tokenizer holds {len(present)} of the 1,000 coordinate tokens; start from a "
                    "checkpoint with none or all of them",
                )
            ]
        )
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    if not present:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in coord_tokens()])
        ids = coord_token_ids(tokenizer)
        rows = model.get_input_embeddings().weight.shape[0]
        if max(ids) >= rows:
            model.resize_token_embeddings(max(rows, len(tokenizer)), mean_resizing=False)
        _initialise_rows(model, tokenizer, ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@torch.no_grad()
def _initialise_rows(model: torch.nn.Module, tokenizer, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Row of ``<|coord_k|>`` = mean of the rows of the digit tokens of ``from_bin(k)``."""
    tables = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() != tables[0].data_ptr():
        tables.append(head.weight)
    for k, token_id in enumerate(ids):
        digits = tokenizer.encode(str(from_bin(k)), add_special_tokens=False)
        for table in tables:
            table[token_id] = table[digits].mean(dim=0)


def add_coord_tokens_command(args: argparse.Namespace) -> int:
    out = add_coord_tokens(args.model, args.out)
    print(
        f"{out}: <|coord_0|>..<|coord_999|> added; set custom.object_format: coord_tokens and model.path: {out}"
    )
    return 0
