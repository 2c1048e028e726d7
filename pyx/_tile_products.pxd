# Tile products of the attention kernels (cimport only; no runtime module).
#
# ``C = alpha * A @ B`` or ``C += alpha * A @ B`` on tiles that sit in cache: A is read
# through two strides (either orientation, so a transposed panel needs no copy), C is
# row-major with a contiguous last axis, and B is read by strips of 16 floats (8 doubles)
# of columns: row-major, or stored strip by strip (each strip a contiguous [k, 16] block,
# so that the rows a block of C walks down share one memory page). Register-blocked: 6 rows of C by one
# strip (AVX2) or two (AVX-512) stay in vector registers while the products over the inner axis accumulate,
# so a tile costs no packing and no library call. Each element of C is one chain of fused
# multiply-adds in inner-axis order, started from zero, then scaled by alpha and added to
# C; the AVX-512 and AVX2 paths and the portable path (C99 ``fma``) compute exactly that, so every path
# gives the same bits, and the thread count never enters. A causal ``shape`` skips work
# known to be zero or unwanted:
#   LOWER_OUTPUT  only C[i, j] with j <= i + diagonal is wanted: a block of 6 rows skips
#                 its vectors of columns (16 floats or 8 doubles; 8 and 4 in AVX2) that
#                 lie wholly right of it (others are computed whole);
#   LOWER_A       A[i, p] == 0 for p > i + diagonal: row i's chain stops after its own p;
#   UPPER_A       A[i, p] == 0 for p < i - diagonal: row i's chain starts at its own p.
# A row's chain never takes those zeros, so an infinity or NaN in a row of B that only
# zeros of A meet (a later key's value, say) cannot reach C as 0 * inf; for finite B the
# skipped terms would have added exact zeros, which change no bit.

cdef extern from "_tile_products.h":
    enum:
        SEQPACK_FULL
        SEQPACK_LOWER_OUTPUT
        SEQPACK_LOWER_A
        SEQPACK_UPPER_A

    ctypedef struct seqpack_product:
        Py_ssize_t m, n, k
        const void *a
        Py_ssize_t a_row, a_inner
        const void *b
        Py_ssize_t ldb, b_strip
        void *c
        Py_ssize_t ldc
        double alpha
        int accumulate
        int shape
        Py_ssize_t diagonal

    void seqpack_product_f(const seqpack_product *g) noexcept nogil
    void seqpack_product_d(const seqpack_product *g) noexcept nogil
    int seqpack_products_supported(int path) noexcept nogil
    int seqpack_products_use_path(int path) noexcept nogil
    int seqpack_products_path() noexcept nogil
