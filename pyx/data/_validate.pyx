"""Bulk validation for columnar example tables.

``first_bad_document`` scans every document of a flat token array once and
returns the index of the first one that breaks a tokenizer rule; the Python layer
then explains that document's fault with the per-document checker.
``first_bad_range`` checks every example's source range and returns the first bad one.
"""

cimport cython
from cython.parallel cimport prange, threadid
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.string cimport memcpy

from _interrupt cimport Interrupt, interrupt_finish, interrupt_requested, interrupt_start, interrupted
from _kernel_types cimport cell_t

cpdef enum DocumentFault:
    DOCUMENT_OK = 0
    BROKEN_RULE = 1      # framing, control ID inside content, ID range, or a decode limit
    EMPTY_CONTENT = 2    # framed [BOS, EOS] (or [EOS]), or fewer than 2 tokens as given: no example

# Documents are scanned in this many runs, split between the threads; the first
# faulty run names the first faulty document. Pending signals are looked at once per
# CHECK_EVERY documents or ranges (a document counts one more for each TOKENS_PER_UNIT
# of its tokens, so a run of long documents is looked into as often).
cdef enum:
    RUNS = 64
    CHECK_EVERY = 1 << 12
    TOKENS_PER_UNIT = 256


@cython.cdivision(True)
cdef Py_ssize_t token_run_start(Py_ssize_t run, Py_ssize_t runs, const int64_t[::1] offsets) noexcept nogil:
    """First document of ``run`` when the documents are cut into ``runs`` runs of near-equal
    tokens: the first whose start lies at or past ``run / runs`` of them (all for the last)."""
    cdef Py_ssize_t documents = offsets.shape[0] - 1
    cdef int64_t total = offsets[documents] - offsets[0]
    cdef int64_t goal = offsets[0] + total // runs * run + total % runs * run // runs   # (no overflow)
    cdef Py_ssize_t low = 0, high = documents, middle
    if run >= runs:
        return documents
    while low < high:
        middle = low + (high - low) // 2
        if offsets[middle] < goal:
            low = middle + 1
        else:
            high = middle
    return low


cdef DocumentFault document_fault(
    const cell_t* tokens, int64_t count, const int64_t* piece_lengths, uint32_t vocabulary_size,
    int64_t longest_piece, cell_t bos, cell_t eos, bint as_given, int64_t max_tokens, int64_t max_bytes,
) noexcept nogil:
    """A framed document is ``[BOS, content..., EOS]`` (``[content..., EOS]`` when ``bos``
    is negative: a tokenizer without BOS) with no control ID inside; a document taken as
    given (a fine-tuning record as its tokenizer or chat template made it) is any IDs."""
    cdef int64_t i, total = 0, first = 0, last = count
    cdef uint32_t broken = 0
    cdef cell_t token
    if count > max_tokens:
        return BROKEN_RULE
    if not as_given:
        first = bos >= 0
        last = count - 1
        if count < first + 1 or (first and tokens[0] != bos) or tokens[count - 1] != eos:
            return BROKEN_RULE
    for i in range(first, last):
        token = tokens[i]
        # One unsigned comparison rejects negative and out-of-vocabulary IDs alike;
        # BOS and EOS are the only control IDs. Branch-free, so it vectorizes.
        broken |= (<uint32_t>token >= vocabulary_size) | ((not as_given) & ((token == bos) | (token == eos)))
    if broken:
        return BROKEN_RULE
    if (last - first) * longest_piece > max_bytes:  # only then can the byte limit bind
        for i in range(first, last):
            total += piece_lengths[tokens[i]]
        if total > max_bytes:
            return BROKEN_RULE
    if (count < 2) if as_given else (last == first):
        return EMPTY_CONTENT
    return DOCUMENT_OK


