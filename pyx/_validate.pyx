"""Bulk document validation for columnar example tables.

``first_bad_document`` scans every document of a flat token array once and
returns the index of the first one that breaks a tokenizer rule; the Python layer
then explains that document's fault with the per-document checker.
"""

from libc.stdint cimport int64_t

from _kernel_types cimport cell_t

cpdef enum DocumentFault:
    DOCUMENT_OK = 0
    BROKEN_RULE = 1      # framing, control ID inside content, ID range, or a decode limit
    EMPTY_CONTENT = 2    # framed [BOS, EOS]: valid, but it supplies no example


cdef DocumentFault document_fault(
    const cell_t[::1] tokens, int64_t first, int64_t end, int64_t vocabulary_size,
    cell_t bos, cell_t eos, int64_t max_tokens, const int64_t[::1] piece_lengths,
    int64_t max_bytes,
) noexcept nogil:
    cdef int64_t count = end - first, i, total = 0
    cdef cell_t token
    if count < 2 or count > max_tokens:
        return BROKEN_RULE
    if tokens[first] != bos or tokens[end - 1] != eos:
        return BROKEN_RULE
    for i in range(first + 1, end - 1):
        token = tokens[i]
        if token < 0 or token >= vocabulary_size or token == bos or token == eos:
            return BROKEN_RULE
        if piece_lengths.shape[0] > 0:
            total += piece_lengths[token]
    if piece_lengths.shape[0] > 0 and total > max_bytes:
        return BROKEN_RULE
    if count == 2:
        return EMPTY_CONTENT
    return DOCUMENT_OK


def first_bad_document(
    const cell_t[::1] tokens not None,            # all documents, concatenated
    const int64_t[::1] offsets not None,          # [documents + 1], non-decreasing
    int64_t vocabulary_size,
    cell_t bos,
    cell_t eos,
    int64_t max_tokens,
    const int64_t[::1] piece_lengths not None,    # [V] decoded bytes per ID, or empty: no byte limit
    int64_t max_bytes,
):
    """Return ``(document, fault)`` of the first document that is not a valid framed document.

    Each document must be ``[BOS, content..., EOS]`` with IDs in ``[0, V)``, no BOS or
    EOS inside the content, at most ``max_tokens`` tokens and (with piece lengths)
    at most ``max_bytes`` decoded content bytes. ``(-1, DOCUMENT_OK)`` when all pass.
    """
    cdef Py_ssize_t d
    cdef DocumentFault fault = DOCUMENT_OK
    cdef Py_ssize_t found = -1
    with nogil:
        for d in range(offsets.shape[0] - 1):
            fault = document_fault(tokens, offsets[d], offsets[d + 1], vocabulary_size, bos, eos,
                                   max_tokens, piece_lengths, max_bytes)
            if fault != DOCUMENT_OK:
                found = d
                break
    return found, fault
