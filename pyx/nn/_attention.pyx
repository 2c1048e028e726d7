"""Fused range attention: forward and backward over permitted edges only.

A work item is one (row, key/value head, segment) with every query head of that key/value
head's group (grouped-query attention; multi-head attention is a group of one): K and V
of the segment are transposed once for all the group's query heads, and dK and dV sum
over the group's heads in order. Inside a segment the queries and keys are cut into
tiles aligned at the segment start; a query tile meets the keys at or before it, and
only its diagonal part needs the causal mask (the products skip their 6-row blocks that
lie above the diagonal). No score outside the segment is ever computed and nothing of
size T*T is allocated. The
scores of a query tile against all its keys form one panel (tile x segment length), so
the forward's softmax is exact in one max, exp and sum pass per query, with no
rescaling; it saves the per-query log-sum-exp, and the backward recomputes the
probabilities from it and ``D = rowsum(dout * out)``.

Tile products are seqpack's own register-blocked kernels (``_tile_products.pxd``): K and
V are transposed once per segment so that the score products read rows of them, stored
strip by strip (16 keys of every row together, 8 in float64) so that a product walks one
memory page per strip rather than one per row; the backward's products with transposed
probabilities and dS read the panels through their strides (no transpose pass). One
product covers a query tile's whole panel, and its causal shape skips the blocks above
the diagonal. Arrays are strided with a contiguous last axis: the cell stride of a
[T, d] block is the row stride of a product, so a ``[B, H, T, D]`` view of ``[B, T, H,
D]`` storage is read or written in place. Each work item writes only its own segment's
output rows and sums in a fixed order, so results are bitwise identical for any thread
count and CPU path. The exponentials use a vectorizable polynomial exp (below); the rest
of the per-edge work is a few vector passes over each panel row.

Paths. The exponential and the tile products are compiled for AVX-512, AVX2 and baseline
x86-64 and chosen at load time by ``__builtin_cpu_supports`` (no ``ifunc``, so musl builds too; no
``-march=native``, no ``-ffast-math``). The kernels are built with ``-ffp-contract=off``:
the only fused multiply-adds are the explicit ones, which every path rounds alike, so
every path gives the same bits (``tests/nn/test_cpu_dispatch.py`` forces each). On AVX2 and
AVX-512 the exponential is written with intrinsics, its clamps MAXPS and MINPS (the compiler
made nine compares and blends of the C expressions). On an x86-64 CPU without FMA each fused multiply-add is a
call to libm's exact ``fma``: the tile products then run about a hundred times slower.

Numerics. Inactive queries give exactly zero output, log-sum-exp and gradients. An
infinite or NaN value in a valid cell reaches only the results that read it: queries
before a poisoned key or value keep their exact output, log-sum-exp and dQ (each row of a
product skips the zeros that stand for keys it may not see, where ``0 * inf`` would be
NaN). A NaN lands in the same places on every path; its sign and payload may differ. The
backward recomputes probabilities as ``exp(score - lse)``, whose rounding is about
``|lse| * 2**-24`` in float32: past scores of about a thousand (ten million in float64)
that rounding sets the gradients' relative error, as in torch's SDPA, which saves the
same quantity. ``head_dim`` is at most 4096; query tiles shrink from 64 queries (up to
head_dim 64) to 8 (at 4096) so that a tile's operands stay in cache.
"""

cimport cython
from cython.parallel cimport parallel, threadid
from libc.math cimport exp, expf, log, logf, sqrt
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from _interrupt cimport (
    INTERRUPTED,
    Interrupt,
    interrupt_finish,
    interrupt_requested,
    interrupt_start,
    interrupted,
    seqpack_monotonic_seconds,
    seqpack_pause,
)
from _kernel_types cimport real
from _tile_products cimport (
    SEQPACK_FULL,
    SEQPACK_LOWER_A,
    SEQPACK_LOWER_OUTPUT,
    SEQPACK_UPPER_A,
    seqpack_product,
    seqpack_product_d,
    seqpack_product_f,
    seqpack_products_path,
    seqpack_products_use_path,
)

cdef extern from "_openmp.h":
    ctypedef struct seqpack_fpmode:
        pass
    int seqpack_omp_team_size() noexcept nogil
    Py_ssize_t seqpack_fetch_add(Py_ssize_t *counter, Py_ssize_t value) noexcept nogil
    seqpack_fpmode seqpack_get_fpmode() noexcept nogil
    void seqpack_set_fpmode(seqpack_fpmode mode) noexcept nogil

cdef extern from "_attention.h":
    void seqpack_exp_shift_f(float *row, Py_ssize_t n, float shift, float *ds,
                             float di) noexcept nogil
    void seqpack_exp_shift_d(double *row, Py_ssize_t n, double shift,
                             double *ds, double di) noexcept nogil
    void seqpack_transpose_f(const float *src, Py_ssize_t rows, Py_ssize_t cols,
                             Py_ssize_t lds, float *dst, Py_ssize_t ldd) noexcept nogil
    void seqpack_transpose_d(const double *src, Py_ssize_t rows, Py_ssize_t cols,
                             Py_ssize_t lds, double *dst, Py_ssize_t ldd) noexcept nogil
    int seqpack_exp_path_supported(int path) noexcept nogil
    int seqpack_exp_use_path(int path) noexcept nogil
    void seqpack_helper_paths(int *out) noexcept nogil
    float seqpack_sum_f(const float *x, Py_ssize_t n) noexcept nogil
    double seqpack_sum_d(const double *x, Py_ssize_t n) noexcept nogil
    float seqpack_dot_f(const float *x, const float *y, Py_ssize_t n) noexcept nogil
    double seqpack_dot_d(const double *x, const double *y, Py_ssize_t n) noexcept nogil
    float seqpack_max_f(const float *x, Py_ssize_t n) noexcept nogil
    double seqpack_max_d(const double *x, Py_ssize_t n) noexcept nogil


