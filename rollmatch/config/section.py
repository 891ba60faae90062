"""The base of every config section: unknown keys are errors, assignments are validated.

Owns :class:`Section` only, so each schema module (``config.schema`` and the sections it gathers)
builds on one base without importing the others.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
