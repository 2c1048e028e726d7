"""A small reverse-mode tape over float64 numpy arrays.

A :class:`Tensor` holds a value and, when it depends on a leaf that requires a gradient,
the parents it was made from and a closure that adds its gradient into theirs.
:meth:`Tensor.backward` visits the graph in reverse topological order. Gradients
accumulate, so a value used twice receives the sum of both uses; any tensor (a
parameter or an intermediate activation made a leaf) can be asked for its gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class Tensor:
    """A float64 array on the tape.

    ``requires_grad`` marks a leaf whose gradient is wanted; results of ops require a
    gradient exactly when one of their parents does. ``grad`` is filled by ``backward``.
    """

    __slots__ = ("value", "grad", "requires_grad", "_parents", "_backward")

    def __init__(self, value, requires_grad: bool = False):
        self.value = np.asarray(value, dtype=np.float64)
        self.grad: np.ndarray | None = None
        self.requires_grad = requires_grad
        self._parents: tuple[Tensor, ...] = ()
        self._backward: Callable[[np.ndarray], None] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    def accumulate(self, gradient: np.ndarray) -> None:
        """Add ``gradient`` into this tensor's gradient (no-op when none is wanted)."""
        if not self.requires_grad:
            return
        if self.grad is None:
            # A private copy: the same upstream array may be handed to several parents.
            self.grad = np.array(gradient, dtype=np.float64, copy=True).reshape(self.value.shape)
        else:
            self.grad += gradient

    def backward(self, seed: np.ndarray | None = None) -> None:
        """Fill ``grad`` of every tensor this one depends on with d(self)/d(tensor).

        ``seed`` is the upstream gradient (ones for a scalar by default). Gradients from
        an earlier call are cleared first, so calling twice gives the same result.
        """
        order = self._topological_order()
        for tensor in order:
            tensor.grad = None
        if seed is None:
            seed = np.ones_like(self.value)
        self.accumulate(np.asarray(seed, dtype=np.float64))
        for tensor in reversed(order):
            if tensor._backward is not None and tensor.grad is not None:
                tensor._backward(tensor.grad)

    def _topological_order(self) -> list[Tensor]:
        order: list[Tensor] = []
        seen: set[int] = set()
        stack: list[tuple[Tensor, bool]] = [(self, False)]
        while stack:
            tensor, expanded = stack.pop()
            if expanded:
                order.append(tensor)
                continue
            if id(tensor) in seen or not tensor.requires_grad:
                continue
            seen.add(id(tensor))
            stack.append((tensor, True))
            stack.extend((parent, False) for parent in tensor._parents)
        return order

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, requires_grad={self.requires_grad})"


def record(
    value: np.ndarray,
    parents: Sequence[Tensor],
    backward: Callable[[np.ndarray], None],
) -> Tensor:
    """Make an op's output; ``backward(grad)`` must call ``accumulate`` on the parents."""
    out = Tensor(value)
    if any(parent.requires_grad for parent in parents):
        out.requires_grad = True
        out._parents = tuple(parents)
        out._backward = backward
    return out


def as_tensor(value) -> Tensor:
    """Return ``value`` if it is a Tensor, else a constant Tensor holding it."""
    return value if isinstance(value, Tensor) else Tensor(value)
