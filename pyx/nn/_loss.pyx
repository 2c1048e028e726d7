"""Stable indexed negative log likelihood over selected logit rows, and its per-occurrence sums.

Only the rows listed in ``rows`` are read (the eligible targets, gathered by the Python
layer before any arithmetic); every other logit cell is never touched, so it may hold
NaN or inf. Natural logarithm; each row's log-sum-exp is kept as two numbers, the row's
maximum ``m`` and ``log(sum(exp(x - m)))``, never added: a loss is ``(m - x[target]) +
log(...)`` and a probability ``exp((x - m) - log(...))``, so logits of any magnitude (1e30,
say, where ``m + log(...)`` would round to ``m``) lose nothing to cancellation. The
occurrence kernels see the selected rows grouped by ``offsets``: occurrence ``k`` owns
items ``[offsets[k], offsets[k + 1])`` (possibly none). Ctrl-C stops any kernel between
rows (``KeyboardInterrupt``; outputs then undefined).
"""

from libc.math cimport exp, log
from libc.stdint cimport int64_t

from _interrupt cimport Interrupt, interrupt_finish, interrupt_requested, interrupt_start, interrupted_after
from _kernel_types cimport real, cell_t

# Logit cells between two looks at pending signals (a row of a small vocabulary is cheaper
# than the clock read).
cdef enum:
    CHECK_CELLS = 1 << 16


cdef inline void _row_normalizer(const real[::1] logits, double[::1] normalizer) noexcept nogil:
    """``normalizer`` = (the row's maximum m, log(sum(exp(logits - m))))."""
    cdef Py_ssize_t column
    cdef double maximum = logits[0]
    cdef double total = 0.0
    for column in range(1, logits.shape[0]):
        if logits[column] > maximum:
            maximum = logits[column]
    for column in range(logits.shape[0]):
        total += exp(logits[column] - maximum)
    normalizer[0] = maximum
    normalizer[1] = log(total)


cdef inline void _add_row_gradient(
    const real[::1] logits,  # [V], one selected row
    const double[::1] normalizer,  # (maximum, log of the shifted sum), from the forward
    cell_t target,
    double scale,
    real[::1] dlogits,  # [V], accumulated into
) noexcept nogil:
    """``dlogits += scale * (softmax(logits) - onehot(target))``, one row."""
    cdef Py_ssize_t column
    for column in range(logits.shape[0]):
        dlogits[column] += <real>(scale * exp((logits[column] - normalizer[0]) - normalizer[1]))
    dlogits[target] -= <real>scale


def indexed_nll_forward(
    const real[:, ::1] logits not None,  # [cells, V]
    const Py_ssize_t[::1] rows not None,  # [N], eligible cells
    const cell_t[::1] targets not None,  # [N], gold class of each eligible cell
    double[:, ::1] normalizers not None,  # [N, 2], saved for the backward
    double[::1] losses not None,  # [N], -log p(target)
):
    """Write each selected row's normalizer (its maximum and the log of its shifted sum)
    and loss; return the loss sum (in row order)."""
    cdef Py_ssize_t count = rows.shape[0]
    cdef Py_ssize_t item
    cdef double total = 0.0
    cdef Py_ssize_t since = 0
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for item in range(count):
            if interrupted_after(&interrupt, &since, logits.shape[1], CHECK_CELLS):
                break
            _row_normalizer(logits[rows[item]], normalizers[item])
            losses[item] = (normalizers[item, 0] - logits[rows[item], targets[item]]) + normalizers[item, 1]
            total += losses[item]
    interrupt_finish(&interrupt)
    return total


def indexed_nll_backward(
    const real[:, ::1] logits not None,  # [cells, V]
    const Py_ssize_t[::1] rows not None,  # [N]
    const cell_t[::1] targets not None,  # [N]
    const double[:, ::1] normalizers not None,  # [N, 2], from the forward
    double scale,  # d(objective)/d(loss sum), 1/N for the mean
    real[:, ::1] dlogits not None,  # [cells, V], accumulated into on selected rows only
):
    """Add ``scale * (softmax - onehot(target))`` into each selected row of ``dlogits``."""
    cdef Py_ssize_t count = rows.shape[0]
    cdef Py_ssize_t item, since = 0
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for item in range(count):
            if interrupted_after(&interrupt, &since, logits.shape[1], CHECK_CELLS):
                break
            _add_row_gradient(logits[rows[item]], normalizers[item], targets[item], scale, dlogits[rows[item]])
    interrupt_finish(&interrupt)


def occurrence_logprob_sums(
    const double[::1] losses not None,  # [N], -log p(target) from indexed_nll_forward
    const int64_t[::1] offsets not None,  # [n + 1], non-decreasing from 0 to N
    double[::1] values not None,  # [N], log p(target)
    double[::1] sums not None,  # [n], log p summed over each occurrence's items
):
    """Write each item's log-probability and each occurrence's sum of them.

    Each sum adds its items in index order from 0.0 (an occurrence without items sums
    to 0.0), so the result depends on nothing but the inputs.
    """
    cdef Py_ssize_t occurrence, item
    cdef Py_ssize_t since = 0
    cdef double total
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for occurrence in range(sums.shape[0]):
            if interrupted_after(&interrupt, &since, offsets[occurrence + 1] - offsets[occurrence] + 1, CHECK_CELLS):
                break
            total = 0.0
            for item in range(offsets[occurrence], offsets[occurrence + 1]):
                values[item] = -losses[item]
                total += values[item]
            sums[occurrence] = total
    interrupt_finish(&interrupt)


def occurrence_logprob_backward(
    const real[:, ::1] logits not None,  # [cells, V]
    const Py_ssize_t[::1] rows not None,  # [N]
    const cell_t[::1] targets not None,  # [N]
    const double[:, ::1] normalizers not None,  # [N, 2], from indexed_nll_forward
    const int64_t[::1] offsets not None,  # [n + 1], non-decreasing from 0 to N
    const double[::1] weights not None,  # [n], d(objective)/d(sum of occurrence k)
    real[:, ::1] dlogits not None,  # [cells, V], accumulated into on selected rows only
):
    """Add ``weights[k] * (onehot(target) - softmax)`` into each selected row of occurrence ``k``:
    the gradient of ``sum_k weights[k] * sum(log p)`` over the occurrence's items."""
    cdef Py_ssize_t occurrence, item
    cdef Py_ssize_t since = 0
    cdef double scale
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for occurrence in range(weights.shape[0]):
            scale = -weights[occurrence]  # log p is minus the loss
            for item in range(offsets[occurrence], offsets[occurrence + 1]):
                if interrupted_after(&interrupt, &since, logits.shape[1], CHECK_CELLS):
                    break
                _add_row_gradient(logits[rows[item]], normalizers[item], targets[item], scale,
                                  dlogits[rows[item]])
            if interrupt_requested(&interrupt):
                break
    interrupt_finish(&interrupt)
