# Interruptible kernels (cimport only; no runtime module).
#
# A kernel that may run longer than ~0.1 s keeps an ``Interrupt`` and, between chunks of
# work, lets the thread that called it (the only one that may run Python) ask
# ``interrupted``: at most every 20 ms it takes the GIL briefly and runs pending
# signal handlers. When a handler raised (Ctrl-C's KeyboardInterrupt), every thread stops
# at its next check, the kernel frees what it holds and returns ``INTERRUPTED``, and its
# ``def`` entry calls ``interrupt_finish()``, which re-raises the handler's own exception,
# or raises a signal that came after the calling thread's last look (within 20 ms of the
# end). A kernel whose other threads may run long items keeps the calling thread looking
# (``seqpack_pause`` between looks) until they are done. Outputs are then undefined;
# inputs are never written.

cdef extern from "Python.h":
    int PyErr_CheckSignals()

cdef extern from "_interrupt.h":
    double SEQPACK_CHECK_SECONDS
    double seqpack_monotonic_seconds() noexcept nogil
    int seqpack_load_flag(int *flag) noexcept nogil
    void seqpack_store_flag(int *flag, int value) noexcept nogil
    void seqpack_pause() noexcept nogil

cdef enum:
    # Returned by an interrupted kernel (distinct from every kernel's own status codes).
    INTERRUPTED = -2

cdef struct Interrupt:
    double next_check
    int stop


cdef inline void interrupt_start(Interrupt *state) noexcept nogil:
    state.next_check = seqpack_monotonic_seconds() + SEQPACK_CHECK_SECONDS
    state.stop = 0


cdef inline bint interrupt_requested(Interrupt *state) noexcept nogil:
    """Whether the work should stop; any thread may ask (cheap: one atomic load)."""
    return seqpack_load_flag(&state.stop) != 0


cdef inline bint interrupted(Interrupt *state) noexcept nogil:
    """From the calling thread only: run pending signal handlers when a check is due.

    A handler's exception stays set for ``raise_pending``; the stop flag tells the
    other threads.
    """
    if seqpack_load_flag(&state.stop):
        return True
    if seqpack_monotonic_seconds() < state.next_check:
        return False
    with gil:
        if PyErr_CheckSignals() != 0:
            seqpack_store_flag(&state.stop, 1)
    state.next_check = seqpack_monotonic_seconds() + SEQPACK_CHECK_SECONDS
    return seqpack_load_flag(&state.stop) != 0


cdef inline bint interrupted_after(Interrupt *state, Py_ssize_t *since, Py_ssize_t work,
                                   Py_ssize_t every) noexcept nogil:
    """From the calling thread only: ``interrupted``, asked once the ``work`` added to
    ``since[0]`` reaches ``every`` (``since[0]`` then starts again from 0), so a loop of short
    steps reads the clock once per chunk of work instead of once per step."""
    since[0] += work
    if since[0] < every:
        return False
    since[0] = 0
    return interrupted(state)


cdef inline int interrupt_finish(Interrupt *state) except -1:
    """With the GIL, once the kernel's work has ended: raise what a signal handler raised
    during the call (the kernel stopped early), or run the handlers of signals that
    arrived after the calling thread's last look, so a Ctrl-C during a call from the main
    thread (the only one where Python runs signal handlers) surfaces from the kernel's
    entry."""
    if state.stop:
        return -1
    return -1 if PyErr_CheckSignals() != 0 else 0
