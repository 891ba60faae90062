"""The base of every wire model: unknown fields and non-finite numbers are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Base of every wire model: unknown fields are errors (a typo never passes silently), and
    NaN / Infinity are refused wherever a number is expected."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
