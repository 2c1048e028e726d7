"""Row-array kernels shared by padded and packed batches.

``fill_rows`` writes every stored field of a batch from placements (row, start
column, segment) and the placed examples' source tokens, given as
``tokens[begins[i]:ends[i]]`` with their supervision; ``first_row_violation`` and
``first_occurrence_violation`` scan finished arrays for the first broken invariant.
The kernels trust their arguments: ``seqpack.layout`` validates them first.
"""

from libc.stdint cimport int64_t
from libc.string cimport memcpy, memset
from cython.parallel cimport prange, threadid

from _interrupt cimport Interrupt, interrupt_finish, interrupt_requested, interrupt_start, interrupted
from _kernel_types cimport cell_t, flag_t

# Sentinels (mirrored in seqpack.layout.fields); fill_rows writes them as 0xFF bytes.
cdef cell_t PAD = -1
cdef cell_t NO_SEGMENT = -1

# Planes of the stored field arrays (the order of seqpack.layout.fields.CELL_FIELDS and FLAG_FIELDS).
cdef enum:
    INPUT = 0
    TARGET = 1
    POSITION = 2
    SEGMENT = 3
    TOKEN_VALID = 0
    TARGET_VALID = 1
    LOSS_MASK = 2
    FLAG_COUNT = 3

# Violation codes returned by the checking kernels (described in seqpack.layout.batch).
cpdef enum Violation:
    OK = 0
    ROW_LENGTH = 1
    VALID_FLAG = 2
    PAD_VALUE = 3
    SEGMENT_MISSING = 4
    POSITION_STEP = 5
    SEGMENT_START = 6
    OCCURRENCE_BOUNDS = 7
    OCCURRENCE_SEGMENT = 8
    OCCURRENCE_POSITION = 9
    OCCURRENCE_TOKEN = 10
    ROW_COVERAGE = 11
    OCCURRENCE_SUPERVISION = 12


cdef inline void fill_constant(cell_t* cells, cell_t value, Py_ssize_t count) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(count):
        cells[j] = value


cdef inline Py_ssize_t first_of_row(const int64_t[::1] rows, int64_t row) noexcept nogil:
    """The first index ``i`` with ``rows[i] >= row`` in the non-decreasing ``rows``."""
    cdef Py_ssize_t low = 0, high = rows.shape[0], middle
    while low < high:
        middle = (low + high) >> 1
        if rows[middle] < row:
            low = middle + 1
        else:
            high = middle
    return low


def fill_rows(
    const cell_t[::1] tokens not None,          # source tokens of the placed examples
    const flag_t[::1] supervised not None,      # aligned with tokens (0 or 1); empty: all supervised
    const int64_t[::1] begins not None,         # [n] example i owns tokens[begins[i]:ends[i]]
    const int64_t[::1] ends not None,           # [n]
    const int64_t[::1] rows not None,           # [n] batch-local row of example i, non-decreasing
    const int64_t[::1] starts not None,         # [n] first column of example i
    const cell_t[::1] segments not None,        # [n] segment ID of example i
    cell_t[:, :, :] cells not None,             # [4, R, T] inputs, targets, positions, segments
    flag_t[:, :, :] flags not None,             # [3, R, T] token_valid, target_valid, loss_mask
    int64_t[::1] valid_lengths not None,        # [R]
    int threads,                                # rows are split between this many threads
):
    """Write all stored batch fields, row by row: the row's placed examples, then its padding.

    ``cells`` and ``flags`` hold one field per plane; planes and rows may be
    strided, but each row must be contiguous (unit stride in its last axis).

    Example ``i`` with source tokens ``s`` (``len(s) - 1`` predictions) fills row
    ``rows[i]`` from column ``starts[i]``: inputs ``s[:-1]``, targets ``s[1:]``,
    local positions from 0, its segment ID, both existence flags true and
    ``loss_mask`` copied from ``supervised[begins[i] + 1 : ends[i]]`` (true when
    ``supervised`` is empty).
    Placements come sorted by row and each row's placements tile its prefix
    without gaps (every planner's do). Every cell is written exactly once, in
    contiguous runs (copies and fills, not cell by cell), whatever the thread
    count; several threads also spread the first touch of fresh memory.
    Interruptible: Ctrl-C raises ``KeyboardInterrupt``, the fields then undefined.
    """
    cdef Py_ssize_t n = rows.shape[0]
    cdef Py_ssize_t row_count = cells.shape[1]
    cdef Py_ssize_t width = cells.shape[2]
    cdef Py_ssize_t r, i, j, c, first, length, end, rest, field
    cdef bint masked = supervised.shape[0] > 0
    cdef cell_t* position
    cdef Interrupt interrupt
    cdef Interrupt* state = &interrupt
    with nogil:
        interrupt_start(state)
        # Small dynamic chunks keep the calling thread (the one that looks at signals) busy
        # until the last rows, and once it has none it waits for at most one chunk of
        # another thread's rows, so Ctrl-C is seen even when another thread is slowed down.
        for r in prange(row_count, schedule="dynamic", chunksize=16, num_threads=threads,
                        use_threads_if=threads > 1):
            if threadid() == 0:
                interrupted(state)
            if interrupt_requested(state):
                continue
            end = 0
            i = first_of_row(rows, r)
            while i < n and rows[i] == r:
                first = begins[i]
                length = ends[i] - first - 1
                c = starts[i]
                memcpy(&cells[INPUT, r, c], &tokens[first], length * sizeof(cell_t))
                memcpy(&cells[TARGET, r, c], &tokens[first + 1], length * sizeof(cell_t))
                position = &cells[POSITION, r, c]
                for j in range(length):
                    position[j] = <cell_t>j
                fill_constant(&cells[SEGMENT, r, c], segments[i], length)
                memset(&flags[TOKEN_VALID, r, c], 1, length)
                memset(&flags[TARGET_VALID, r, c], 1, length)
                if masked:
                    memcpy(&flags[LOSS_MASK, r, c], &supervised[first + 1], length)
                else:
                    memset(&flags[LOSS_MASK, r, c], 1, length)
                end = c + length
                i = i + 1
            valid_lengths[r] = end
            rest = width - end
            if rest > 0:
                # PAD_CELL and NO_SEGMENT are -1: every byte 0xFF; padding positions are 0.
                memset(&cells[INPUT, r, end], 0xFF, rest * sizeof(cell_t))
                memset(&cells[TARGET, r, end], 0xFF, rest * sizeof(cell_t))
                memset(&cells[POSITION, r, end], 0, rest * sizeof(cell_t))
                memset(&cells[SEGMENT, r, end], 0xFF, rest * sizeof(cell_t))
                for field in range(FLAG_COUNT):
                    memset(&flags[field, r, end], 0, rest)
    interrupt_finish(&interrupt)


