"""The seqpack exception hierarchy.

Every error the library raises derives from :class:`SeqpackError`. Errors caused by
the caller's input or limits also derive from :class:`ValueError`, so code that
already catches ``ValueError`` keeps working.
"""

from __future__ import annotations


class SeqpackError(Exception):
    """Base class of every seqpack error."""


class InvalidInputError(SeqpackError, ValueError):
    """The caller's input breaks a rule (shape, range, framing, binding...)."""


class BatchIndexError(InvalidInputError, IndexError):
    """A batch number outside a plan's, epoch's or dataset's batches (also an
    ``IndexError``, as a sequence's would be)."""


class TokenizerError(InvalidInputError):
    """A token sequence is not a valid document for the bound tokenizer.

    ``position`` is the index of the offending token, or ``None`` when the whole
    sequence is at fault (for example an empty one).
    """

    def __init__(self, message: str, position: int | None = None):
        super().__init__(message)
        self.position = position


class DecodeLimitError(TokenizerError):
    """A document exceeds the binding's decode limits (never truncated)."""


class BindingError(InvalidInputError):
    """An example, batch or model was built under a different binding or partition."""


class CapacityError(InvalidInputError):
    """A batch would hold more cells than allowed (or an example more predictions than fit).

    ``cells`` is what the batch or example needs and ``maximum`` the configured limit.
    """

    def __init__(self, message: str, cells: int, maximum: int):
        super().__init__(message)
        self.cells = cells
        self.maximum = maximum


class MemoryBudgetError(InvalidInputError):
    """Padding or packing would hold more bytes than the config's ``max_memory_bytes``.

    Raised before anything large is allocated; ``required`` and ``maximum`` are bytes.
    """

    def __init__(self, message: str, required: int, maximum: int):
        super().__init__(message)
        self.required = required
        self.maximum = maximum


class OutOfMemoryError(SeqpackError, MemoryError):
    """A kernel could not allocate its workspace (the machine, not a budget, ran out)."""


class VerificationError(SeqpackError):
    """A batch's arrays break an invariant that downstream training relies on.

    ``row`` and ``column`` locate the first violation found (``None`` when it is
    not tied to a cell).
    """

    def __init__(self, message: str, row: int | None = None, column: int | None = None):
        super().__init__(message)
        self.row = row
        self.column = column
