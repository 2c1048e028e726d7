"""Source documents: an ID, its token IDs as a read-only int32 array, and a partition.

A document is only stored here; whether its tokens form a valid framed document is
decided by the :class:`~seqpack.binding.BatchBinding` that later uses it.
"""

from __future__ import annotations

import numpy as np

from .._arguments import regular_array
from .._read_only import ReadOnlyArrays
from .binding import Partition, check_partition
from ..errors import InvalidInputError

_INT32 = np.iinfo(np.int32)


def as_int32_tokens(token_ids: object, name: str = "token IDs") -> np.ndarray:
    """A read-only, C-contiguous int32 copy of a 1-D integer array or list.

    Non-integer dtypes, other shapes and values outside int32 are rejected.
    """
    array = regular_array(name, token_ids)
    if array.ndim != 1:
        raise InvalidInputError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        array = array.astype(np.int32)
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"{name} must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < _INT32.min or array.max() > _INT32.max):
        low, high = int(array.min()), int(array.max())
        raise InvalidInputError(
            f"{name} range [{low}, {high}] does not fit int32 [{_INT32.min}, {_INT32.max}]"
        )
    tokens = np.array(array, dtype=np.int32, order="C", copy=True)
    tokens.flags.writeable = False
    return tokens


class BatchDocument(ReadOnlyArrays):
    """One source document: ``source_id``, ``token_ids`` (read-only int32) and
    ``partition``. ``len(document)`` is its token count, framing included."""

    __slots__ = ("_source_id", "_token_ids", "_partition")

    def __init__(self, source_id: str, token_ids: object, partition: Partition = Partition.TRAIN):
        if not isinstance(source_id, str) or not source_id:
            raise InvalidInputError(f"document source_id must be a non-empty str, got {source_id!r}")
        check_partition(partition)
        self._source_id = source_id
        self._token_ids = as_int32_tokens(token_ids, f"document {source_id!r} token IDs")
        self._partition = partition

    @property
    def source_id(self) -> str:
        return self._source_id

    @property
    def token_ids(self) -> np.ndarray:
        return self._token_ids

    @property
    def partition(self) -> Partition:
        return self._partition

    def __len__(self) -> int:
        return self._token_ids.shape[0]

    def __repr__(self) -> str:
        return (
            f"BatchDocument({self._source_id!r}, {len(self)} tokens, "
            f"partition={self._partition.name})"
        )
