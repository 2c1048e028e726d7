"""Stable indexed negative log likelihood over selected logit rows.

Only the rows listed in ``rows`` are read (the eligible targets, gathered by the Python
layer before any arithmetic); every other logit cell is never touched, so it may hold
NaN or inf. Natural logarithm; the log-sum-exp subtracts each row's maximum. Ctrl-C
stops either kernel between rows (``KeyboardInterrupt``; outputs then undefined).
"""

from libc.math cimport exp, log

from _interrupt cimport Interrupt, interrupt_finish, interrupt_start, interrupted
from _kernel_types cimport real, cell_t

# Logit cells between two looks at pending signals (a row of a small vocabulary is cheaper
# than the clock read).
cdef enum:
    CHECK_CELLS = 1 << 16


cdef inline double _row_logsumexp(const real[::1] logits) noexcept nogil:
    cdef Py_ssize_t column
    cdef double maximum = logits[0]
    cdef double total = 0.0
    for column in range(1, logits.shape[0]):
        if logits[column] > maximum:
            maximum = logits[column]
    for column in range(logits.shape[0]):
        total += exp(logits[column] - maximum)
    return maximum + log(total)


def indexed_nll_forward(
    const real[:, ::1] logits not None,  # [cells, V]
    const Py_ssize_t[::1] rows not None,  # [N], eligible cells
    const cell_t[::1] targets not None,  # [N], gold class of each eligible cell
    double[::1] logsumexp not None,  # [N], saved for the backward
    double[::1] losses not None,  # [N], -log p(target)
):
    """Write each selected row's log-sum-exp and loss; return the loss sum (in row order)."""
    cdef Py_ssize_t count = rows.shape[0]
    cdef Py_ssize_t item
    cdef double total = 0.0
    cdef Py_ssize_t since = 0
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for item in range(count):
            since += logits.shape[1]
            if since >= CHECK_CELLS:
                since = 0
                if interrupted(&interrupt):
                    break
            logsumexp[item] = _row_logsumexp(logits[rows[item]])
            losses[item] = logsumexp[item] - logits[rows[item], targets[item]]
            total += losses[item]
    interrupt_finish(&interrupt)
    return total


def indexed_nll_backward(
    const real[:, ::1] logits not None,  # [cells, V]
    const Py_ssize_t[::1] rows not None,  # [N]
    const cell_t[::1] targets not None,  # [N]
    const double[::1] logsumexp not None,  # [N], from the forward
    double scale,  # d(objective)/d(loss sum), 1/N for the mean
    real[:, ::1] dlogits not None,  # [cells, V], accumulated into on selected rows only
):
    """Add ``scale * (softmax - onehot(target))`` into each selected row of ``dlogits``."""
    cdef Py_ssize_t count = rows.shape[0]
    cdef Py_ssize_t classes = logits.shape[1]
    cdef Py_ssize_t item, row, column, since = 0
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for item in range(count):
            since += classes
            if since >= CHECK_CELLS:
                since = 0
                if interrupted(&interrupt):
                    break
            row = rows[item]
            for column in range(classes):
                dlogits[row, column] += <real>(
                    scale * exp(logits[row, column] - logsumexp[item])
                )
            dlogits[row, targets[item]] -= <real>scale
    interrupt_finish(&interrupt)
