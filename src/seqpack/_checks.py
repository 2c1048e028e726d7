"""Argument checks shared by the configuration classes."""

from __future__ import annotations

import numpy as np

from .errors import InvalidInputError


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bool and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``, else :class:`InvalidInputError`."""
    if not is_int(value):
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise InvalidInputError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidInputError(f"{name} is {value}; the maximum is {maximum}")
    return value