cdef enum:
    # Query tile: 64 queries, fewer for head_dim > 64 (see ``tile_edge``).
    MAX_TILE = 64
    # A query tile's products against one 64-key block stay within this many multiply-adds,
    # so that the tile's queries and the block's keys stay in the core's caches.
    TILE_WORK = 262144
    # Each thread gets at least this many multiply-adds (a few tenths of a millisecond):
    # below it a parallel region gains little, and on a busy machine one descheduled
    # thread stalls the whole region. The thread count never changes the results.
    WORK_PER_THREAD = 4194304

# Status codes of ``plan_layout``, ``forward`` and ``backward`` (exported to Python:
# seqpack.nn.attention turns each into its error).
cpdef enum Status:
    LAYOUT_OK = 0
    BAD_LENGTH = 1        # valid_lengths[row] outside [0, T]
    BAD_START = 2         # segment_starts[row, column] outside [0, column]
    BROKEN_SEGMENT = 3    # neither a new segment at column nor the previous one's start
    OUT_OF_MEMORY = 4


#: The largest head_dim whose smallest query tile (8 queries) keeps within ``TILE_WORK``.
MAX_HEAD_DIM = TILE_WORK // 64

#: The CPU paths by number: the exp loops and the tile products compiled for baseline x86-64,
#: AVX2 or AVX-512, and the K/V transposes and row sums, dots and maxima portable (baseline)
#: or AVX2 (the others). Every path gives the same bits (NaN in the same places, its payload
#: aside); the best one this CPU runs is chosen at import.
CPU_PATHS = ("baseline", "avx2", "avx512")


def cpu_paths():
    """The CPU paths this CPU can run, by name (baseline always)."""
    return [name for path, name in enumerate(CPU_PATHS) if seqpack_exp_path_supported(path)]


def use_cpu_path(int path):
    """Switch every later call to CPU path ``path`` (-1: the best); return the path now in
    use, or -1 (nothing changed) when this CPU cannot run it. For tests and benchmarks."""
    chosen = seqpack_exp_use_path(path)
    if chosen >= 0:
        seqpack_products_use_path(chosen)
    return chosen


def paths_in_use():
    """The CPU path each group of kernel code now runs, by name: ``exp``, ``products``,
    ``transposes`` (K and V) and ``reductions`` (row sums, dots and maxima); None for a
    group whose float and double code disagree. For tests: the bits alone cannot show a
    vector path that runs the portable code."""
    cdef int helpers[3]
    seqpack_helper_paths(helpers)
    names = {-1: None, **dict(enumerate(CPU_PATHS))}
    return {"exp": names[helpers[0]], "products": names[seqpack_products_path()],
            "transposes": names[helpers[1]], "reductions": names[helpers[2]]}


use_cpu_path(-1)


cdef struct Span:
    # One segment of a layout: three Py_ssize_t, so that ``plan_layout`` copies the spans
    # as the rows of a [segments, 3] intp array.
    Py_ssize_t row
    Py_ssize_t start
    Py_ssize_t end          # exclusive


cdef struct Plan:
    Span *spans             # [segments], in row order
    Py_ssize_t *order       # [segments]: span indices, longest first, ties in row order
    Py_ssize_t segments
    Py_ssize_t longest      # longest segment length
    Py_ssize_t edges        # permitted (query, key) pairs of one head
    Py_ssize_t bad_row
    Py_ssize_t bad_column


cdef Py_ssize_t tile_edge(Py_ssize_t head_dim) noexcept nogil:
    """64 queries, halved until tile * tile * head_dim is at most ``TILE_WORK``."""
    cdef Py_ssize_t tile = MAX_TILE
    while tile > 8 and tile * tile * head_dim > TILE_WORK:
        tile //= 2
    return tile


cdef int find_segments(const Py_ssize_t[::1] valid_lengths,
                       const Py_ssize_t[:, ::1] segment_starts, Plan *plan) noexcept nogil:
    """Check the layout cell by cell and list its segments in row order."""
    cdef Py_ssize_t rows = segment_starts.shape[0], width = segment_starts.shape[1]
    cdef Py_ssize_t r, t, s, n = 0
    cdef Span *spans = plan.spans
    for r in range(rows):
        if valid_lengths[r] < 0 or valid_lengths[r] > width:
            plan.bad_row = r
            return BAD_LENGTH
    for r in range(rows):
        for t in range(valid_lengths[r]):
            s = segment_starts[r, t]
            if s < 0 or s > t or (s != t and s != segment_starts[r, t - 1]):
                plan.bad_row = r
                plan.bad_column = t
                return BAD_START if s < 0 or s > t else BROKEN_SEGMENT
            if s == t:
                if n > 0 and spans[n - 1].row == r:
                    spans[n - 1].end = t
                spans[n].row = r
                spans[n].start = t
                n += 1
        if n > 0 and spans[n - 1].row == r:
            spans[n - 1].end = valid_lengths[r]
    plan.segments = n
    return LAYOUT_OK


cdef void order_longest_first(Plan *plan, Py_ssize_t width, Py_ssize_t *counts) noexcept nogil:
    """Counting sort of the spans by length (stable); also the longest length and edges."""
    cdef Py_ssize_t k, length, cursor = 0, count
    memset(counts, 0, (width + 1) * sizeof(Py_ssize_t))
    plan.longest = 0
    plan.edges = 0
    for k in range(plan.segments):
        length = plan.spans[k].end - plan.spans[k].start
        counts[length] += 1
        plan.edges += length * (length + 1) // 2
        if length > plan.longest:
            plan.longest = length
    for length in range(width, -1, -1):
        count = counts[length]
        counts[length] = cursor
        cursor += count
    for k in range(plan.segments):
        length = plan.spans[k].end - plan.spans[k].start
        plan.order[counts[length]] = k
        counts[length] += 1


