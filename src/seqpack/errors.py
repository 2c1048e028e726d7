"""The seqpack exception hierarchy.

Every error the library raises derives from :class:`SeqpackError`. Errors caused by
the caller's input or limits also derive from :class:`ValueError`, so code that
already catches ``ValueError`` keeps working.

Code that handles an error reads its fields (``kind``, ``path``, ``line``, ``context``
and each class's own), never its message, and names where it happened with
:meth:`SeqpackError.within`, never by editing ``args``.
"""

from __future__ import annotations


def _rebuilt(cls, args: tuple) -> "SeqpackError":
    """An error of ``cls`` with ``args``, without its ``__init__`` (unpickling sets the fields)."""
    error = cls.__new__(cls)
    error.args = args
    return error


class SeqpackError(Exception):
    """Base class of every seqpack error.

    * ``message``: the text it was raised with;
    * ``kind``: a short identifier that callers branch on, for the few errors one must
      tell apart from others of its class (``"missing-extra"``), else None;
    * ``path`` and ``line``: the file or input at fault and the line (1-based) or row
      (0-based) in it, as its reader counts them, when the error is tied to one;
    * ``context``: the labels :meth:`within` added, outermost first.

    ``str(error)`` is ``"label: ...: label: message"``, the context then the message,
    and always ``args[0]``: an error rebuilt from its class, ``str`` and ``vars`` (as
    the Ray engine sends it) reads the same, and every error pickles (subclass fields too).
    """

    def __init__(self, message: str = "", *, kind: str | None = None, path: str | None = None,
                 line: int | None = None):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.path = path
        self.line = line
        self.context: tuple[str, ...] = ()

    def within(self, label, *, path=None, line: int | None = None) -> "SeqpackError":
        """Name where the error happened: ``label`` goes before the message (and before
        any label added earlier, which names a place inside this one). ``path`` and
        ``line`` are recorded when the error names no path yet: the innermost place wins.
        Returns the error, to ``raise error.within(...)``."""
        label = str(label)
        self.context = (label, *self.context)
        self.args = (f"{label}: {self.args[0] if self.args else ''}", *self.args[1:])
        if path is not None and self.path is None:
            self.path, self.line = str(path), line
        return self

    def __reduce__(self):
        return _rebuilt, (type(self), self.args), self.__dict__


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

    def __init__(self, message: str, position: int | None = None, **fields):
        super().__init__(message, **fields)
        self.position = position


class DecodeLimitError(TokenizerError):
    """A document exceeds the binding's decode limits (never truncated)."""


class BindingError(InvalidInputError):
    """An example, batch or model was built under a different binding or partition."""


class CapacityError(InvalidInputError):
    """A batch would hold more cells than allowed (or an example more predictions than fit).

    ``cells`` is what the batch or example needs and ``maximum`` the configured limit
    (None in an error rebuilt from its message alone, as PyTorch's DataLoader re-raises
    a worker's).
    """

    def __init__(self, message: str, cells: int | None = None, maximum: int | None = None, **fields):
        super().__init__(message, **fields)
        self.cells = cells
        self.maximum = maximum


class MemoryBudgetError(InvalidInputError):
    """Padding or packing would hold more bytes than the config's ``max_memory_bytes``.

    Raised before anything large is allocated; ``required`` and ``maximum`` are bytes
    (None in an error rebuilt from its message alone, as for :class:`CapacityError`).
    """

    def __init__(self, message: str, required: int | None = None, maximum: int | None = None, **fields):
        super().__init__(message, **fields)
        self.required = required
        self.maximum = maximum


class OutOfMemoryError(SeqpackError, MemoryError):
    """A kernel could not allocate its workspace (the machine, not a budget, ran out)."""


class VerificationError(SeqpackError):
    """A batch's arrays break an invariant that downstream training relies on.

    ``row`` and ``column`` locate the first violation found (``None`` when it is
    not tied to a cell).
    """

    def __init__(self, message: str, row: int | None = None, column: int | None = None, **fields):
        super().__init__(message, **fields)
        self.row = row
        self.column = column