def first_bad_document(
    const cell_t[::1] tokens not None,            # all documents, concatenated
    const int64_t[::1] offsets not None,          # [documents + 1], non-decreasing, within tokens
    const int64_t[::1] piece_lengths not None,    # [V] decoded bytes per ID (0 for BOS/EOS), or [0]
    uint32_t vocabulary_size,                     # V
    cell_t bos,                                   # -1: the tokenizer has no BOS
    cell_t eos,
    const uint8_t[::1] as_given not None,         # [documents]: 1 = taken as given, not framed; or [0]: none
    int64_t max_tokens,
    int64_t max_bytes,
    cell_t[::1] copy_into not None,               # [len(tokens)]: valid documents are copied here
    int threads,
):
    """Return ``(document, fault)`` of the first document that is not a valid framed document.

    Each document must be ``[BOS, content..., EOS]`` (``[content..., EOS]`` when ``bos``
    is -1) with content IDs in ``[0, V)`` other than BOS and EOS (the control IDs), or,
    where ``as_given`` says so, any IDs in ``[0, V)``; at most ``max_tokens`` tokens and at
    most ``max_bytes`` decoded content bytes (pass no piece lengths to count no bytes:
    the workspace never depends on ``V``). ``(-1, DOCUMENT_OK)`` when all pass. Every
    document found valid is copied into ``copy_into`` while it is still in cache;
    after a fault, documents other than those before it may or may not have been
    copied. Interruptible: Ctrl-C raises ``KeyboardInterrupt``.
    """
    cdef Py_ssize_t documents = offsets.shape[0] - 1
    cdef Py_ssize_t runs = documents if documents < RUNS else RUNS
    cdef Py_ssize_t run, d, first, end, work
    cdef Py_ssize_t found[RUNS]
    cdef DocumentFault faults[RUNS]
    cdef DocumentFault fault
    cdef int64_t v, longest_piece = 0
    cdef Interrupt interrupt
    cdef Interrupt* state = &interrupt
    if tokens.shape[0] == 0:  # the first document is empty: no frame, no target
        return 0, EMPTY_CONTENT if as_given.shape[0] and as_given[0] else BROKEN_RULE
    cdef const cell_t* source = &tokens[0]
    cdef cell_t* target = &copy_into[0]
    cdef const int64_t* pieces = NULL
    cdef const uint8_t* given = NULL
    if as_given.shape[0]:
        given = &as_given[0]
    if piece_lengths.shape[0]:
        pieces = &piece_lengths[0]
    for v in range(piece_lengths.shape[0]):
        if piece_lengths[v] > longest_piece:
            longest_piece = piece_lengths[v]
    with nogil:
        interrupt_start(state)
        for run in prange(runs, schedule="dynamic", num_threads=threads, use_threads_if=threads > 1):
            found[run] = -1
            faults[run] = DOCUMENT_OK
            # Runs of near-equal tokens: a thread that runs out of runs waits for the others
            # (without looking at signals) at most about one run.
            d = token_run_start(run, runs, offsets)
            end = token_run_start(run + 1, runs, offsets)
            work = CHECK_EVERY
            while d < end:
                if work >= CHECK_EVERY:
                    work = 0
                    if threadid() == 0:
                        interrupted(state)
                    if interrupt_requested(state):
                        break
                work = work + 1 + (offsets[d + 1] - offsets[d]) // TOKENS_PER_UNIT
                first = offsets[d]
                fault = document_fault(source + first, offsets[d + 1] - first, pieces, vocabulary_size,
                                       longest_piece, bos, eos, given != NULL and given[d],
                                       max_tokens, max_bytes)
                if fault != DOCUMENT_OK:
                    found[run] = d
                    faults[run] = fault
                    break
                memcpy(target + first, source + first, (offsets[d + 1] - first) * sizeof(cell_t))
                d = d + 1
    interrupt_finish(&interrupt)
    for run in range(runs):
        if found[run] >= 0:
            return found[run], faults[run]
    return -1, DOCUMENT_OK


cpdef enum RangeFault:
    RANGE_OK = 0
    DOCUMENT_INDEX = 1     # the example's document is not in the table
    NEGATIVE_BOUND = 2     # start or stop below 0
    OUTSIDE_DOCUMENT = 3   # start after stop, or stop past the document's end
    TOO_SHORT = 4          # fewer than 2 tokens: no prediction


def first_bad_range(
    const int64_t[:, ::1] spans not None,         # [n, 2] start and stop inside the document
    const int64_t[::1] documents not None,        # [n] document of each example
    const int64_t[::1] offsets not None,          # [documents + 1], non-decreasing
    int64_t[::1] begins not None,                 # [n] out: offsets[document] + start
    int64_t[::1] ends not None,                   # [n] out: offsets[document] + stop
):
    """Return ``(example, fault)`` of the first range that is not at least 2 tokens of its document.

    Example ``i`` selects tokens ``[spans[i, 0], spans[i, 1])`` of document
    ``documents[i]``; its absolute bounds are written to ``begins`` and ``ends``
    (for the examples before a fault). ``(-1, RANGE_OK)`` when every range is valid.
    """
    cdef Py_ssize_t n = spans.shape[0], i
    cdef int64_t document_count = offsets.shape[0] - 1, document, start, stop
    cdef RangeFault fault = RANGE_OK
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for i in range(n):
            if (i & (CHECK_EVERY - 1)) == 0 and interrupted(&interrupt):
                break
            document = documents[i]
            start = spans[i, 0]
            stop = spans[i, 1]
            if document < 0 or document >= document_count:
                fault = DOCUMENT_INDEX
            elif start < 0 or stop < 0:
                fault = NEGATIVE_BOUND
            elif start > stop or stop > offsets[document + 1] - offsets[document]:
                fault = OUTSIDE_DOCUMENT
            elif stop - start < 2:
                fault = TOO_SHORT
            if fault != RANGE_OK:
                break
            begins[i] = offsets[document] + start
            ends[i] = offsets[document] + stop
    interrupt_finish(&interrupt)
    if fault == RANGE_OK:
        return -1, RANGE_OK
    return i, fault
