"""Command-line flags for the tiny model's size (``--text-layers`` ...), shared by the benches that build one.

One flag per ``TinySize`` field except ``rope_theta`` (the benches keep the model's default there);
``size_from`` turns the parsed flags back into a ``TinySize``.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from rollmatch.models.tiny import TinySize

_FIXED = {"rope_theta"}


def add_size_flags(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """``--<field>`` for each size field; ``defaults`` overrides ``TinySize``'s (by field name)."""
    unknown = set(defaults) - {f.name for f in fields(TinySize)} - _FIXED
    if unknown:
        raise ValueError(f"not TinySize fields: {sorted(unknown)}")
    base = TinySize()
    for size_field in fields(TinySize):
        if size_field.name not in _FIXED:
            flag = "--" + size_field.name.replace("_", "-")
            parser.add_argument(
                flag, type=int, default=defaults.get(size_field.name, getattr(base, size_field.name))
            )


def size_from(args: argparse.Namespace) -> TinySize:
    return TinySize(**{f.name: getattr(args, f.name) for f in fields(TinySize) if f.name not in _FIXED})
