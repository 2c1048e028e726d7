"""Masked embedding gather and scatter.

A cell holding ``PAD_CELL`` (-1) is excluded before any conversion: the forward gives it a
zero row without reading the table, and the backward never adds its gradient anywhere.
Every other ID must lie in ``[0, V)``; ``first_invalid_token`` finds the first one that
does not, so the Python layer can raise before any lookup.
"""

from _kernel_types cimport real, cell_t

cdef enum:
    PAD_CELL = -1


def first_invalid_token(const cell_t[::1] ids not None, Py_ssize_t vocabulary_size):
    """Return the flat index of the first ID that is neither PAD_CELL nor in ``[0, V)``, else -1."""
    cdef Py_ssize_t cell
    cdef Py_ssize_t found = -1
    with nogil:
        for cell in range(ids.shape[0]):
            if ids[cell] != PAD_CELL and (ids[cell] < 0 or ids[cell] >= vocabulary_size):
                found = cell
                break
    return found


def embedding_forward(
    const real[:, ::1] table not None,  # [V, D]
    const cell_t[::1] ids not None,  # [cells]
    real[:, ::1] out not None,  # [cells, D], written in full
):
    """Copy table row ``ids[c]`` into ``out[c]``; PAD_CELL cells get zero rows."""
    cdef Py_ssize_t cells = ids.shape[0]
    cdef Py_ssize_t width = table.shape[1]
    cdef Py_ssize_t cell, column, row
    with nogil:
        for cell in range(cells):
            if ids[cell] == PAD_CELL:
                for column in range(width):
                    out[cell, column] = 0
                continue
            row = ids[cell]
            for column in range(width):
                out[cell, column] = table[row, column]


def embedding_backward(
    const real[:, ::1] dout not None,  # [cells, D]
    const cell_t[::1] ids not None,  # [cells]
    real[:, ::1] dtable not None,  # [V, D], accumulated into
):
    """Add ``dout[c]`` into ``dtable[ids[c]]`` for every active cell, in cell order."""
    cdef Py_ssize_t cells = ids.shape[0]
    cdef Py_ssize_t width = dout.shape[1]
    cdef Py_ssize_t cell, column, row
    with nogil:
        for cell in range(cells):
            if ids[cell] == PAD_CELL:
                continue
            row = ids[cell]
            for column in range(width):
                dtable[row, column] += dout[cell, column]
