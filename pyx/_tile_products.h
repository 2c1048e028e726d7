/* The tile products of the attention kernels (see _tile_products.pxd).
   Included by the Cython module through its cdef extern block. */
#ifndef SEQPACK_TILE_PRODUCTS_H
#define SEQPACK_TILE_PRODUCTS_H

#include <math.h>
#include <stddef.h>

enum { SEQPACK_FULL = 0, SEQPACK_LOWER_OUTPUT = 1, SEQPACK_LOWER_A = 2, SEQPACK_UPPER_A = 3 };
enum { SEQPACK_MR = 6 };

typedef struct {
    ptrdiff_t m, n, k;
    const void *a;
    ptrdiff_t a_row, a_inner;      /* A[i, p] at a[i * a_row + p * a_inner] */
    const void *b;
    ptrdiff_t ldb, b_strip;        /* B[p, 16 s + j] at b[s * b_strip + p * ldb + j]
                                      (8 s for doubles): b_strip 16 (8) when B is
                                      row-major, k * 16 (k * 8) with ldb 16 (8) when
                                      it is stored strip by strip */
    void *c;
    ptrdiff_t ldc;                 /* C[i, j] at c[i * ldc + j] */
    double alpha;
    int accumulate;                /* 1: C += alpha * A @ B; 0: C = alpha * A @ B */
    int shape;
    ptrdiff_t diagonal;
} seqpack_product;

/* The inner range [*first, *last) of the block of ``rows`` rows at row ``i0``. */
static inline void seqpack_block_inner(const seqpack_product *g, ptrdiff_t i0,
                                       ptrdiff_t rows, ptrdiff_t *first, ptrdiff_t *last)
{
    ptrdiff_t begin = 0, end = g->k;
    if (g->shape == SEQPACK_LOWER_A && i0 + rows + g->diagonal < end)
        end = i0 + rows + g->diagonal;
    if (g->shape == SEQPACK_UPPER_A && i0 - g->diagonal > begin)
        begin = i0 - g->diagonal;
    if (begin > end) begin = end > 0 ? end : 0;   /* an empty chain, within [0, k] */
    if (end < begin) end = begin;
    *first = begin;
    *last = end;
}

/* Whether row i's chain takes inner step p (its A[i, p] may be nonzero). */
static inline int seqpack_row_takes(const seqpack_product *g, ptrdiff_t i, ptrdiff_t p)
{
    if (g->shape == SEQPACK_LOWER_A) return p <= i + g->diagonal;
    if (g->shape == SEQPACK_UPPER_A) return p >= i - g->diagonal;
    return 1;
}

/* Whether the strip at column j0 of the block at row i0 is skipped (LOWER_OUTPUT). */
static inline int seqpack_strip_skipped(const seqpack_product *g, ptrdiff_t i0,
                                        ptrdiff_t rows, ptrdiff_t j0)
{
    return g->shape == SEQPACK_LOWER_OUTPUT && j0 > i0 + rows - 1 + g->diagonal;
}

/* The portable path: the same blocks, strips and chains, a block's sums in a local
   array whose rows a compiler can vectorize where fma is an instruction (NEON, for
   one); on an x86-64 CPU without FMA each fma is libm's exact one, slow but equal. */
