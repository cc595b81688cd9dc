"""Base class for config sections: strict (unknown keys are errors) and self-describing.

Every section of the config tree derives from `Section`. Fields carry a `description`, which
`gyre-ray config --describe` prints and a test checks is present on every field.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A strict config section: unknown keys and wrong types are rejected, assignments validated, and
    numbers finite (an infinite learning rate or timeout is a typo, not a setting)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)
