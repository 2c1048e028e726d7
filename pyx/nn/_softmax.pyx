"""Range causal softmax over square score grids, forward and backward.

A grid ``g`` has ``lengths[g]`` valid queries (a prefix). Valid query ``t`` normalizes
over keys ``[starts[g, t], t]`` only, with the max-subtracted stable form; every other
entry of its output row is zero. Inactive queries (``t >= lengths[g]``) skip
normalization and their output and gradient rows are exactly zero. Entries outside a
permitted range are never read, so they may hold anything, NaN included.
The Python layer (``seqpack.nn.softmax``) validates lengths and starts before calling.
Ctrl-C stops either kernel between rows (``KeyboardInterrupt``; outputs then undefined).
"""

from libc.math cimport exp
from libc.stdint cimport int64_t

from _interrupt cimport Interrupt, interrupt_finish, interrupt_start, interrupted_after
from _kernel_types cimport real, cell_t

# Score cells between two looks at pending signals (a short row is cheaper than the clock read).
cdef enum:
    CHECK_CELLS = 1 << 16


cdef inline void _zero_row(real* row, Py_ssize_t first, Py_ssize_t stop) noexcept nogil:
    cdef Py_ssize_t key
    for key in range(first, stop):
        row[key] = 0


cdef inline void _softmax_row(
    const real* scores, real* probabilities, Py_ssize_t start, Py_ssize_t query, Py_ssize_t width
) noexcept nogil:
    cdef Py_ssize_t key
    cdef double maximum = scores[start]
    cdef double denominator = 0.0
    cdef double weight
    for key in range(start + 1, query + 1):
        if scores[key] > maximum:
            maximum = scores[key]
    for key in range(start, query + 1):
        weight = exp(scores[key] - maximum)
        probabilities[key] = <real>weight
        denominator += weight
    for key in range(start, query + 1):
        probabilities[key] = <real>(probabilities[key] / denominator)
    _zero_row(probabilities, 0, start)
    _zero_row(probabilities, query + 1, width)


cdef inline void _softmax_row_backward(
    const real* probabilities,
    const real* dprobabilities,
    real* dscores,
    Py_ssize_t start,
    Py_ssize_t query,
    Py_ssize_t width,
) noexcept nogil:
    cdef Py_ssize_t key
    cdef double dot = 0.0
    for key in range(start, query + 1):
        dot += <double>probabilities[key] * dprobabilities[key]
    for key in range(start, query + 1):
        dscores[key] = <real>(probabilities[key] * (dprobabilities[key] - dot))
    _zero_row(dscores, 0, start)
    _zero_row(dscores, query + 1, width)


# Row pointers below come from memoryview indexing, which the debug build bounds-checks.

def range_softmax_forward(
    const real[:, :, ::1] scores not None,  # [grids, T, T]
    const int64_t[::1] lengths not None,  # [grids]
    const cell_t[:, ::1] starts not None,  # [grids, T]
    real[:, :, ::1] probabilities not None,  # [grids, T, T], written in full
):
    """Write the range causal softmax of every grid into ``probabilities``."""
    cdef Py_ssize_t width = scores.shape[1]
    cdef Py_ssize_t grid, query, since = 0
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for grid in range(scores.shape[0]):
            if interrupt.stop:
                break
            for query in range(width):
                if interrupted_after(&interrupt, &since, width, CHECK_CELLS):
                    break
                if query < lengths[grid]:
                    _softmax_row(
                        &scores[grid, query, 0], &probabilities[grid, query, 0], starts[grid, query], query, width
                    )
                else:
                    _zero_row(&probabilities[grid, query, 0], 0, width)
    interrupt_finish(&interrupt)


def range_softmax_backward(
    const real[:, :, ::1] probabilities not None,  # [grids, T, T], saved forward output
    const real[:, :, ::1] dprobabilities not None,  # [grids, T, T]
    const int64_t[::1] lengths not None,  # [grids]
    const cell_t[:, ::1] starts not None,  # [grids, T]
    real[:, :, ::1] dscores not None,  # [grids, T, T], written in full
):
    """Write the score gradient: ``p * (dp - sum(p * dp))`` inside each range, zero outside."""
    cdef Py_ssize_t width = probabilities.shape[1]
    cdef Py_ssize_t grid, query, since = 0
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for grid in range(probabilities.shape[0]):
            if interrupt.stop:
                break
            for query in range(width):
                if interrupted_after(&interrupt, &since, width, CHECK_CELLS):
                    break
                if query < lengths[grid]:
                    _softmax_row_backward(
                        &probabilities[grid, query, 0], &dprobabilities[grid, query, 0],
                        &dscores[grid, query, 0], starts[grid, query], query, width,
                    )
                else:
                    _zero_row(&dscores[grid, query, 0], 0, width)
    interrupt_finish(&interrupt)
