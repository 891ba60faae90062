"""The base of every wire model: unknown fields and non-finite numbers are errors, and a bad body
costs what a good one of its size costs."""

from __future__ import annotations

from itertools import islice
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

_UNKNOWN_SHOWN = 5


class WireModel(BaseModel):
    """Base of every wire model: unknown fields are errors (a typo never passes silently), and
    NaN / Infinity are refused wherever a number is expected.

    Unknown fields are collected (``extra="allow"``, kept as plain JSON values, as a valid
    ``dict[str, Any]`` field holds them) and refused as ONE error naming the first few: with
    ``extra="forbid"`` pydantic made one error per unknown key, and 300k of them cost 2 s and
    +307 MB to build and render. Wire lists are ``fail_fast`` (the first bad item ends their
    validation) for the same reason: a million bad prompt ids were a million errors (10 s, +1.5 GB).
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> Any:
        # "after", not "wrap": a wrap validator makes the JSON parser build Python dicts first.
        cls, extra = type(self), self.__pydantic_extra__
        if extra:
            shown = ", ".join(repr(str(name)[:40]) for name in islice(extra, _UNKNOWN_SHOWN))
            more = f" (+{len(extra) - _UNKNOWN_SHOWN} more)" if len(extra) > _UNKNOWN_SHOWN else ""
            raise PydanticCustomError(
                "extra_forbidden",
                "unknown field(s) {fields}: {model} takes only {known}",
                {"fields": shown + more, "model": cls.__name__, "known": ", ".join(cls.model_fields)[:300]},
            )
        return self