cdef inline Violation padding_violation(
    const cell_t[:, ::1] inputs, const cell_t[:, ::1] targets, const cell_t[:, ::1] positions,
    const cell_t[:, ::1] segment_ids, const flag_t[:, ::1] token_valid,
    const flag_t[:, ::1] target_valid, const flag_t[:, ::1] loss_mask,
    const cell_t[:, ::1] segment_starts, Py_ssize_t r, Py_ssize_t c,
) noexcept nogil:
    if token_valid[r, c] or target_valid[r, c] or loss_mask[r, c]:
        return VALID_FLAG
    if (inputs[r, c] != PAD or targets[r, c] != PAD or positions[r, c] != 0
            or segment_ids[r, c] != NO_SEGMENT or segment_starts[r, c] != 0):
        return PAD_VALUE
    return OK


cdef inline Violation valid_violation(
    const cell_t[:, ::1] inputs, const cell_t[:, ::1] targets, const cell_t[:, ::1] positions,
    const cell_t[:, ::1] segment_ids, const flag_t[:, ::1] token_valid,
    const flag_t[:, ::1] target_valid, const flag_t[:, ::1] loss_mask,
    const cell_t[:, ::1] segment_starts, Py_ssize_t r, Py_ssize_t c,
) noexcept nogil:
    if not token_valid[r, c] or not target_valid[r, c]:
        return VALID_FLAG
    if inputs[r, c] == PAD or targets[r, c] == PAD:
        return PAD_VALUE
    if segment_ids[r, c] == NO_SEGMENT:
        return SEGMENT_MISSING
    if c == 0 or segment_ids[r, c] != segment_ids[r, c - 1]:
        # A segment opens here: local position 0, first permitted key is this column.
        if positions[r, c] != 0:
            return POSITION_STEP
        if segment_starts[r, c] != c:
            return SEGMENT_START
    else:
        if positions[r, c] != positions[r, c - 1] + 1:
            return POSITION_STEP
        if segment_starts[r, c] != segment_starts[r, c - 1]:
            return SEGMENT_START
    return OK


