"""Placement kernels: the row and start column of every example, from its length alone.

Every placement kernel visits the examples in the order given, fills ``rows[i]`` and
``starts[i]`` for the ``i``-th example visited and returns the number of rows. Rows are
numbered in the order they are opened, a row is opened only when an example is placed in
it, and an example occupies the columns ``[starts[i], starts[i] + lengths[i])`` of its row.
The kernels trust their arguments: every length is in ``[1, capacity]`` and the
workspaces have the documented sizes (``seqpack.packing.placement`` checks all of this first).
Every loop is interruptible: Ctrl-C raises ``KeyboardInterrupt`` within ~20 ms, the
outputs then undefined.
"""

from libc.stdint cimport int64_t, uint8_t

from _interrupt cimport Interrupt, interrupt_finish, interrupt_start, interrupted

# Placement loops look for pending signals once per this many examples: few enough that a
# scatter pass whose every write first touches a fresh page still looks within milliseconds.
cdef enum:
    CHECK_EVERY = 1 << 12


def next_fit(
    const int64_t[::1] lengths not None,
    int64_t capacity,
    int64_t[::1] rows not None,
    int64_t[::1] starts not None,
    int64_t open_used=-1,
):
    """Place examples in input order into the current row; open a new row when one does not fit.

    Earlier rows are never revisited, and an exact fill opens no empty row (the next
    row is opened by the next example). ``open_used >= 0`` continues a row already
    open with that many cells used (it is row 0); by default no row is open. Returns
    ``(rows touched, cells used in the last row)``; zero examples and no open row give
    ``(0, capacity)``.
    """
    cdef Py_ssize_t i
    cdef int64_t row = -1 if open_used < 0 else 0
    cdef int64_t used = capacity if open_used < 0 else open_used
    cdef int64_t length
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for i in range(lengths.shape[0]):
            if (i & (CHECK_EVERY - 1)) == 0 and interrupted(&interrupt):
                break
            length = lengths[i]
            if length > capacity - used:
                row += 1
                used = 0
            rows[i] = row
            starts[i] = used
            used += length
    interrupt_finish(&interrupt)
    return row + 1, used


cdef bint _first_touch(int64_t[::1] out, Interrupt *state) noexcept nogil:
    """Write ``out`` once in order before a scatter fills it, looking for signals as it goes.

    A scatter's first writes land on fresh pages all over its output, and each first touch
    of a page (a 2 MiB one under transparent huge pages) is a fault that can take
    milliseconds: 4,096 scattered writes took 0.45 s between two looks. In order, a look
    comes between any two faults. True when interrupted.
    """
    cdef Py_ssize_t i
    for i in range(out.shape[0]):
        if (i & (CHECK_EVERY - 1)) == 0 and interrupted(state):
            return True
        out[i] = 0
    return False


def order_longest_first(
    const int64_t[::1] lengths not None,
    int64_t capacity,
    int64_t[::1] counts not None,
    int64_t[::1] order not None,
    int64_t[::1] sorted_lengths not None,
):
    """Counting sort: ``order`` lists the example indices longest first, equal lengths in input order.

    ``sorted_lengths[k]`` is ``lengths[order[k]]``; ``counts`` is a ``capacity + 1`` cell
    workspace, indexed by ``capacity - length`` so that longer examples come first.
    """
    cdef Py_ssize_t i, key
    cdef int64_t total = 0, count
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        counts[:] = 0
        if not (_first_touch(order, &interrupt) or _first_touch(sorted_lengths, &interrupt)):
            for i in range(lengths.shape[0]):
                if (i & (CHECK_EVERY - 1)) == 0 and interrupted(&interrupt):
                    break
                counts[capacity - lengths[i]] += 1
        if not interrupt.stop:
            for key in range(counts.shape[0]):
                count = counts[key]
                counts[key] = total
                total += count
            for i in range(lengths.shape[0]):
                if (i & (CHECK_EVERY - 1)) == 0 and interrupted(&interrupt):
                    break
                key = capacity - lengths[i]
                order[counts[key]] = i
                sorted_lengths[counts[key]] = lengths[i]
                counts[key] += 1
    interrupt_finish(&interrupt)


cdef inline int64_t _key(const int64_t[::1] keys, int64_t index, int64_t flip_from) noexcept nogil:
    """The sort key of ``index``: its key, or ``flip_from`` less it when ``flip_from >= 0``."""
    return keys[index] if flip_from < 0 else flip_from - keys[index]