cdef void free_plan(Plan *plan) noexcept nogil:
    free(plan.spans)
    free(plan.order)
    plan.spans = NULL
    plan.order = NULL


cdef int make_plan(const Py_ssize_t[::1] valid_lengths, const Py_ssize_t[:, ::1] segment_starts,
                   Plan *plan) noexcept nogil:
    """Validate a layout and build its work plan; the caller frees it with ``free_plan``."""
    cdef Py_ssize_t width = segment_starts.shape[1]
    cdef Py_ssize_t cells = segment_starts.shape[0] * width + 1
    cdef Py_ssize_t *counts
    cdef int status
    plan.segments = 0
    plan.bad_row = 0
    plan.bad_column = 0
    plan.spans = <Span *>malloc(cells * sizeof(Span))
    plan.order = <Py_ssize_t *>malloc(cells * sizeof(Py_ssize_t))
    counts = <Py_ssize_t *>malloc((width + 1) * sizeof(Py_ssize_t))
    if plan.spans == NULL or plan.order == NULL or counts == NULL:
        status = OUT_OF_MEMORY
    else:
        status = find_segments(valid_lengths, segment_starts, plan)
        if status == LAYOUT_OK:
            order_longest_first(plan, width, counts)
    free(counts)
    if status != LAYOUT_OK:
        free_plan(plan)
    return status


def plan_layout(const Py_ssize_t[::1] valid_lengths not None,
                const Py_ssize_t[:, ::1] segment_starts not None,
                Py_ssize_t[:, ::1] spans not None):
    """Check a layout and copy its segments into ``spans`` ([rows * T, 3], row order).

    Returns ``(status, row, column, segments)``: ``LAYOUT_OK`` and the segment count, or
    another ``Status`` with the first offending row and column.
    """
    cdef Plan plan
    cdef int status
    with nogil:
        status = make_plan(valid_lengths, segment_starts, &plan)
        if status == LAYOUT_OK:
            if plan.segments > 0:
                memcpy(&spans[0, 0], plan.spans, plan.segments * sizeof(Span))
            free_plan(&plan)
    return status, plan.bad_row, plan.bad_column, plan.segments


cdef inline Py_ssize_t by_strips(Py_ssize_t rows) noexcept nogil:
    """The ``ldb`` that tells ``product`` its B is stored strip by strip, ``rows`` rows
    per strip (see ``store_by_strips``)."""
    return -rows


cdef struct Clock:
    # One thread's profile of one work item: the bucket being charged since ``last``, and
    # the bucket of the phase's work outside tile products.
    double last
    int bucket
    int other
    double *seconds         # [BUCKETS]: this thread's totals


cdef inline void charge(Clock *clock, int bucket) noexcept nogil:
    """Add the time since the last charge to the current bucket; then charge ``bucket``.

    Free when profiling is off (``clock`` is NULL).
    """
    cdef double now
    if clock != NULL:
        now = seqpack_monotonic_seconds()
        clock.seconds[clock.bucket] += now - clock.last
        clock.last = now
        clock.bucket = bucket


cdef inline void product(Clock *clock, int bucket, Py_ssize_t m, Py_ssize_t n, Py_ssize_t k, real alpha,
                         const real *a, Py_ssize_t a_row, Py_ssize_t a_inner, const real *b,
                         Py_ssize_t ldb, real *c, Py_ssize_t ldc, bint accumulate, int shape,
                         Py_ssize_t diagonal) noexcept nogil:
    """``c[m, n] (+)= alpha * a[m, k] @ b[k, n]`` with ``a[i, p]`` at ``a[i * a_row + p *
    a_inner]`` and ``b`` row-major with row stride ``ldb``, or stored strip by strip when
    ``ldb`` is ``by_strips(rows)``; ``shape`` and ``diagonal`` as in ``_tile_products.pxd``.
    With profiling on (``clock`` not NULL) its time goes to ``bucket`` and the time since
    the last product to the phase's other work."""
    cdef seqpack_product g
    cdef Py_ssize_t strip = strip_width(b)
    g.m, g.n, g.k = m, n, k
    g.a, g.a_row, g.a_inner = a, a_row, a_inner
    g.b, g.c, g.ldc = b, c, ldc
    g.ldb, g.b_strip = (strip, -ldb * strip) if ldb < 0 else (ldb, strip)
    g.alpha, g.accumulate, g.shape, g.diagonal = alpha, accumulate, shape, diagonal
    charge(clock, bucket)
    if real is float:
        seqpack_product_f(&g)
    else:
        seqpack_product_d(&g)
    if clock != NULL:
        charge(clock, clock.other)


cdef inline void exp_shift(real *row, Py_ssize_t n, real shift) noexcept nogil:
    """``row[j] = exp(row[j] - shift)``."""
    if real is float:
        seqpack_exp_shift_f(row, n, shift, NULL, 0)
    else:
        seqpack_exp_shift_d(row, n, shift, NULL, 0)


cdef inline void exp_ds(real *p, Py_ssize_t n, real shift, real *ds, real di) noexcept nogil:
    """Probabilities ``p[j] = exp(p[j] - shift)`` and ``ds[j] = p[j] * (ds[j] - di)``."""
    if real is float:
        seqpack_exp_shift_f(p, n, shift, ds, di)
    else:
        seqpack_exp_shift_d(p, n, shift, ds, di)


cdef inline real row_sum(const real *x, Py_ssize_t n) noexcept nogil:
    if real is float:
        return seqpack_sum_f(x, n)
    else:
        return seqpack_sum_d(x, n)