#define SEQPACK_PRODUCT_PORTABLE(T, NR, FMA, NAME)                                         \
static void NAME(const seqpack_product *g)                                                 \
{                                                                                          \
    const T *a = (const T *)g->a, *b = (const T *)g->b;                                    \
    T *c = (T *)g->c;                                                                      \
    const T alpha = (T)g->alpha;                                                           \
    const int by_rows = g->shape == SEQPACK_LOWER_A || g->shape == SEQPACK_UPPER_A;        \
    for (ptrdiff_t j0 = 0; j0 < g->n; j0 += NR) {                                          \
        ptrdiff_t width = g->n - j0 < NR ? g->n - j0 : NR;                                 \
        for (ptrdiff_t i0 = 0; i0 < g->m; i0 += SEQPACK_MR) {                              \
            ptrdiff_t rows = g->m - i0 < SEQPACK_MR ? g->m - i0 : SEQPACK_MR, first, last; \
            if (seqpack_strip_skipped(g, i0, rows, j0)) continue;                          \
            seqpack_block_inner(g, i0, rows, &first, &last);                               \
            T sums[SEQPACK_MR][NR] = {{0}};                                                \
            for (ptrdiff_t p = first; p < last; p++) {                                     \
                const T *bp = b + j0 / NR * g->b_strip + p * g->ldb;                       \
                for (ptrdiff_t r = 0; r < rows; r++) {                                     \
                    if (by_rows && !seqpack_row_takes(g, i0 + r, p)) continue;             \
                    T x = a[(i0 + r) * g->a_row + p * g->a_inner];                         \
                    for (ptrdiff_t j = 0; j < width; j++)                                  \
                        sums[r][j] = FMA(x, bp[j], sums[r][j]);                            \
                }                                                                          \
            }                                                                              \
            for (ptrdiff_t r = 0; r < rows; r++) {                                         \
                T *cr = c + (i0 + r) * g->ldc + j0;                                        \
                for (ptrdiff_t j = 0; j < width; j++) {                                    \
                    T scaled = alpha * sums[r][j];                                         \
                    cr[j] = g->accumulate ? cr[j] + scaled : scaled;                       \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
}
SEQPACK_PRODUCT_PORTABLE(float, 16, fmaf, seqpack_product_f_portable)
SEQPACK_PRODUCT_PORTABLE(double, 8, fma, seqpack_product_d_portable)

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define SEQPACK_PRODUCT_X86 1
#include <immintrin.h>

/* The AVX2 path: a 6 x (2 vectors) block of C in 12 registers; rows past the end of C
   repeat its last row (computed, never stored); a strip narrower than two vectors
   loads and stores through lane masks, so nothing past the end of B or C is touched.
   A long inner axis is cut into chunks of SEQPACK_KC so that a chunk of B stays in L2
   across the blocks of rows; between chunks a block's sums wait in ``partial``, which
   keeps each chain in inner-axis order (the bits do not change). */
enum { SEQPACK_KC = 256, SEQPACK_PARTIAL = 4608 };
/* One step down the inner axis for the 6 rows of a block: b0 and b1 hold B's row. */
#define SEQPACK_SIX_ROWS(BROADCAST, FMADD)                                                \
    x = BROADCAST(a0 + o); c00 = FMADD(x, b0, c00); c01 = FMADD(x, b1, c01);           \
    x = BROADCAST(a1 + o); c10 = FMADD(x, b0, c10); c11 = FMADD(x, b1, c11);           \
    x = BROADCAST(a2 + o); c20 = FMADD(x, b0, c20); c21 = FMADD(x, b1, c21);           \
    x = BROADCAST(a3 + o); c30 = FMADD(x, b0, c30); c31 = FMADD(x, b1, c31);           \
    x = BROADCAST(a4 + o); c40 = FMADD(x, b0, c40); c41 = FMADD(x, b1, c41);           \
    x = BROADCAST(a5 + o); c50 = FMADD(x, b0, c50); c51 = FMADD(x, b1, c51);
/* The step of the 6 rows on B's first vector alone (the second is past the end of C,
   or above the diagonal of a LOWER_OUTPUT product). */
#define SEQPACK_SIX_ROWS_FIRST(BROADCAST, FMADD)                                          \
    x = BROADCAST(a0 + o); c00 = FMADD(x, b0, c00);                                    \
    x = BROADCAST(a1 + o); c10 = FMADD(x, b0, c10);                                    \
    x = BROADCAST(a2 + o); c20 = FMADD(x, b0, c20);                                    \
    x = BROADCAST(a3 + o); c30 = FMADD(x, b0, c30);                                    \
    x = BROADCAST(a4 + o); c40 = FMADD(x, b0, c40);                                    \
    x = BROADCAST(a5 + o); c50 = FMADD(x, b0, c50);
/* One row's step: the ``SEQPACK_SIX_ROWS`` step of row R alone. */
#define SEQPACK_ONE_ROW(R, BROADCAST, FMADD)                                               \
    x = BROADCAST(a##R + o); c##R##0 = FMADD(x, b0, c##R##0); c##R##1 = FMADD(x, b1, c##R##1);
/* Rows N to 5 of a block (a switch falling through: one jump per step). */
#define SEQPACK_ROWS_FROM(N, BROADCAST, FMADD)                                             \
    switch (N) {                                                                           \
    case 0: SEQPACK_ONE_ROW(0, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 1: SEQPACK_ONE_ROW(1, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 2: SEQPACK_ONE_ROW(2, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 3: SEQPACK_ONE_ROW(3, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 4: SEQPACK_ONE_ROW(4, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 5: SEQPACK_ONE_ROW(5, BROADCAST, FMADD) __attribute__((fallthrough));             \
    default: break;                                                                        \
    }
/* Rows 0 to N - 1 of a block. */
#define SEQPACK_ROWS_BELOW(N, BROADCAST, FMADD)                                            \
    switch (N) {                                                                           \
    case 6: SEQPACK_ONE_ROW(5, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 5: SEQPACK_ONE_ROW(4, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 4: SEQPACK_ONE_ROW(3, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 3: SEQPACK_ONE_ROW(2, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 2: SEQPACK_ONE_ROW(1, BROADCAST, FMADD) __attribute__((fallthrough));             \
    case 1: SEQPACK_ONE_ROW(0, BROADCAST, FMADD) __attribute__((fallthrough));             \
    default: break;                                                                        \
    }
/* A block is 6 rows of C by two vectors (2 W columns): in AVX2 both vectors lie in one
   strip of B (W = 8 floats), at AVX-512 each is a strip of its own (W = 16 floats), the
   second ``SECOND`` elements after the first. NRB is a strip's width (16 floats, 8 doubles). */
#define SEQPACK_PRODUCT_SIMD(TARGET, T, V, W, NRB, SECOND, I, NAME, LOADU, STOREU, MASKLOAD,  \
                             MASKSTORE, BROADCAST, FMADD, MUL, ADD, ZERO, SET1, LANES, BY_ROWS) \
__attribute__((target(TARGET), noinline)) static void NAME(const seqpack_product *g)      \
{                                                                                          \
    const T *a = (const T *)g->a, *b = (const T *)g->b;                                    \
    T *c = (T *)g->c;                                                                      \
    const V alpha = SET1((T)g->alpha);                                                     \
    const ptrdiff_t ldb = g->ldb, ai = g->a_inner;                                         \
    /* Column strips outside (a strip of B stays in L1 across the blocks of rows) when C   \
       is wide; else blocks of rows outside (their A stays in L1 across the strips). */    \
    const int strips_outside = g->n > 128;                                                 \
    const ptrdiff_t strips = (g->n + 2 * W - 1) / (2 * W);                                 \
    const ptrdiff_t blocks = (g->m + SEQPACK_MR - 1) / SEQPACK_MR;                         \
    T partial[SEQPACK_PARTIAL] __attribute__((aligned(32)));                               \
    const ptrdiff_t chunk = g->k > SEQPACK_KC                                              \
        && blocks * strips * SEQPACK_MR * 2 * W <= SEQPACK_PARTIAL ? SEQPACK_KC : g->k;    \
    for (ptrdiff_t k0 = 0; k0 == 0 || k0 < g->k; k0 += chunk)                              \
    for (ptrdiff_t outer = 0; outer < (strips_outside ? strips : blocks); outer++)         \
    for (ptrdiff_t inner = 0; inner < (strips_outside ? blocks : strips); inner++) {       \
        ptrdiff_t strip = strips_outside ? outer : inner, block = strips_outside ? inner : outer; \
        ptrdiff_t j0 = 2 * W * strip, i0 = SEQPACK_MR * block;                             \
        ptrdiff_t width = g->n - j0 < 2 * W ? g->n - j0 : 2 * W;                           \
        ptrdiff_t rows = g->m - i0 < SEQPACK_MR ? g->m - i0 : SEQPACK_MR, first, last;     \
        if (seqpack_strip_skipped(g, i0, rows, j0)) continue;                              \
        /* A LOWER_OUTPUT block whose second vector lies wholly above the diagonal computes \
           and stores its first alone (each element's chain is unchanged). */             \
        if (width > W && seqpack_strip_skipped(g, i0, rows, j0 + W)) width = W;            \
        seqpack_block_inner(g, i0, rows, &first, &last);                                   \
        /* This chunk's part [from, to) of the block's chain; an empty chain ends in the   \
           first chunk. */                                                                 \
        ptrdiff_t from = first > k0 ? first : k0, to = last < k0 + chunk ? last : k0 + chunk; \
        int starts = first >= k0 || k0 == 0, ends = last <= k0 + chunk || first == last;   \
        if (first == last ? k0 != 0 : from >= to) continue;                                \
        const I mask0 = LANES(width), mask1 = LANES(width - W);                            \
        T *saved = partial + (block * strips + strip) * SEQPACK_MR * 2 * W;                \
        const T *a0 = a + i0 * g->a_row + from * ai;                                       \
        const T *a1 = a0 + (rows > 1) * g->a_row, *a2 = a0 + (rows > 2 ? 2 : rows - 1) * g->a_row; \
        const T *a3 = a0 + (rows > 3 ? 3 : rows - 1) * g->a_row;                           \
        const T *a4 = a0 + (rows > 4 ? 4 : rows - 1) * g->a_row;                           \
        const T *a5 = a0 + (rows > 5 ? 5 : rows - 1) * g->a_row;                           \
        const T *bp = b + j0 / NRB * g->b_strip + from * ldb;                             \
        const ptrdiff_t second = SECOND;                                                   \
        V c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;                      \
        if (starts) {                                                                      \
            c00 = c01 = c10 = c11 = c20 = c21 = ZERO();                                    \
            c30 = c31 = c40 = c41 = c50 = c51 = ZERO();                                    \
        } else {                                                                           \
            c00 = LOADU(saved), c01 = LOADU(saved + W), c10 = LOADU(saved + 2 * W);        \
            c11 = LOADU(saved + 3 * W), c20 = LOADU(saved + 4 * W), c21 = LOADU(saved + 5 * W); \
            c30 = LOADU(saved + 6 * W), c31 = LOADU(saved + 7 * W), c40 = LOADU(saved + 8 * W); \
            c41 = LOADU(saved + 9 * W), c50 = LOADU(saved + 10 * W), c51 = LOADU(saved + 11 * W); \
        }                                                                                  \
        /* Every row takes the steps [all_from, all_to); before them (UPPER_A) and after  \
           them (LOWER_A) only the rows whose own chain has begun or not yet ended. */    \
        ptrdiff_t all_from = from, all_to = to;                                            \
        if (BY_ROWS && g->shape == SEQPACK_UPPER_A) {                                      \
            ptrdiff_t begun = i0 + rows - 1 - g->diagonal;                                 \
            all_from = begun < from ? from : begun > to ? to : begun;                      \
        }                                                                                  \
        if (BY_ROWS && g->shape == SEQPACK_LOWER_A) {                                      \
            ptrdiff_t ended = i0 + 1 + g->diagonal;                                        \
            all_to = ended < from ? from : ended > to ? to : ended;                        \
        }                                                                                  \
        /* Step s is inner index from + s. */                                              \
        ptrdiff_t head = all_from - from, body = all_to - from, steps = to - from, s = 0, o = 0; \
        for (; s < head; s++, o += ai, bp += ldb) {                                        \
            V b0 = MASKLOAD(bp, mask0), b1 = MASKLOAD(bp + second, mask1), x;              \
            SEQPACK_ROWS_BELOW(from + s - i0 + g->diagonal + 1, BROADCAST, FMADD)          \
        }                                                                                  \
        if (width == 2 * W) {                                                              \
            for (; s < body; s++, o += ai, bp += ldb) {                                    \
                V b0 = LOADU(bp), b1 = LOADU(bp + second), x;                              \
                /* The next block's B (a hint: never faults, even past the end). */        \
                _mm_prefetch((const char *)(bp + 2 * W / NRB * g->b_strip), _MM_HINT_T0);  \
                SEQPACK_SIX_ROWS(BROADCAST, FMADD)                                         \
            }                                                                              \
        } else if (width > W) {                                                            \
            for (; s < body; s++, o += ai, bp += ldb) {                                    \
                V b0 = MASKLOAD(bp, mask0), b1 = MASKLOAD(bp + second, mask1), x;          \
                SEQPACK_SIX_ROWS(BROADCAST, FMADD)                                         \
            }                                                                              \
        } else {                                                                           \
            for (; s < body; s++, o += ai, bp += ldb) {                                    \
                V b0 = MASKLOAD(bp, mask0), x;                                             \
                SEQPACK_SIX_ROWS_FIRST(BROADCAST, FMADD)                                   \
            }                                                                              \
        }                                                                                  \
        for (; s < steps; s++, o += ai, bp += ldb) {                                       \
            V b0 = MASKLOAD(bp, mask0), b1 = MASKLOAD(bp + second, mask1), x;              \
            SEQPACK_ROWS_FROM(from + s - i0 - g->diagonal, BROADCAST, FMADD)               \
        }                                                                                  \
        if (!ends) {                                                                       \
            STOREU(saved, c00), STOREU(saved + W, c01), STOREU(saved + 2 * W, c10);        \
            STOREU(saved + 3 * W, c11), STOREU(saved + 4 * W, c20), STOREU(saved + 5 * W, c21); \
            STOREU(saved + 6 * W, c30), STOREU(saved + 7 * W, c31), STOREU(saved + 8 * W, c40); \
            STOREU(saved + 9 * W, c41), STOREU(saved + 10 * W, c50), STOREU(saved + 11 * W, c51); \
            continue;                                                                      \
        }                                                                                  \
        V sums[SEQPACK_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},                       \
                                 {c30, c31}, {c40, c41}, {c50, c51}};                      \
        for (ptrdiff_t r = 0; r < rows; r++) {                                             \
            T *cr = c + (i0 + r) * g->ldc + j0;                                            \
            V y0 = MUL(alpha, sums[r][0]), y1 = MUL(alpha, sums[r][1]);                    \
            if (width == 2 * W) {                                                          \
                if (g->accumulate) { y0 = ADD(LOADU(cr), y0); y1 = ADD(LOADU(cr + W), y1); } \
                STOREU(cr, y0);                                                            \
                STOREU(cr + W, y1);                                                        \
            } else {                                                                       \
                if (g->accumulate) {                                                       \
                    y0 = ADD(MASKLOAD(cr, mask0), y0);                                     \
                    y1 = ADD(MASKLOAD(cr + W, mask1), y1);                                 \
                }                                                                          \
                MASKSTORE(cr, mask0, y0);                                                  \
                MASKSTORE(cr + W, mask1, y1);                                              \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
}

/* Lane masks: lane l is on when l < count (count may be negative or past the width). */
__attribute__((target("avx2"))) static inline __m256i seqpack_lanes_f(ptrdiff_t count)
{
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int n = count < 0 ? 0 : count > 8 ? 8 : (int)count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
}
__attribute__((target("avx2"))) static inline __m256i seqpack_lanes_d(ptrdiff_t count)
{
    __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
    long long n = count < 0 ? 0 : count > 4 ? 4 : (long long)count;
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), lane);
}
#define SEQPACK_PRODUCT_AVX2_F(NAME, BY_ROWS)                                                  \
    SEQPACK_PRODUCT_SIMD("avx2,fma", float, __m256, 8, 16, 8, __m256i, NAME, _mm256_loadu_ps,  \
                         _mm256_storeu_ps, _mm256_maskload_ps, _mm256_maskstore_ps,             \
                         _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps,    \
                         _mm256_setzero_ps, _mm256_set1_ps, seqpack_lanes_f, BY_ROWS)
#define SEQPACK_PRODUCT_AVX2_D(NAME, BY_ROWS)                                                  \
    SEQPACK_PRODUCT_SIMD("avx2,fma", double, __m256d, 4, 8, 4, __m256i, NAME, _mm256_loadu_pd, \
                         _mm256_storeu_pd, _mm256_maskload_pd, _mm256_maskstore_pd,             \
                         _mm256_broadcast_sd, _mm256_fmadd_pd, _mm256_mul_pd, _mm256_add_pd,    \
                         _mm256_setzero_pd, _mm256_set1_pd, seqpack_lanes_d, BY_ROWS)

/* AVX-512: the same blocks, two strips of B wide, so each block's chains take twice the
   columns per broadcast of A; masked loads and stores never touch past the end. */
#define SEQPACK_PRODUCTS_AVX512 "avx512f,avx2,fma"
__attribute__((target(SEQPACK_PRODUCTS_AVX512))) static inline __mmask16 seqpack_lanes16(ptrdiff_t count)
{
    return count <= 0 ? 0 : count >= 16 ? 0xFFFF : (__mmask16)((1u << count) - 1);
}
__attribute__((target(SEQPACK_PRODUCTS_AVX512))) static inline __mmask8 seqpack_lanes8(ptrdiff_t count)
{
    return count <= 0 ? 0 : count >= 8 ? 0xFF : (__mmask8)((1u << count) - 1);
}
__attribute__((target(SEQPACK_PRODUCTS_AVX512))) static inline __m512 seqpack_maskload16(const float *p, __mmask16 m)
{
    return _mm512_maskz_loadu_ps(m, p);
}
__attribute__((target(SEQPACK_PRODUCTS_AVX512))) static inline __m512d seqpack_maskload8(const double *p, __mmask8 m)
{
    return _mm512_maskz_loadu_pd(m, p);
}
__attribute__((target(SEQPACK_PRODUCTS_AVX512))) static inline __m512 seqpack_broadcast16(const float *p)
{
    return _mm512_set1_ps(*p);
}
__attribute__((target(SEQPACK_PRODUCTS_AVX512))) static inline __m512d seqpack_broadcast8(const double *p)
{
    return _mm512_set1_pd(*p);
}
#define SEQPACK_PRODUCT_AVX512_F(NAME, BY_ROWS)                                                \
    SEQPACK_PRODUCT_SIMD(SEQPACK_PRODUCTS_AVX512, float, __m512, 16, 16, g->b_strip, __mmask16,  \
                         NAME,                                                                  \
                         _mm512_loadu_ps, _mm512_storeu_ps, seqpack_maskload16,                 \
                         _mm512_mask_storeu_ps, seqpack_broadcast16, _mm512_fmadd_ps,           \
                         _mm512_mul_ps, _mm512_add_ps, _mm512_setzero_ps, _mm512_set1_ps,       \
                         seqpack_lanes16, BY_ROWS)
#define SEQPACK_PRODUCT_AVX512_D(NAME, BY_ROWS)                                                \
    SEQPACK_PRODUCT_SIMD(SEQPACK_PRODUCTS_AVX512, double, __m512d, 8, 8, g->b_strip, __mmask8,   \
                         NAME,                                                                  \
                         _mm512_loadu_pd, _mm512_storeu_pd, seqpack_maskload8,                  \
                         _mm512_mask_storeu_pd, seqpack_broadcast8, _mm512_fmadd_pd,            \
                         _mm512_mul_pd, _mm512_add_pd, _mm512_setzero_pd, _mm512_set1_pd,       \
                         seqpack_lanes8, BY_ROWS)
/* Each product compiled twice: the shapes with per-row chains (LOWER_A, UPPER_A) apart,
   so that the other products' code is what it was before rows had chains of their own;
   NAME dispatches on the shape. */
#define SEQPACK_PRODUCT_BOTH(COMPILE, NAME)                                                    \
    COMPILE(NAME##_blocks, 0)                                                                  \
    COMPILE(NAME##_rows, 1)                                                                    \
    static void NAME(const seqpack_product *g)                                                 \
    {                                                                                          \
        if (g->shape == SEQPACK_LOWER_A || g->shape == SEQPACK_UPPER_A) NAME##_rows(g);        \
        else NAME##_blocks(g);                                                                 \
    }
SEQPACK_PRODUCT_BOTH(SEQPACK_PRODUCT_AVX2_F, seqpack_product_f_avx2)
SEQPACK_PRODUCT_BOTH(SEQPACK_PRODUCT_AVX2_D, seqpack_product_d_avx2)
SEQPACK_PRODUCT_BOTH(SEQPACK_PRODUCT_AVX512_F, seqpack_product_f_avx512)
SEQPACK_PRODUCT_BOTH(SEQPACK_PRODUCT_AVX512_D, seqpack_product_d_avx512)
#else
#define SEQPACK_PRODUCT_X86 0
#endif

static void (*seqpack_product_f)(const seqpack_product *) = seqpack_product_f_portable;
static void (*seqpack_product_d)(const seqpack_product *) = seqpack_product_d_portable;

/* Whether this CPU runs product path ``path``: 0 portable, 1 AVX2 (with FMA), 2 AVX-512. */
static int seqpack_products_supported(int path)
{
    if (path == 0) return 1;
#if SEQPACK_PRODUCT_X86
    __builtin_cpu_init();
    if (path == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (path == 2) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2")
                          && __builtin_cpu_supports("fma");
#endif
    return 0;
}

/* The product path in use (0 portable, 1 AVX2, 2 AVX-512), for tests. */
static int seqpack_products_path(void)
{
#if SEQPACK_PRODUCT_X86
    if (seqpack_product_f == seqpack_product_f_avx2 && seqpack_product_d == seqpack_product_d_avx2) return 1;
    if (seqpack_product_f == seqpack_product_f_avx512 && seqpack_product_d == seqpack_product_d_avx512) return 2;
#endif
    return seqpack_product_f == seqpack_product_f_portable && seqpack_product_d == seqpack_product_d_portable ? 0 : -1;
}

/* Use product path ``path``; return 0 (nothing changed) when the CPU cannot run it. */
static int seqpack_products_use_path(int path)
{
    if (!seqpack_products_supported(path)) return 0;
    seqpack_product_f = seqpack_product_f_portable;
    seqpack_product_d = seqpack_product_d_portable;
#if SEQPACK_PRODUCT_X86
    if (path == 1) { seqpack_product_f = seqpack_product_f_avx2; seqpack_product_d = seqpack_product_d_avx2; }
    if (path == 2) { seqpack_product_f = seqpack_product_f_avx512; seqpack_product_d = seqpack_product_d_avx512; }
#endif
    return 1;
}

#endif