cdef bint _stable_pass(const int64_t[::1] keys, int64_t flip_from, int shift, const int64_t *source,
                       int64_t *target, int64_t[::1] counts, Interrupt *state) noexcept nogil:
    """One stable counting pass by the 16-bit digit of the sort keys at ``shift``:
    ``target`` lists ``source``'s indices (every index in order when NULL) by that digit.
    True when interrupted."""
    cdef Py_ssize_t k
    cdef int64_t index, digit, total = 0, count
    counts[:] = 0
    for k in range(keys.shape[0]):
        if (k & (CHECK_EVERY - 1)) == 0 and interrupted(state):
            return True
        index = k if source == NULL else source[k]
        counts[(_key(keys, index, flip_from) >> shift) & 0xFFFF] += 1
    for digit in range(1 << 16):
        count = counts[digit]
        counts[digit] = total
        total += count
    for k in range(keys.shape[0]):
        if (k & (CHECK_EVERY - 1)) == 0 and interrupted(state):
            return True
        index = k if source == NULL else source[k]
        digit = (_key(keys, index, flip_from) >> shift) & 0xFFFF
        target[counts[digit]] = index
        counts[digit] += 1
    return False


def stable_order(
    const int64_t[::1] keys not None,
    int64_t flip_from,
    int passes,
    int64_t[::1] counts not None,
    int64_t[::1] scratch not None,
    int64_t[::1] order not None,
):
    """``order`` lists the indices of ``keys`` by sort key, equal keys in index order: a
    radix sort of ``passes`` stable counting passes over 16-bit digits, lowest first.

    The sort key is the key itself when ``flip_from`` is negative, else ``flip_from -
    key`` (largest keys first, without a flipped copy); each sort key is in ``[0, 2 **
    (16 * passes))``. ``counts`` is a ``2**16`` cell workspace and ``scratch`` one of
    ``len(keys)`` cells."""
    cdef Py_ssize_t n = keys.shape[0]
    cdef int p
    cdef int64_t *source = NULL
    cdef int64_t *target
    cdef Interrupt interrupt
    if n == 0:
        return
    with nogil:
        interrupt_start(&interrupt)
        if _first_touch(order, &interrupt) or (passes > 1 and _first_touch(scratch, &interrupt)):
            passes = 0
        for p in range(passes):  # the last pass writes ``order``
            target = &order[0] if (passes - 1 - p) % 2 == 0 else &scratch[0]
            if _stable_pass(keys, flip_from, 16 * p, source, target, counts, &interrupt):
                break
            source = target
    interrupt_finish(&interrupt)


cdef inline void _set_room(int64_t[::1] room_tree, Py_ssize_t leaf_count, Py_ssize_t row,
                           int64_t room) noexcept nogil:
    """Store a row's remaining room in its leaf and refresh the maxima above it.

    The climb stops at the first unchanged maximum: nothing above it depends on the leaf.
    """
    cdef Py_ssize_t node = leaf_count + row
    cdef int64_t best
    room_tree[node] = room
    node >>= 1
    while node >= 1:
        best = max(room_tree[2 * node], room_tree[2 * node + 1])
        if room_tree[node] == best:
            return
        room_tree[node] = best
        node >>= 1


cdef inline Py_ssize_t _first_row_with_room(const int64_t[::1] room_tree, Py_ssize_t leaf_count,
                                            int64_t length) noexcept nogil:
    """The lowest row whose remaining room is at least ``length`` (the root must allow it)."""
    cdef Py_ssize_t node = 1
    while node < leaf_count:
        node = 2 * node if room_tree[2 * node] >= length else 2 * node + 1
    return node - leaf_count


def first_fit(
    const int64_t[::1] lengths not None,
    int64_t capacity,
    int64_t[::1] rows not None,
    int64_t[::1] starts not None,
    int64_t[::1] room_tree not None,
):
    """First fit, examples visited in the given order: each goes to the lowest-numbered row with room.

    An example that fits no open row opens a new one, so within a row examples take
    increasing start columns in visiting order. (First-fit-decreasing passes lengths
    sorted longest first.)

    ``room_tree`` is a max-tree over rows: ``2 * leaf_count`` cells, ``leaf_count`` a power
    of two at least the number of rows an any-fit policy can open. Unopened rows hold
    ``capacity``, so the lowest row with room is either an open row or the next new one.
    """
    cdef Py_ssize_t leaf_count = room_tree.shape[0] // 2
    cdef Py_ssize_t i, row
    cdef int64_t row_count = 0
    cdef int64_t room
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        room_tree[:] = capacity
        for i in range(lengths.shape[0]):
            if (i & (CHECK_EVERY - 1)) == 0 and interrupted(&interrupt):
                break
            row = _first_row_with_room(room_tree, leaf_count, lengths[i])
            room = room_tree[leaf_count + row]
            rows[i] = row
            starts[i] = capacity - room
            _set_room(room_tree, leaf_count, row, room - lengths[i])
            if row == row_count:
                row_count += 1
    interrupt_finish(&interrupt)
    return row_count


# Columns of the per-row heap workspace.
cdef enum:
    LEFT = 0
    RIGHT = 1
    RANK = 2