cdef inline real row_dot(const real *x, const real *y, Py_ssize_t n) noexcept nogil:
    if real is float:
        return seqpack_dot_f(x, y, n)
    else:
        return seqpack_dot_d(x, y, n)


cdef inline real row_max(const real *x, Py_ssize_t n) noexcept nogil:
    if real is float:
        return seqpack_max_f(x, n)
    else:
        return seqpack_max_d(x, n)


cdef inline real scalar_exp(real x) noexcept nogil:
    if real is float:
        return expf(x)
    else:
        return exp(x)


cdef inline real scalar_log(real x) noexcept nogil:
    if real is float:
        return logf(x)
    else:
        return log(x)


cdef inline Py_ssize_t padded(Py_ssize_t length) noexcept nogil:
    """Row stride of a panel: ``length`` rounded up to an odd number of 16 elements, so
    that the rows a product walks down do not share cache sets (a power-of-two stride
    would keep only a few of them in L1). Also room enough for one row of ``length``
    elements stored strip by strip."""
    cdef Py_ssize_t lines = (length + 15) // 16
    return (lines + 1 - lines % 2) * 16


cdef inline void transpose(const real *src, Py_ssize_t rows, Py_ssize_t cols,
                           Py_ssize_t lds, real *dst, Py_ssize_t ldd) noexcept nogil:
    """``dst[j, i] = src[i, j]`` for a row-major ``src[rows, cols]``."""
    if real is float:
        seqpack_transpose_f(src, rows, cols, lds, dst, ldd)
    else:
        seqpack_transpose_d(src, rows, cols, lds, dst, ldd)


cdef inline Py_ssize_t strip_width(const real *unused) noexcept nogil:
    """Columns per strip of the tile products' B: 16 floats or 8 doubles (two AVX2 vectors,
    one AVX-512 vector)."""
    if real is float:
        return 16
    else:
        return 8


cdef inline void transpose_by_strips(const real *src, Py_ssize_t rows, Py_ssize_t cols,
                                     Py_ssize_t lds, real *dst) noexcept nogil:
    """The transpose of a row-major ``src[rows, cols]`` stored strip by strip (``cols`` rows
    per strip): each ``strip_width`` columns of the transpose (rows ``i0..`` of ``src``)
    form one contiguous ``[cols, strip]`` block at ``dst + i0 * cols``, so a product walks
    down one memory page per strip instead of one page per row."""
    cdef Py_ssize_t strip = strip_width(src), i0 = 0
    while i0 < rows:
        transpose(src + i0 * lds, min(strip, rows - i0), cols, lds, dst + i0 * cols, strip)
        i0 += strip


cdef inline void store_by_strips(const real *src, Py_ssize_t rows, Py_ssize_t cols,
                                 Py_ssize_t lds, real *dst) noexcept nogil:
    """A row-major ``src[rows, cols]`` (row stride ``lds``) stored strip by strip (``rows``
    rows per strip): columns ``j0..j0 + strip_width`` form one contiguous ``[rows,
    strip]`` block at ``dst + j0 * rows``. Pure data movement: the bits are the source's."""
    cdef Py_ssize_t strip = strip_width(src), j0 = 0, i, width
    while j0 < cols:
        width = min(strip, cols - j0)
        if width == strip:   # a constant size: the copy is inlined, not a call per row
            for i in range(rows):
                memcpy(dst + j0 * rows + i * strip, src + i * lds + j0, strip * sizeof(real))
        else:
            for i in range(rows):
                memcpy(dst + j0 * rows + i * strip, src + i * lds + j0, width * sizeof(real))
        j0 += strip


cdef enum:
    # Profile buckets: time in tile products or in everything else, per phase; the
    # setup (planning, zeroing the padding, scratch) is timed on the calling thread.
    FORWARD_GEMM = 0
    FORWARD_OTHER = 1
    DS_GEMM = 2             # backward: recomputed scores and dP
    DS_OTHER = 3            # backward: K and V transposed, D, probabilities and dS
    DQ_GEMM = 4
    DQ_OTHER = 5            # (dQ, dK and dV have no work outside their tile products:
    DK_GEMM = 6             # the products read the probability and dS panels transposed)
    DK_OTHER = 7
    DV_GEMM = 8
    DV_OTHER = 9
    FORWARD_SETUP = 10
    BACKWARD_SETUP = 11
    BUCKETS = 12

#: Bucket names, in bucket order.
PROFILE_BUCKETS = ("forward_gemm", "forward_other", "dS_gemm", "dS_other", "dQ_gemm",
                   "dQ_other", "dK_gemm", "dK_other", "dV_gemm", "dV_other", "forward_setup",
                   "backward_setup")

# Off by default; read once per call, which then passes a NULL clock to every work item.
cdef bint profiling = False
cdef double profile_seconds[BUCKETS]


def profile_start():
    """Zero the profile and time every later call (for tests and benchmarks)."""
    global profiling
    memset(profile_seconds, 0, sizeof(profile_seconds))
    profiling = True


def profile_stop():
    """Stop timing; return the thread-seconds per bucket since ``profile_start``."""
    global profiling
    profiling = False
    return {name: profile_seconds[b] for b, name in enumerate(PROFILE_BUCKETS)}


def profile_on():
    """Whether calls are being timed (between ``profile_start`` and ``profile_stop``)."""
    return profiling


cdef struct Operand:
    # A strided [rows, heads, T, d] (or [rows, heads, T]) array: its first element and the
    # element strides of its leading axes; the last axis of a 4-D operand is contiguous.
    void *data
    Py_ssize_t row
    Py_ssize_t head
    Py_ssize_t cell


