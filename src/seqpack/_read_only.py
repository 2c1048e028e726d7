"""Arrays a class keeps read-only stay read-only in its copies.

numpy unpickles every array writable, and ``copy.deepcopy`` goes through pickling's
protocol, skipping ``__init__`` and ``__post_init__``, where the arrays were frozen: a
copy sent to a data-loader worker or a Ray task would then accept writes its original
refuses. :class:`ReadOnlyArrays` freezes them again as the copy is restored.
"""

from __future__ import annotations

import numpy as np


def freeze(value) -> None:
    """Make every numpy array in ``value`` read-only: ``value`` itself, or the arrays held
    (at any depth) in its tuples, lists and dict values. Other objects are left alone."""
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    elif isinstance(value, (tuple, list)):
        for item in value:
            freeze(item)
    elif isinstance(value, dict):
        for item in value.values():
            freeze(item)


class ReadOnlyArrays:
    """A mixin: a pickled or deep-copied instance has its arrays read-only again (those in
    its attributes, their tuples, lists and dicts), as ``__init__`` left the original's.
    Attributes named in ``_writable`` are restored as they are, and a shallow copy
    (``copy.copy``) shares the original's arrays untouched: they may be its caller's."""

    __slots__ = ()
    _writable: tuple[str, ...] = ()

    def __setstate__(self, state) -> None:
        self._restore(state, frozen=True)

    def __copy__(self):
        # A shallow copy shares the original's arrays: left as they are (freezing them would
        # change the original's, and its caller's).
        rebuild, arguments, state = self.__reduce_ex__(4)[:3]
        copied = rebuild(*arguments)
        copied._restore(state, frozen=False)
        return copied

    def _restore(self, state, frozen: bool) -> None:
        # pickle's default state: the instance dict, or (dict or None, slot values) with __slots__
        parts = state if isinstance(state, tuple) else (state, None)
        for part in parts:
            for name, value in (part or {}).items():
                if frozen and name not in self._writable:
                    freeze(value)
                object.__setattr__(self, name, value)