def first_row_violation(
    const cell_t[:, ::1] inputs not None,
    const cell_t[:, ::1] targets not None,
    const cell_t[:, ::1] positions not None,
    const cell_t[:, ::1] segment_ids not None,
    const flag_t[:, ::1] token_valid not None,
    const flag_t[:, ::1] target_valid not None,
    const flag_t[:, ::1] loss_mask not None,
    const cell_t[:, ::1] segment_starts not None,
    const int64_t[::1] valid_lengths not None,    # [R]
):
    """Return ``(code, row, column)`` of the first cell breaking a row invariant.

    Valid cells form the prefix ``[0, valid_lengths[r])`` and carry a segment
    whose local positions step by one from 0 and whose cells share the segment's
    first column as their segment start; padding cells carry the padding values
    and all-false fields. ``(OK, -1, -1)`` when every cell passes.
    """
    cdef Py_ssize_t row_count = inputs.shape[0]
    cdef Py_ssize_t width = inputs.shape[1]
    cdef Py_ssize_t r = 0, c = -1
    cdef Violation code = OK
    with nogil:
        while r < row_count and code == OK:
            if valid_lengths[r] < 0 or valid_lengths[r] > width:
                code = ROW_LENGTH
                break
            c = 0
            while c < width:
                if c < valid_lengths[r]:
                    code = valid_violation(inputs, targets, positions, segment_ids, token_valid,
                                           target_valid, loss_mask, segment_starts, r, c)
                else:
                    code = padding_violation(inputs, targets, positions, segment_ids, token_valid,
                                             target_valid, loss_mask, segment_starts, r, c)
                if code != OK:
                    break
                c += 1
            if code == OK:
                r += 1
    if code == OK:
        return OK, -1, -1
    return code, r, (c if code != ROW_LENGTH else -1)


def first_occurrence_violation(
    const cell_t[::1] tokens not None,          # source tokens, as for fill_rows
    const flag_t[::1] supervised not None,      # their supervision, as for fill_rows
    const int64_t[::1] begins not None,         # [n]
    const int64_t[::1] ends not None,           # [n]
    const int64_t[::1] rows not None,           # [n]
    const int64_t[::1] starts not None,         # [n]
    const cell_t[::1] segments not None,        # [n]
    const cell_t[:, ::1] inputs not None,       # [R, T]
    const cell_t[:, ::1] targets not None,      # [R, T]
    const cell_t[:, ::1] positions not None,    # [R, T]
    const cell_t[:, ::1] segment_ids not None,  # [R, T]
    const flag_t[:, ::1] loss_mask not None,    # [R, T]
    const int64_t[::1] valid_lengths not None,  # [R]
    int64_t[::1] covered not None,              # [R] scratch, zeroed by the caller
):
    """Return ``(code, occurrence, column)`` of the first record the arrays contradict.

    Each occurrence must lie inside its row's valid prefix and its cells must
    carry its segment, local positions 0.., exactly its source tokens and their
    supervision as ``loss_mask``; the
    occurrences of a row must cover its valid prefix (``column`` is then -1 and
    ``occurrence`` is the row). Distinct segment IDs per record make overlaps fail.
    """
    cdef Py_ssize_t n = rows.shape[0]
    cdef Py_ssize_t row_count = inputs.shape[0]
    cdef Py_ssize_t index = -1, column = -1
    cdef Violation code
    with nogil:
        code = occurrence_violation(tokens, supervised, begins, ends, rows, starts, segments, inputs, targets,
                                    positions, segment_ids, loss_mask, valid_lengths, covered, &index, &column)
    return code, index, column


cdef Violation occurrence_violation(
    const cell_t[::1] tokens, const flag_t[::1] supervised, const int64_t[::1] begins,
    const int64_t[::1] ends, const int64_t[::1] rows,
    const int64_t[::1] starts, const cell_t[::1] segments, const cell_t[:, ::1] inputs,
    const cell_t[:, ::1] targets, const cell_t[:, ::1] positions,
    const cell_t[:, ::1] segment_ids, const flag_t[:, ::1] loss_mask, const int64_t[::1] valid_lengths,
    int64_t[::1] covered, Py_ssize_t* index, Py_ssize_t* column,
) noexcept nogil:
    cdef Py_ssize_t n = rows.shape[0]
    cdef Py_ssize_t row_count = inputs.shape[0]
    cdef Py_ssize_t i, j, r, c, first, length
    cdef bint masked = supervised.shape[0] > 0
    for i in range(n):
        index[0] = i
        first = begins[i]
        length = ends[i] - first - 1
        r = rows[i]
        c = starts[i]
        if r < 0 or r >= row_count or c < 0 or length < 1 or c + length > valid_lengths[r]:
            return OCCURRENCE_BOUNDS
        covered[r] += length
        for j in range(length):
            column[0] = c + j
            if segment_ids[r, c + j] != segments[i]:
                return OCCURRENCE_SEGMENT
            if positions[r, c + j] != j:
                return OCCURRENCE_POSITION
            if inputs[r, c + j] != tokens[first + j] or targets[r, c + j] != tokens[first + j + 1]:
                return OCCURRENCE_TOKEN
            if (loss_mask[r, c + j] != 0) != (supervised[first + j + 1] != 0 if masked else True):
                return OCCURRENCE_SUPERVISION
    column[0] = -1
    for r in range(row_count):
        index[0] = r
        if covered[r] != valid_lengths[r]:
            return ROW_COVERAGE
    index[0] = -1
    return OK