cdef struct Operands:
    # The arrays of one call; the forward sets the first five, the backward all nine.
    Operand q               # [rows, heads, T, d]
    Operand k               # [rows, kv_heads, T, d]
    Operand v               # [rows, kv_heads, T, d]
    Operand out             # [rows, heads, T, d]
    Operand lse             # [rows, heads, T]
    Operand dout            # [rows, heads, T, d]
    Operand dq              # [rows, heads, T, d]
    Operand dk              # [rows, kv_heads, T, d]
    Operand dv              # [rows, kv_heads, T, d]


cdef struct Group:
    # One work item's operands: a row's key/value head and the query heads of its group.
    # Pointers are at the row's first cell; ``*_head`` step between the group's query heads,
    # ``ld*`` between cells (the row strides of the tile products).
    const void *q
    const void *k
    const void *v
    const void *out
    const void *lse
    const void *dout
    void *dq
    void *dk
    void *dv
    Py_ssize_t heads      # query heads in the group
    Py_ssize_t q_head, ldq, ldk, ldv, out_head, ldo, lse_head, lse_cell
    Py_ssize_t dout_head, lddout, dq_head, lddq, lddk, lddv


@cython.cdivision(True)   # the output's divisor, a sum of exponentials, is at least 1
cdef void forward_segment(const Group *g, Py_ssize_t start, Py_ssize_t end, Py_ssize_t d,
                          Py_ssize_t tile, real scale, real *scratch, Interrupt *state,
                          bint caller, Clock *clock) noexcept nogil:
    """One (row, key/value head, segment) and every query head of its group.

    A query tile's scores against all its keys form one panel, so each query's softmax
    is exact in one pass (max, exp, sum) and the output needs no rescaling. The
    transposed K of the segment serves every query head of the group. Stops early
    (output undefined) when an interrupt is requested; the calling thread (``caller``)
    looks for pending signals once per query tile.
    """
    cdef const real *q = <const real *>g.q
    cdef const real *k = <const real *>g.k
    cdef const real *v = <const real *>g.v
    cdef real *out = <real *>g.out
    cdef real *lse = <real *>g.lse
    cdef Py_ssize_t length = end - start, heads = g.heads
    cdef Py_ssize_t ld = padded(length), ldq = g.ldq, ldo = g.ldo
    cdef real *kt = scratch                    # [d, ld]: K of the segment, transposed by strips
    cdef real *p = kt + d * ld                 # [tile, ld]: a query tile's scores, then
                                               # probabilities, against keys start..
    cdef real *total = p + tile * ld           # [tile]: sum of exp per query
    cdef real *vs = total + tile               # [d + 16, ld]: V of the segment by strips
    cdef Py_ssize_t a, h, qa, nq, keys, i, j, visible
    cdef const real *qh
    cdef real *oh
    cdef real *pi
    cdef real *oi
    cdef real top
    transpose_by_strips(k + start * g.ldk, length, d, g.ldk, kt)
    store_by_strips(v + start * g.ldv, length, d, g.ldv, vs)
    for a in range((length + tile - 1) // tile):
        if (caller and interrupted(state)) or interrupt_requested(state):
            return
        qa = start + a * tile
        nq = min(tile, end - qa)
        keys = qa + nq - start
        for h in range(heads):
            qh = q + h * g.q_head
            oh = out + h * g.out_head
            product(clock, FORWARD_GEMM, nq, keys, d, scale, qh + qa * ldq, ldq, 1, kt, by_strips(d), p, ld,
                    False, SEQPACK_LOWER_OUTPUT, qa - start)
            for i in range(nq):
                pi = p + i * ld
                visible = qa + i - start + 1
                top = row_max(pi, visible)
                exp_shift(pi, visible, top)
                total[i] = row_sum(pi, visible)
                for j in range(visible, keys):
                    pi[j] = 0
                lse[h * g.lse_head + (qa + i) * g.lse_cell] = top + scalar_log(total[i])
            product(clock, FORWARD_GEMM, nq, d, keys, <real>1, p, ld, 1, vs, by_strips(length), oh + qa * ldo,
                    ldo, False, SEQPACK_LOWER_A, qa - start)
            for i in range(nq):
                oi = oh + (qa + i) * ldo
                for j in range(d):
                    oi[j] = oi[j] / total[i]


cdef void backward_segment(const Group *g, Py_ssize_t start, Py_ssize_t end, Py_ssize_t d,
                           Py_ssize_t tile, real scale, real *scratch, Interrupt *state,
                           bint caller, Clock *clock) noexcept nogil:
    """The backward of one (row, key/value head, segment) and its group's query heads.

    Per query tile and head, the probabilities and dS against all keys form two panels;
    dV and dK read them transposed through their strides. dK and dV of a key sum over
    query tiles, then over the group's heads in order, so the result never depends on
    the thread count. Interrupted as ``forward_segment``.
    """
    cdef const real *q = <const real *>g.q
    cdef const real *k = <const real *>g.k
    cdef const real *v = <const real *>g.v
    cdef const real *out = <const real *>g.out
    cdef const real *lse = <const real *>g.lse
    cdef const real *dout = <const real *>g.dout
    cdef real *dq = <real *>g.dq
    cdef real *dk = <real *>g.dk
    cdef real *dv = <real *>g.dv
    cdef Py_ssize_t length = end - start, heads = g.heads
    cdef Py_ssize_t ld = padded(length), ldq = g.ldq, lddout = g.lddout
    cdef real *kt = scratch                    # [d, ld]: K of the segment, transposed by strips
    cdef real *vt = kt + d * ld                # [d, ld]: V of the segment, transposed by strips
    cdef real *p = vt + d * ld                 # [tile, ld]: scores, then probabilities
    cdef real *ds = p + tile * ld              # [tile, ld]: dP, then dS
    cdef real *delta = ds + tile * ld          # [heads, tile]: rowsum(dout * out) per query
    cdef real *ks = delta + heads * tile       # [d + 16, ld]: K of the segment by strips
    cdef Py_ssize_t a, h, qa, nq, i, j, visible, keys, before
    cdef const real *qh
    cdef const real *douth
    cdef const real *lseh
    cdef real *pi
    cdef real *dsi
    transpose_by_strips(k + start * g.ldk, length, d, g.ldk, kt)
    transpose_by_strips(v + start * g.ldv, length, d, g.ldv, vt)
    store_by_strips(k + start * g.ldk, length, d, g.ldk, ks)
    for a in range((length + tile - 1) // tile):
        if (caller and interrupted(state)) or interrupt_requested(state):
            return
        qa = start + a * tile
        nq = min(tile, end - qa)
        before = qa - start
        keys = before + nq
        for h in range(heads):
            for i in range(nq):
                delta[h * tile + i] = row_dot(dout + h * g.dout_head + (qa + i) * lddout,
                                              out + h * g.out_head + (qa + i) * g.ldo, d)
        for h in range(heads):
            qh = q + h * g.q_head
            douth = dout + h * g.dout_head
            lseh = lse + h * g.lse_head
            product(clock, DS_GEMM, nq, keys, d, scale, qh + qa * ldq, ldq, 1, kt, by_strips(d), p, ld,
                    False, SEQPACK_LOWER_OUTPUT, before)
            product(clock, DS_GEMM, nq, keys, d, <real>1, douth + qa * lddout, lddout, 1, vt, by_strips(d),
                    ds, ld, False, SEQPACK_LOWER_OUTPUT, before)
            for i in range(nq):
                pi = p + i * ld
                dsi = ds + i * ld
                visible = qa + i - start + 1
                exp_ds(pi, visible, lseh[(qa + i) * g.lse_cell], dsi, delta[h * tile + i])
                for j in range(visible, keys):
                    pi[j] = 0
                    dsi[j] = 0
            # dK and dV of the keys before the tile add to what earlier tiles left; the
            # tile's own keys are first reached here, so the group's first head starts them.
            product(clock, DV_GEMM, before, d, nq, <real>1, p, 1, ld, douth + qa * lddout, lddout,
                    dv + start * g.lddv, g.lddv, True, SEQPACK_FULL, 0)
            product(clock, DV_GEMM, nq, d, nq, <real>1, p + before, 1, ld, douth + qa * lddout, lddout,
                    dv + qa * g.lddv, g.lddv, h > 0, SEQPACK_UPPER_A, 0)
            product(clock, DK_GEMM, before, d, nq, scale, ds, 1, ld, qh + qa * ldq, ldq,
                    dk + start * g.lddk, g.lddk, True, SEQPACK_FULL, 0)
            product(clock, DK_GEMM, nq, d, nq, scale, ds + before, 1, ld, qh + qa * ldq, ldq,
                    dk + qa * g.lddk, g.lddk, h > 0, SEQPACK_UPPER_A, 0)
            product(clock, DQ_GEMM, nq, d, keys, scale, ds, ld, 1, ks, by_strips(length),
                    dq + h * g.dq_head + qa * g.lddq, g.lddq, False, SEQPACK_LOWER_A, before)


cdef void zero_padding(Operand x, Py_ssize_t heads, Py_ssize_t width, Py_ssize_t cell,
                       const Py_ssize_t[::1] valid_lengths, size_t itemsize) noexcept nogil:
    """Zero cells ``[valid_length, T)`` of every (row, head) block, ``cell`` elements each."""
    cdef Py_ssize_t r, h, t
    cdef char *base
    for r in range(valid_lengths.shape[0]):
        for h in range(heads):
            base = <char *>x.data + (r * x.row + h * x.head) * <Py_ssize_t>itemsize
            for t in range(valid_lengths[r], width):
                memset(base + t * x.cell * <Py_ssize_t>itemsize, 0, cell * itemsize)


cdef int thread_count(int threads, Py_ssize_t items, Py_ssize_t work) noexcept nogil:
    """The caller's thread count, capped by the number of items and by the work."""
    cdef Py_ssize_t count = threads
    if count > items:
        count = items
    if count > work // WORK_PER_THREAD:
        count = work // WORK_PER_THREAD
    return <int>count if count > 1 else 1


cdef inline void *first_cell(const Operand *x, Py_ssize_t row, Py_ssize_t head,
                             size_t itemsize) noexcept nogil:
    """The first cell of ``x[row, head]``."""
    return <char *>x.data + (row * x.row + head * x.head) * <Py_ssize_t>itemsize


cdef const Span *item_group(Py_ssize_t item, bint backward, const Plan *plan,
                            Py_ssize_t kv_heads, Py_ssize_t group, const Operands *x,
                            size_t itemsize, Group *g) noexcept nogil:
    """Point ``g`` at work item ``item``: segment order[item // kv_heads], key/value head
    item % kv_heads and its group's query heads from ``kv * group`` on. Returns the
    segment."""
    cdef const Span *span = &plan.spans[plan.order[item // kv_heads]]
    cdef Py_ssize_t r = span.row, kv = item % kv_heads, h = kv * group
    g.q = first_cell(&x.q, r, h, itemsize)
    g.k = first_cell(&x.k, r, kv, itemsize)
    g.v = first_cell(&x.v, r, kv, itemsize)
    g.out = first_cell(&x.out, r, h, itemsize)
    g.lse = first_cell(&x.lse, r, h, itemsize)
    if backward:
        g.dout = first_cell(&x.dout, r, h, itemsize)
        g.dq = first_cell(&x.dq, r, h, itemsize)
        g.dk = first_cell(&x.dk, r, kv, itemsize)
        g.dv = first_cell(&x.dv, r, kv, itemsize)
    return span


cdef void describe_group(const Operands *x, bint backward, Py_ssize_t group,
                         Group *g) noexcept nogil:
    """The strides of a work item (the same for every item of a call)."""
    g.heads = group
    g.q_head, g.ldq = x.q.head, x.q.cell
    g.ldk, g.ldv = x.k.cell, x.v.cell
    g.out_head, g.ldo = x.out.head, x.out.cell
    g.lse_head, g.lse_cell = x.lse.head, x.lse.cell
    if backward:
        g.dout_head, g.lddout = x.dout.head, x.dout.cell
        g.dq_head, g.lddq = x.dq.head, x.dq.cell
        g.lddk, g.lddv = x.dk.cell, x.dv.cell


cdef void run_item(Py_ssize_t item, bint backward, const Plan *plan, Py_ssize_t kv_heads,
                   Py_ssize_t group, const Operands *operands, Py_ssize_t d, Py_ssize_t tile,
                   real scale, real *scratch, Interrupt *state, bint caller,
                   double *seconds) noexcept nogil:
    """Forward or backward of work item ``item`` (see ``item_group``); profiled into this
    thread's ``seconds`` [BUCKETS] unless it is NULL."""
    cdef Group g
    cdef Clock clock
    cdef Clock *timing = NULL
    if seconds != NULL:
        clock.seconds = seconds
        clock.bucket = clock.other = DS_OTHER if backward else FORWARD_OTHER
        clock.last = seqpack_monotonic_seconds()
        timing = &clock
    describe_group(operands, backward, group, &g)
    cdef const Span *span = item_group(item, backward, plan, kv_heads, group, operands,
                                       sizeof(real), &g)
    if backward:
        backward_segment(&g, span.start, span.end, d, tile, scale, scratch, state, caller,
                         timing)
    else:
        forward_segment(&g, span.start, span.end, d, tile, scale, scratch, state, caller,
                        timing)
    charge(timing, 0)


cdef struct Queue:
    Py_ssize_t next     # the next work item to take (atomic)
    Py_ssize_t idle     # threads other than the caller that have no item left (atomic)
    Py_ssize_t items


cdef void run_items(int thread, int team, Queue *queue, bint backward, const Plan *plan,
                    Py_ssize_t kv_heads, Py_ssize_t group, const Operands *operands,
                    Py_ssize_t d, Py_ssize_t tile, real scale, real *scratch,
                    Interrupt *state, double *seconds, const seqpack_fpmode *mode) noexcept nogil:
    """One thread's share: work items taken one at a time from ``queue`` until none is
    left or an interrupt is requested. The calling thread (``thread`` 0) then keeps
    looking for signals until the others are done, so a Ctrl-C during another thread's
    long item stops it at its next query tile. Each item writes outputs of its own, and
    every other thread works in the caller's floating-point ``mode`` (flush-to-zero
    included): which thread ran an item never changes a bit."""
    cdef Py_ssize_t item
    cdef bint caller = thread == 0
    cdef seqpack_fpmode own
    if not caller:
        own = seqpack_get_fpmode()
        seqpack_set_fpmode(mode[0])
    while not ((caller and interrupted(state)) or interrupt_requested(state)):
        item = seqpack_fetch_add(&queue.next, 1)
        if item >= queue.items:
            break
        run_item(item, backward, plan, kv_heads, group, operands, d, tile, scale, scratch,
                 state, caller, seconds)
    if not caller:
        seqpack_set_fpmode(own)
        seqpack_fetch_add(&queue.idle, 1)
        return
    while seqpack_fetch_add(&queue.idle, 0) < team - 1 and not interrupted(state):
        seqpack_pause()


cdef int run(bint backward, const Operands *operands, Py_ssize_t kv_heads, Py_ssize_t group,
             Py_ssize_t width, Py_ssize_t d, const Py_ssize_t[::1] valid_lengths,
             const Py_ssize_t[:, ::1] segment_starts, real scale, int threads, Plan *plan,
             Interrupt *state) noexcept nogil:
    """Plan the layout, zero the padding of the outputs, run every work item.

    Per thread, the forward needs K of a segment transposed and V by strips, a score panel
    (a query tile against the segment's keys) and a sum per query; the backward K and V
    transposed and K by strips, two panels and rowsum(dout * out) per query of the group.
    The work is counted as 2 (forward) or 4 (backward) * d multiply-adds per permitted
    edge and query head.
    """
    cdef Py_ssize_t tile = tile_edge(d), items, size, o
    cdef Py_ssize_t heads = kv_heads * group
    cdef real *scratch
    cdef double *seconds = NULL            # [threads, BUCKETS] when profiling
    cdef bint timed = profiling
    cdef double began = seqpack_monotonic_seconds() if timed else 0
    cdef int b, status = make_plan(valid_lengths, segment_starts, plan)
    if status != LAYOUT_OK:
        return status
    items = plan.segments * kv_heads
    threads = thread_count(threads, items, plan.edges * heads * d * (4 if backward else 2))
    if backward:
        size = (3 * d + 16 + 2 * tile) * padded(plan.longest) + group * tile
    else:
        size = (2 * d + 16 + tile) * padded(plan.longest) + tile
    scratch = <real *>malloc(threads * size * sizeof(real))
    if timed:
        seconds = <double *>calloc(threads * BUCKETS, sizeof(double))
    if scratch == NULL or (timed and seconds == NULL):
        free(scratch)
        free_plan(plan)
        return OUT_OF_MEMORY
    if backward:
        zero_padding(operands.dq, heads, width, d, valid_lengths, sizeof(real))
        zero_padding(operands.dk, kv_heads, width, d, valid_lengths, sizeof(real))
        zero_padding(operands.dv, kv_heads, width, d, valid_lengths, sizeof(real))
    else:
        zero_padding(operands.out, heads, width, d, valid_lengths, sizeof(real))
        zero_padding(operands.lse, heads, width, 1, valid_lengths, sizeof(real))
    if seconds != NULL:
        profile_seconds[BACKWARD_SETUP if backward else FORWARD_SETUP] += (
            seqpack_monotonic_seconds() - began)
    interrupt_start(state)
    cdef Queue queue
    cdef seqpack_fpmode mode = seqpack_get_fpmode()
    queue.next, queue.idle, queue.items = 0, 0, items
    if threads == 1:
        run_items(0, 1, &queue, backward, plan, kv_heads, group, operands, d, tile, scale,
                  scratch, state, seconds, &mode)
    else:
        with parallel(num_threads=threads):
            run_items(threadid(), seqpack_omp_team_size(), &queue, backward, plan, kv_heads,
                      group, operands, d, tile, scale, scratch + threadid() * size, state,
                      NULL if seconds == NULL else seconds + threadid() * BUCKETS, &mode)
    if seconds != NULL:
        for o in range(threads):
            for b in range(BUCKETS):
                profile_seconds[b] += seconds[o * BUCKETS + b]
        free(seconds)
    free(scratch)
    free_plan(plan)
    return INTERRUPTED if state.stop else LAYOUT_OK


cdef Operand operand4(const real[:, :, :, :] x) noexcept:
    """A 4-D operand; the stride of an axis of length 1 is moot, so it is normalized (a
    single cell's leading dimension is head_dim)."""
    cdef Py_ssize_t item = sizeof(real)
    return Operand(<void *>&x[0, 0, 0, 0], x.strides[0] // item if x.shape[0] > 1 else 0,
                   x.strides[1] // item if x.shape[1] > 1 else 0,
                   x.strides[2] // item if x.shape[2] > 1 else x.shape[3])


cdef Operand operand3(const real[:, :, :] x) noexcept:
    """A 3-D operand (lse), normalized as in ``operand4``."""
    cdef Py_ssize_t item = sizeof(real)
    return Operand(<void *>&x[0, 0, 0], x.strides[0] // item if x.shape[0] > 1 else 0,
                   x.strides[1] // item if x.shape[1] > 1 else 0,
                   x.strides[2] // item if x.shape[2] > 1 else 1)


def forward(const real[:, :, :, :] q not None, const real[:, :, :, :] k not None,
            const real[:, :, :, :] v not None, const Py_ssize_t[::1] valid_lengths not None,
            const Py_ssize_t[:, ::1] segment_starts not None, real[:, :, :, :] out not None,
            real[:, :, :] lse not None, int threads, double scale):
    """Range attention forward into ``out`` and ``lse`` (float32 or float64 throughout).

    ``q``, ``out`` ``[rows, heads, T, d]``, ``k``, ``v`` ``[rows, kv_heads, T, d]`` with
    ``heads`` a multiple of ``kv_heads``; every array nonempty, its last axis contiguous
    and its other strides non-negative multiples of the item size (a T-stride of at least
    ``d`` when T > 1); outputs free of overlap. Returns ``(status, row, column)``:
    ``LAYOUT_OK`` when done, else the ``Status`` (see ``plan_layout``) and the first
    offending cell, with the outputs untouched. Interruptible: Ctrl-C raises
    ``KeyboardInterrupt`` (outputs then undefined).
    """
    cdef Plan plan
    cdef Interrupt interrupt
    cdef int status
    cdef Operands operands
    operands.q, operands.k, operands.v = operand4(q), operand4(k), operand4(v)
    operands.out, operands.lse = operand4(out), operand3(lse)
    cdef Py_ssize_t kv_heads = k.shape[1], group = q.shape[1] // k.shape[1]
    interrupt_start(&interrupt)  # an invalid layout returns before the work starts
    with nogil:
        status = run(False, &operands, kv_heads, group, q.shape[2], q.shape[3],
                           valid_lengths, segment_starts, <real>scale, threads, &plan, &interrupt)
    interrupt_finish(&interrupt)
    return status, plan.bad_row, plan.bad_column


def backward(const real[:, :, :, :] q not None, const real[:, :, :, :] k not None,
             const real[:, :, :, :] v not None, const real[:, :, :, :] out not None,
             const real[:, :, :] lse not None, const real[:, :, :, :] dout not None,
             const Py_ssize_t[::1] valid_lengths not None,
             const Py_ssize_t[:, ::1] segment_starts not None, real[:, :, :, :] dq not None,
             real[:, :, :, :] dk not None, real[:, :, :, :] dv not None, int threads,
             double scale):
    """Range attention backward into ``dq`` (shaped as q), ``dk``, ``dv`` (as k); arrays
    as in ``forward``; returns like ``forward``."""
    cdef Plan plan
    cdef Interrupt interrupt
    cdef int status
    cdef Operands operands
    operands.q, operands.k, operands.v = operand4(q), operand4(k), operand4(v)
    operands.out, operands.lse, operands.dout = operand4(out), operand3(lse), operand4(dout)
    operands.dq, operands.dk, operands.dv = operand4(dq), operand4(dk), operand4(dv)
    cdef Py_ssize_t kv_heads = k.shape[1], group = q.shape[1] // k.shape[1]
    interrupt_start(&interrupt)  # an invalid layout returns before the work starts
    with nogil:
        status = run(True, &operands, kv_heads, group, q.shape[2], q.shape[3],
                           valid_lengths, segment_starts, <real>scale, threads, &plan, &interrupt)
    interrupt_finish(&interrupt)
    return status, plan.bad_row, plan.bad_column
