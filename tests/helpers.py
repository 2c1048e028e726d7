"""Helpers shared by the tests: finite differences and the layouts they probe."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np


def numerical_gradient(objective: Callable[[], float], array: np.ndarray, step: float = 1e-6) -> np.ndarray:
    """Central differences ``(f(x + h) - f(x - h)) / 2h`` of ``objective()`` in each entry of ``array``.

    ``array`` (C-contiguous, so that its flat view aliases it) is perturbed in place, one
    entry at a time, and restored exactly.
    """
    if not array.flags.c_contiguous:
        raise AssertionError("numerical_gradient needs a C-contiguous array")
    gradient = np.zeros(array.shape)
    flat = array.reshape(-1)
    for index in range(flat.size):
        saved = flat[index]
        flat[index] = saved + step
        upper = objective()
        flat[index] = saved - step
        lower = objective()
        flat[index] = saved
        gradient.reshape(-1)[index] = (upper - lower) / (2 * step)
    return gradient


def write_jsonl(path, texts):
    """A JSONL file of ``{"text": ...}`` lines at ``path``; returns the path."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def reseal(directory, manifest: dict) -> None:
    """Write ``manifest`` (edited on purpose) into the dataset at ``directory``, sealed
    again, so that a test reaches the checks behind the seal."""
    from pathlib import Path

    from seqpack.io import format as fmt

    (Path(directory) / fmt.MANIFEST).write_text(json.dumps(fmt.seal(manifest)))