cdef int64_t _merge(int64_t a, int64_t b, int64_t[:, ::1] heap) noexcept nogil:
    """Merge two leftist min-heaps of row numbers (a row is its own key); -1 is empty.

    The right spine of a leftist heap has O(log size) nodes, so the recursion is shallow.
    """
    cdef int64_t child
    if a < 0:
        return b
    if b < 0:
        return a
    if b < a:
        a, b = b, a
    heap[a, RIGHT] = _merge(heap[a, RIGHT], b, heap)
    if heap[a, LEFT] < 0 or heap[heap[a, LEFT], RANK] < heap[heap[a, RIGHT], RANK]:
        child = heap[a, LEFT]
        heap[a, LEFT] = heap[a, RIGHT]
        heap[a, RIGHT] = child
    heap[a, RANK] = 0 if heap[a, RIGHT] < 0 else heap[heap[a, RIGHT], RANK] + 1
    return a


cdef inline void _mark_bucket(uint8_t[::1] fit_tree, Py_ssize_t leaf_count, Py_ssize_t room,
                              uint8_t occupied) noexcept nogil:
    """Record whether the bucket of rows with ``room`` remaining cells is occupied."""
    cdef Py_ssize_t node = leaf_count + room
    fit_tree[node] = occupied
    node >>= 1
    while node >= 1:
        fit_tree[node] = fit_tree[2 * node] | fit_tree[2 * node + 1]
        node >>= 1


cdef inline Py_ssize_t _least_room_at_least(const uint8_t[::1] fit_tree, Py_ssize_t leaf_count,
                                            int64_t length) noexcept nogil:
    """The smallest occupied room value ``>= length``, or -1 when there is none."""
    cdef Py_ssize_t node = leaf_count + length
    if fit_tree[node]:
        return length
    # Climb until a right sibling holds an occupied bucket, then descend to its leftmost one.
    while node > 1:
        if node % 2 == 0 and fit_tree[node + 1]:
            node += 1
            while node < leaf_count:
                node = 2 * node if fit_tree[2 * node] else 2 * node + 1
            return node - leaf_count
        node >>= 1
    return -1


cdef inline void _file_row(int64_t row, int64_t room, int64_t[::1] bucket_root,
                           uint8_t[::1] fit_tree, Py_ssize_t leaf_count,
                           int64_t[:, ::1] heap) noexcept nogil:
    """Put a row with ``room`` remaining cells into its bucket; full rows are dropped."""
    if room == 0:
        return
    heap[row, LEFT] = -1
    heap[row, RIGHT] = -1
    heap[row, RANK] = 0
    if bucket_root[room] < 0:
        _mark_bucket(fit_tree, leaf_count, room, 1)
    bucket_root[room] = _merge(bucket_root[room], row, heap)


def best_fit(
    const int64_t[::1] lengths not None,
    int64_t capacity,
    int64_t[::1] rows not None,
    int64_t[::1] starts not None,
    int64_t[::1] bucket_root not None,
    uint8_t[::1] fit_tree not None,
    int64_t[:, ::1] heap not None,
):
    """Best fit, examples visited in the given order: each goes to the open row with the least fitting room.

    Among rows with the same least sufficient room the lowest-numbered row wins; an
    example that fits no open row opens a new one. Within a row examples take increasing
    start columns in visiting order. (Best-fit-decreasing passes lengths sorted longest
    first.)

    Open rows that are not full sit in buckets by remaining room (``bucket_root``:
    ``capacity`` cells, each the root of a leftist min-heap of row numbers; ``heap`` has one
    row of left child, right child and rank per possible row). ``fit_tree`` is an OR-tree
    over the buckets: ``2 * leaf_count`` cells, ``leaf_count`` a power of two greater than
    ``capacity``, so the least sufficient room is found in O(log capacity).
    """
    cdef Py_ssize_t leaf_count = fit_tree.shape[0] // 2
    cdef Py_ssize_t i
    cdef int64_t row_count = 0
    cdef int64_t row, room, length
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        bucket_root[:] = -1
        fit_tree[:] = 0
        for i in range(lengths.shape[0]):
            if (i & (CHECK_EVERY - 1)) == 0 and interrupted(&interrupt):
                break
            length = lengths[i]
            room = _least_room_at_least(fit_tree, leaf_count, length)
            if room < 0:
                row = row_count
                row_count += 1
                room = capacity
            else:
                row = bucket_root[room]
                bucket_root[room] = _merge(heap[row, LEFT], heap[row, RIGHT], heap)
                if bucket_root[room] < 0:
                    _mark_bucket(fit_tree, leaf_count, room, 0)
            rows[i] = row
            starts[i] = capacity - room
            _file_row(row, room - length, bucket_root, fit_tree, leaf_count, heap)
    interrupt_finish(&interrupt)
    return row_count
