"""What every configuration section shares: the error a bad value raises and the model base."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


class Section(BaseModel):
    # allow_inf_nan: a rate, window or penalty of .inf (or an unbounded field of .nan) passed the bounds
    # and failed later, e.g. every learner step refused as non-finite
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)
