"""Bulk document validation for columnar example tables.

``first_bad_document`` scans every document of a flat token array once and
returns the index of the first one that breaks a tokenizer rule; the Python layer
then explains that document's fault with the per-document checker.
"""

from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from _kernel_types cimport cell_t

cpdef enum DocumentFault:
    DOCUMENT_OK = 0
    BROKEN_RULE = 1      # framing, control ID inside content, ID range, or a decode limit
    EMPTY_CONTENT = 2    # framed [BOS, EOS]: valid, but it supplies no example


cdef DocumentFault document_fault(
    const cell_t[::1] tokens, int64_t first, int64_t end, const int64_t[::1] piece_lengths,
    cell_t bos, cell_t eos, int64_t max_tokens, int64_t max_bytes,
) noexcept nogil:
    cdef int64_t count = end - first, i, total = 0, piece
    cdef int64_t vocabulary_size = piece_lengths.shape[0]
    cdef cell_t token
    if count < 2 or count > max_tokens:
        return BROKEN_RULE
    if tokens[first] != bos or tokens[end - 1] != eos:
        return BROKEN_RULE
    for i in range(first + 1, end - 1):
        token = tokens[i]
        # One unsigned comparison rejects negative and out-of-vocabulary IDs alike.
        if <uint32_t>token >= <uint64_t>vocabulary_size:
            return BROKEN_RULE
        piece = piece_lengths[token]
        if piece < 0:  # a control ID inside the content
            return BROKEN_RULE
        total += piece
    if total > max_bytes:
        return BROKEN_RULE
    if count == 2:
        return EMPTY_CONTENT
    return DOCUMENT_OK


def first_bad_document(
    const cell_t[::1] tokens not None,            # all documents, concatenated
    const int64_t[::1] offsets not None,          # [documents + 1], non-decreasing
    const int64_t[::1] piece_lengths not None,    # [V] decoded bytes per ID; -1 marks BOS and EOS
    cell_t bos,
    cell_t eos,
    int64_t max_tokens,
    int64_t max_bytes,
    cell_t[::1] copy_into not None,               # [len(tokens)]: valid documents are copied here
):
    """Return ``(document, fault)`` of the first document that is not a valid framed document.

    Every document found valid is copied into ``copy_into`` while it is still in cache.

    Each document must be ``[BOS, content..., EOS]`` with content IDs in ``[0, V)``
    (``V = len(piece_lengths)``) that are not controls (piece length -1), at most
    ``max_tokens`` tokens and at most ``max_bytes`` decoded content bytes (pass
    zero piece lengths and an unreachable byte limit to check no bytes).
    ``(-1, DOCUMENT_OK)`` when all pass.
    """
    cdef Py_ssize_t d
    cdef DocumentFault fault = DOCUMENT_OK
    cdef Py_ssize_t found = -1
    with nogil:
        for d in range(offsets.shape[0] - 1):
            fault = document_fault(tokens, offsets[d], offsets[d + 1], piece_lengths, bos, eos,
                                   max_tokens, max_bytes)
            if fault != DOCUMENT_OK:
                found = d
                break
            if offsets[d + 1] > offsets[d]:
                memcpy(&copy_into[offsets[d]], &tokens[offsets[d]],
                       (offsets[d + 1] - offsets[d]) * sizeof(cell_t))
    return found, fault
