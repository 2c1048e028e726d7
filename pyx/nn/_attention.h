/* The attention kernels' C helpers: exp loops, transposes, row sums, dots and maxima, per CPU path.
   Included by the Cython module through its cdef extern block. */
#ifndef SEQPACK_ATTENTION_H
#define SEQPACK_ATTENTION_H

#include <stdint.h>
#include <stddef.h>

/* Comparisons here never trap (no signalling NaN reaches them); telling gcc so lets it
   turn the selects into vector blends. Results and NaN semantics are unchanged. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

/* The exp loops carry most of the work outside tile products. On x86-64 with gcc or
   clang they are compiled three times, for AVX-512, AVX2 (both with FMA) and baseline
   x86-64, and one is chosen at load time by the CPU (a function pointer, not an ifunc,
   so musl builds too); the wheel stays portable. The module is built with
   -ffp-contract=off, so the only fused multiply-adds are the explicit C99 fma calls,
   which every path rounds the same way (the baseline through libm): every path gives
   the same bits (a NaN's sign and payload aside). */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define SEQPACK_X86_PATHS 1
#define SEQPACK_AVX512 __attribute__((target("avx512f,fma")))
#define SEQPACK_AVX2 __attribute__((target("avx2,fma")))
#else
#define SEQPACK_X86_PATHS 0
#endif

/* exp(x - shift) over a row, branch-free so that the compiler vectorizes it.
   Range reduction x = n ln2 + r with n rounded by the 1.5 * 2**mantissa trick (MAGIC)
   and ln2 split in two, Taylor polynomial of DEGREE on |r| <= ln2 / 2 by Horner's rule
   (coefficients 1/k! folded at compile time from LAST = 1/DEGREE!; truncation below
   1 ulp), 2**n built in the exponent bits.
   Arguments below LO (including -inf) give exactly 0; above HI they saturate.
   In place: row[j] = exp(row[j] - shift). With ``ds`` (the backward), also
   ds[j] = row[j] * (ds[j] - di) in the same pass. */
#define SEQPACK_EXP_LOOP(T, I, STORE, FMA, DEGREE, LAST, LO, HI, MAGIC, MANTISSA, BIAS, LN2_HI, LN2_LO) \
{                                                                                         \
    for (ptrdiff_t j = 0; j < n; j++) {                                                   \
        T x = row[j] - shift;                                                             \
        T xc = x < (T)(LO) ? (T)(LO) : x;                                                 \
        xc = xc > (T)(HI) ? (T)(HI) : xc;                                                 \
        union { T f; I i; } t, s, magic;                                                  \
        magic.f = (T)(MAGIC);                                                             \
        t.f = FMA(xc, (T)1.4426950408889634074, magic.f);                                 \
        T nf = t.f - magic.f;                                                             \
        I e = t.i - magic.i;                                                              \
        T r = FMA(-nf, (T)(LN2_HI), xc);                                                  \
        r = FMA(-nf, (T)(LN2_LO), r);                                                     \
        T c = (T)(LAST), p = c;                                                           \
        _Pragma("GCC unroll 16")                                                          \
        for (int k = DEGREE; k > 0; k--) {                                                \
            c = c * (T)k;                                                                 \
            p = FMA(p, r, c);                                                             \
        }                                                                                 \
        s.i = (e + BIAS) << MANTISSA;                                                     \
        T y = p * s.f;                                                                    \
        STORE(j, x < (T)(LO) ? 0 : y);                                                    \
    }                                                                                     \
}
#define SEQPACK_STORE_EXP(j, value) row[j] = (value)
#define SEQPACK_STORE_EXP_DS(j, value) row[j] = (value); ds[j] = row[j] * (ds[j] - di)
#define SEQPACK_EXP_BODY(T, I, ...)                                                        \
{                                                                                         \
    if (ds == NULL) SEQPACK_EXP_LOOP(T, I, SEQPACK_STORE_EXP, __VA_ARGS__)                \
    else SEQPACK_EXP_LOOP(T, I, SEQPACK_STORE_EXP_DS, __VA_ARGS__)                        \
}
#define SEQPACK_EXP_SIGNATURE(T, NAME) \
    static void NAME(T *restrict row, ptrdiff_t n, T shift,                               \
                     T *restrict ds, T di)
#if SEQPACK_X86_PATHS
#include <immintrin.h>
/* The vector paths: the loop's steps above on whole registers, written out because gcc
   vectorizes the two clamps into nine compares and blends. ``x < LO ? LO : x`` is
   MAXPS(LO, x) and ``xc > HI ? HI : xc`` is MINPS(HI, xc), NaN and signed zeros
   included, and every other step is the same IEEE operation, so the bits are the C
   loop's; the constants are folded in the loop's order. One macro for both widths: P is
   the intrinsics' prefix (_mm256_ or _mm512_), BITS the register's, ZERO_BELOW(x, y)
   is ``x < LO ? 0 : y`` against the macro's ``lo`` (an AND-NOT with a compare in AVX2,
   a zero-masked move in AVX-512). The tail (fewer than one register) is left to the C loop: row, ds and n are
   advanced past the vectors. */
#define SEQPACK_EXP_VECTORS(P, BITS, T, V, VI, W, S, SI, EPI, EPI_SET1, ZERO_BELOW, FMA, DEGREE, LAST, LO, HI, MAGIC, MANTISSA, BIAS, LN2_HI, LN2_LO) \
{                                                                                         \
    T folded[DEGREE + 1], c = (T)(LAST);                                                  \
    folded[DEGREE] = c;                                                                   \
    for (int k = DEGREE; k > 0; k--) { c = c * (T)k; folded[k - 1] = c; }                 \
    const V lo = P##set1_##S((T)(LO)), hi = P##set1_##S((T)(HI));                        \
    const V magic = P##set1_##S((T)(MAGIC)), log2e = P##set1_##S((T)1.4426950408889634074); \
    const V ln2_hi = P##set1_##S((T)(LN2_HI)), ln2_lo = P##set1_##S((T)(LN2_LO));         \
    const V by = P##set1_##S(shift), dv = P##set1_##S(di);                               \
    const VI bias = EPI_SET1(BIAS), magic_i = P##cast##SI##_si##BITS(magic);             \
    ptrdiff_t j = 0;                                                                      \
    for (; j + W <= n; j += W) {                                                          \
        V x = P##sub_##S(P##loadu_##S(row + j), by);                                      \
        V xc = P##min_##S(hi, P##max_##S(lo, x));                                         \
        V t = P##fmadd_##S(xc, log2e, magic), nf = P##sub_##S(t, magic);                  \
        VI e = P##sub_##EPI(P##cast##SI##_si##BITS(t), magic_i);                          \
        V r = P##fnmadd_##S(nf, ln2_hi, xc);                                              \
        r = P##fnmadd_##S(nf, ln2_lo, r);                                                 \
        V p = P##set1_##S(folded[DEGREE]);                                                \
        for (int k = DEGREE; k > 0; k--) p = P##fmadd_##S(p, r, P##set1_##S(folded[k - 1])); \
        V s = P##castsi##BITS##_##SI(P##slli_##EPI(P##add_##EPI(e, bias), MANTISSA));    \
        V y = ZERO_BELOW(x, P##mul_##S(p, s));                                            \
        P##storeu_##S(row + j, y);                                                        \
        if (ds != NULL)                                                                   \
            P##storeu_##S(ds + j, P##mul_##S(y, P##sub_##S(P##loadu_##S(ds + j), dv)));   \
    }                                                                                     \
    row += j, n -= j;                                                                     \
    if (ds != NULL) ds += j;                                                              \
}
#define SEQPACK_ZERO_BELOW_256_PS(x, y) _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y)
#define SEQPACK_ZERO_BELOW_256_PD(x, y) _mm256_andnot_pd(_mm256_cmp_pd(x, lo, _CMP_LT_OQ), y)
#define SEQPACK_ZERO_BELOW_512_PS(x, y) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), y)
#define SEQPACK_ZERO_BELOW_512_PD(x, y) _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(x, lo, _CMP_NLT_UQ), y)
#define SEQPACK_EXP_AVX2_F(...) SEQPACK_EXP_VECTORS(_mm256_, 256, float, __m256, __m256i, 8, ps, ps, epi32, \
                                                     _mm256_set1_epi32, SEQPACK_ZERO_BELOW_256_PS, __VA_ARGS__)
#define SEQPACK_EXP_AVX2_D(...) SEQPACK_EXP_VECTORS(_mm256_, 256, double, __m256d, __m256i, 4, pd, pd, epi64, \
                                                     _mm256_set1_epi64x, SEQPACK_ZERO_BELOW_256_PD, __VA_ARGS__)
#define SEQPACK_EXP_AVX512_F(...) SEQPACK_EXP_VECTORS(_mm512_, 512, float, __m512, __m512i, 16, ps, ps, epi32, \
                                                       _mm512_set1_epi32, SEQPACK_ZERO_BELOW_512_PS, __VA_ARGS__)
#define SEQPACK_EXP_AVX512_D(...) SEQPACK_EXP_VECTORS(_mm512_, 512, double, __m512d, __m512i, 8, pd, pd, epi64, \
                                                       _mm512_set1_epi64, SEQPACK_ZERO_BELOW_512_PD, __VA_ARGS__)
#define SEQPACK_EXP_SHIFT(T, I, SUFFIX, AVX2, AVX512, ...)                                 \
    SEQPACK_EXP_SIGNATURE(T, seqpack_exp_##SUFFIX##_baseline) SEQPACK_EXP_BODY(T, I, __VA_ARGS__) \
    SEQPACK_AVX2 SEQPACK_EXP_SIGNATURE(T, seqpack_exp_##SUFFIX##_avx2)                     \
    {                                                                                     \
        AVX2(__VA_ARGS__)                                                                 \
        SEQPACK_EXP_BODY(T, I, __VA_ARGS__)                                               \
    }                                                                                     \
    SEQPACK_AVX512 SEQPACK_EXP_SIGNATURE(T, seqpack_exp_##SUFFIX##_avx512)                 \
    {                                                                                     \
        AVX512(__VA_ARGS__)                                                               \
        SEQPACK_EXP_BODY(T, I, __VA_ARGS__)                                               \
    }
#else
#define SEQPACK_EXP_SHIFT(T, I, SUFFIX, AVX2, AVX512, ...)                                      \
    SEQPACK_EXP_SIGNATURE(T, seqpack_exp_##SUFFIX##_baseline) SEQPACK_EXP_BODY(T, I, __VA_ARGS__)
#endif
SEQPACK_EXP_SHIFT(float, int32_t, f, SEQPACK_EXP_AVX2_F, SEQPACK_EXP_AVX512_F, fmaf, 7, 1.0 / 5040.0, -87.0, 88.0,
                  12582912.0, 23, 127, 0.693359375, -2.12194440e-4)
SEQPACK_EXP_SHIFT(double, int64_t, d, SEQPACK_EXP_AVX2_D, SEQPACK_EXP_AVX512_D, fma, 12, 1.0 / 479001600.0, -708.0,
                  709.0, 6755399441055744.0, 52, 1023,
                  6.93147180369123816490e-01, 1.90821492927058770002e-10)

/* dst[j, i] = src[i, j] for a row-major src[rows, cols]: K or V of a segment turned
   into the row-major B of the score products. Pure data movement, so every path gives
   the same bits. The baseline is a scalar loop; the AVX2 path (also taken on AVX-512
   CPUs) moves 8 x 8 floats or 4 x 4 doubles at a time through registers, the edges
   by the scalar loop. */
#define SEQPACK_TRANSPOSE_SCALAR(I0, I1, J0, J1)                                      \
    for (ptrdiff_t i = (I0); i < (I1); i++)                                           \
        for (ptrdiff_t j = (J0); j < (J1); j++) dst[j * ldd + i] = src[i * lds + j];
#define SEQPACK_TRANSPOSE_SIGNATURE(T, NAME)                                              \
    static void NAME(const T *restrict src, ptrdiff_t rows, ptrdiff_t cols,               \
                     ptrdiff_t lds, T *restrict dst, ptrdiff_t ldd)
SEQPACK_TRANSPOSE_SIGNATURE(float, seqpack_transpose_f_baseline)
{
    SEQPACK_TRANSPOSE_SCALAR(0, rows, 0, cols)
}
SEQPACK_TRANSPOSE_SIGNATURE(double, seqpack_transpose_d_baseline)
{
    SEQPACK_TRANSPOSE_SCALAR(0, rows, 0, cols)
}
#if SEQPACK_X86_PATHS
#include <immintrin.h>
__attribute__((target("avx2"))) SEQPACK_TRANSPOSE_SIGNATURE(float, seqpack_transpose_f_avx2)
{
    ptrdiff_t i0 = 0, j0 = 0;
    for (; i0 + 8 <= rows; i0 += 8) {
        for (j0 = 0; j0 + 8 <= cols; j0 += 8) {
            const float *s = src + i0 * lds + j0;
            __m256 r[8], t[8], u[8];
            for (int q = 0; q < 8; q++) r[q] = _mm256_loadu_ps(s + q * lds);
            for (int q = 0; q < 8; q += 2) {   /* pairs of rows interleaved */
                t[q] = _mm256_unpacklo_ps(r[q], r[q + 1]);
                t[q + 1] = _mm256_unpackhi_ps(r[q], r[q + 1]);
            }
            for (int q = 0; q < 8; q += 4) {   /* four rows per column within each half */
                u[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
                u[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xEE);
                u[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
                u[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
            }
            float *d = dst + j0 * ldd + i0;
            for (int q = 0; q < 4; q++) {      /* the halves joined: columns q and q + 4 */
                _mm256_storeu_ps(d + q * ldd, _mm256_permute2f128_ps(u[q], u[q + 4], 0x20));
                _mm256_storeu_ps(d + (q + 4) * ldd, _mm256_permute2f128_ps(u[q], u[q + 4], 0x31));
            }
        }
        SEQPACK_TRANSPOSE_SCALAR(i0, i0 + 8, j0, cols)
    }
    SEQPACK_TRANSPOSE_SCALAR(i0, rows, 0, cols)
}
__attribute__((target("avx2"))) SEQPACK_TRANSPOSE_SIGNATURE(double, seqpack_transpose_d_avx2)
{
    ptrdiff_t i0 = 0, j0 = 0;
    for (; i0 + 4 <= rows; i0 += 4) {
        for (j0 = 0; j0 + 4 <= cols; j0 += 4) {
            const double *s = src + i0 * lds + j0;
            __m256d r0 = _mm256_loadu_pd(s), r1 = _mm256_loadu_pd(s + lds);
            __m256d r2 = _mm256_loadu_pd(s + 2 * lds), r3 = _mm256_loadu_pd(s + 3 * lds);
            __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
            __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
            double *d = dst + j0 * ldd + i0;
            _mm256_storeu_pd(d, _mm256_permute2f128_pd(t0, t2, 0x20));
            _mm256_storeu_pd(d + ldd, _mm256_permute2f128_pd(t1, t3, 0x20));
            _mm256_storeu_pd(d + 2 * ldd, _mm256_permute2f128_pd(t0, t2, 0x31));
            _mm256_storeu_pd(d + 3 * ldd, _mm256_permute2f128_pd(t1, t3, 0x31));
        }
        SEQPACK_TRANSPOSE_SCALAR(i0, i0 + 4, j0, cols)
    }
    SEQPACK_TRANSPOSE_SCALAR(i0, rows, 0, cols)
}
#endif
static void (*seqpack_transpose_f)(const float *restrict, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                                   float *restrict, ptrdiff_t) = seqpack_transpose_f_baseline;
static void (*seqpack_transpose_d)(const double *restrict, ptrdiff_t, ptrdiff_t, ptrdiff_t,
                                   double *restrict, ptrdiff_t) = seqpack_transpose_d_baseline;

/* The chosen path: 0 baseline, 1 AVX2, 2 AVX-512. */
static void (*seqpack_exp_shift_f)(float *restrict, ptrdiff_t, float,
                                   float *restrict, float) = seqpack_exp_f_baseline;
static void (*seqpack_exp_shift_d)(double *restrict, ptrdiff_t, double,
                                   double *restrict, double) = seqpack_exp_d_baseline;

/* Sums and maxima in eight fixed lanes: lane u takes elements u, u + 8, ...; the lanes
   are then joined in a fixed order and the tail added in turn. The order never depends
   on the thread, the call or the CPU path, so results stay bitwise reproducible. The
   baseline is plain C; the AVX2 path (also taken on AVX-512 CPUs) holds the eight lanes
   in vector registers and does each lane's steps exactly as the C does (a maximum is
   ``x > lane ? x : lane``, which is what MAXPS computes, NaN and signed zeros
   included; a dot product multiplies, then adds). */
#define SEQPACK_LANE_REDUCTIONS(T, SUFFIX)                                          \
static T seqpack_sum_##SUFFIX##_baseline(const T *restrict x, ptrdiff_t n)         \
{                                                                                  \
    T lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                          \
    ptrdiff_t j = 0;                                                               \
    for (; j + 8 <= n; j += 8)                                                     \
        for (int u = 0; u < 8; u++) lane[u] += x[j + u];                           \
    T total = ((lane[0] + lane[4]) + (lane[1] + lane[5]))                          \
            + ((lane[2] + lane[6]) + (lane[3] + lane[7]));                         \
    for (; j < n; j++) total += x[j];                                              \
    return total;                                                                  \
}                                                                                  \
static T seqpack_dot_##SUFFIX##_baseline(const T *restrict x, const T *restrict y,  \
                                         ptrdiff_t n)                               \
{                                                                                  \
    T lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                          \
    ptrdiff_t j = 0;                                                               \
    for (; j + 8 <= n; j += 8)                                                     \
        for (int u = 0; u < 8; u++) lane[u] += x[j + u] * y[j + u];                \
    T total = ((lane[0] + lane[4]) + (lane[1] + lane[5]))                          \
            + ((lane[2] + lane[6]) + (lane[3] + lane[7]));                         \
    for (; j < n; j++) total += x[j] * y[j];                                       \
    return total;                                                                  \
}                                                                                  \
static T seqpack_max_##SUFFIX##_baseline(const T *restrict x, ptrdiff_t n)         \
{                                                                                  \
    T best = x[0];                                                                 \
    ptrdiff_t j = 1;                                                               \
    if (n >= 8) {                                                                  \
        T lane[8];                                                                 \
        for (int u = 0; u < 8; u++) lane[u] = x[u];                                \
        for (j = 8; j + 8 <= n; j += 8)                                            \
            for (int u = 0; u < 8; u++)                                            \
                lane[u] = x[j + u] > lane[u] ? x[j + u] : lane[u];                 \
        for (int u = 0; u < 8; u++) best = lane[u] > best ? lane[u] : best;        \
    }                                                                              \
    for (; j < n; j++) best = x[j] > best ? x[j] : best;                           \
    return best;                                                                   \
}
SEQPACK_LANE_REDUCTIONS(float, f)
SEQPACK_LANE_REDUCTIONS(double, d)
#if SEQPACK_X86_PATHS
/* The lanes of a float row in one register, of a double row in two (lanes 0-3, 4-7). */
#define SEQPACK_LANES_JOINED(T, STORE)                                                 \
    T lane[8];                                                                         \
    STORE;                                                                             \
    T total = ((lane[0] + lane[4]) + (lane[1] + lane[5]))                              \
            + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
SEQPACK_AVX2 static float seqpack_sum_f_avx2(const float *restrict x, ptrdiff_t n)
{
    __m256 acc = _mm256_setzero_ps();
    ptrdiff_t j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
    SEQPACK_LANES_JOINED(float, _mm256_storeu_ps(lane, acc))
    for (; j < n; j++) total += x[j];
    return total;
}
SEQPACK_AVX2 static double seqpack_sum_d_avx2(const double *restrict x, ptrdiff_t n)
{
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    ptrdiff_t j = 0;
    for (; j + 8 <= n; j += 8) {
        lo = _mm256_add_pd(lo, _mm256_loadu_pd(x + j));
        hi = _mm256_add_pd(hi, _mm256_loadu_pd(x + j + 4));
    }
    SEQPACK_LANES_JOINED(double, (_mm256_storeu_pd(lane, lo), _mm256_storeu_pd(lane + 4, hi)))
    for (; j < n; j++) total += x[j];
    return total;
}
SEQPACK_AVX2 static float seqpack_dot_f_avx2(const float *restrict x, const float *restrict y,
                                             ptrdiff_t n)
{
    __m256 acc = _mm256_setzero_ps();
    ptrdiff_t j = 0;
    for (; j + 8 <= n; j += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
    SEQPACK_LANES_JOINED(float, _mm256_storeu_ps(lane, acc))
    for (; j < n; j++) total += x[j] * y[j];
    return total;
}
SEQPACK_AVX2 static double seqpack_dot_d_avx2(const double *restrict x, const double *restrict y,
                                              ptrdiff_t n)
{
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    ptrdiff_t j = 0;
    for (; j + 8 <= n; j += 8) {
        lo = _mm256_add_pd(lo, _mm256_mul_pd(_mm256_loadu_pd(x + j), _mm256_loadu_pd(y + j)));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(_mm256_loadu_pd(x + j + 4), _mm256_loadu_pd(y + j + 4)));
    }
    SEQPACK_LANES_JOINED(double, (_mm256_storeu_pd(lane, lo), _mm256_storeu_pd(lane + 4, hi)))
    for (; j < n; j++) total += x[j] * y[j];
    return total;
}
SEQPACK_AVX2 static float seqpack_max_f_avx2(const float *restrict x, ptrdiff_t n)
{
    float best = x[0];
    ptrdiff_t j = 1;
    if (n >= 8) {
        __m256 acc = _mm256_loadu_ps(x);
        for (j = 8; j + 8 <= n; j += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + j), acc);
        float lane[8];
        _mm256_storeu_ps(lane, acc);
        for (int u = 0; u < 8; u++) best = lane[u] > best ? lane[u] : best;
    }
    for (; j < n; j++) best = x[j] > best ? x[j] : best;
    return best;
}
SEQPACK_AVX2 static double seqpack_max_d_avx2(const double *restrict x, ptrdiff_t n)
{
    double best = x[0];
    ptrdiff_t j = 1;
    if (n >= 8) {
        __m256d lo = _mm256_loadu_pd(x), hi = _mm256_loadu_pd(x + 4);
        for (j = 8; j + 8 <= n; j += 8) {
            lo = _mm256_max_pd(_mm256_loadu_pd(x + j), lo);
            hi = _mm256_max_pd(_mm256_loadu_pd(x + j + 4), hi);
        }
        double lane[8];
        _mm256_storeu_pd(lane, lo);
        _mm256_storeu_pd(lane + 4, hi);
        for (int u = 0; u < 8; u++) best = lane[u] > best ? lane[u] : best;
    }
    for (; j < n; j++) best = x[j] > best ? x[j] : best;
    return best;
}
#endif
static float (*seqpack_sum_f)(const float *restrict, ptrdiff_t) = seqpack_sum_f_baseline;
static double (*seqpack_sum_d)(const double *restrict, ptrdiff_t) = seqpack_sum_d_baseline;
static float (*seqpack_dot_f)(const float *restrict, const float *restrict, ptrdiff_t) = seqpack_dot_f_baseline;
static double (*seqpack_dot_d)(const double *restrict, const double *restrict, ptrdiff_t) = seqpack_dot_d_baseline;
static float (*seqpack_max_f)(const float *restrict, ptrdiff_t) = seqpack_max_f_baseline;
static double (*seqpack_max_d)(const double *restrict, ptrdiff_t) = seqpack_max_d_baseline;

/* Which path's helpers are in use, for tests: out[0] the exp loops, out[1] the K/V
   transposes, out[2] the row sums, dots and maxima (0 baseline, 1 AVX2, 2 AVX-512; -1
   when the float and double helpers of a group disagree). */
#define SEQPACK_EXP_IS(P) (seqpack_exp_shift_f == seqpack_exp_f_##P && seqpack_exp_shift_d == seqpack_exp_d_##P)
#define SEQPACK_TRANSPOSE_IS(P) \
    (seqpack_transpose_f == seqpack_transpose_f_##P && seqpack_transpose_d == seqpack_transpose_d_##P)
#define SEQPACK_REDUCTIONS_ARE(P) (seqpack_sum_f == seqpack_sum_f_##P && seqpack_sum_d == seqpack_sum_d_##P \
    && seqpack_dot_f == seqpack_dot_f_##P && seqpack_dot_d == seqpack_dot_d_##P                        \
    && seqpack_max_f == seqpack_max_f_##P && seqpack_max_d == seqpack_max_d_##P)
static void seqpack_helper_paths(int *out)
{
    out[0] = SEQPACK_EXP_IS(baseline) ? 0 : -1;
    out[1] = SEQPACK_TRANSPOSE_IS(baseline) ? 0 : -1;
    out[2] = SEQPACK_REDUCTIONS_ARE(baseline) ? 0 : -1;
#if SEQPACK_X86_PATHS
    if (SEQPACK_EXP_IS(avx2)) out[0] = 1;
    if (SEQPACK_EXP_IS(avx512)) out[0] = 2;
    if (SEQPACK_TRANSPOSE_IS(avx2)) out[1] = 1;
    if (SEQPACK_REDUCTIONS_ARE(avx2)) out[2] = 1;
#endif
}

/* Whether this CPU can run path ``path``. */
static int seqpack_exp_path_supported(int path)
{
    if (path == 0) return 1;
#if SEQPACK_X86_PATHS
    __builtin_cpu_init();
    if (path == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (path == 2) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#endif
    return 0;
}

/* Use ``path`` (or, with -1, the best this CPU runs); return the path in use, or -1
   when ``path`` cannot run here. */
static int seqpack_exp_use_path(int path)
{
    if (path < 0) {
        path = seqpack_exp_path_supported(2) ? 2 : seqpack_exp_path_supported(1) ? 1 : 0;
    }
    if (!seqpack_exp_path_supported(path)) return -1;
    seqpack_exp_shift_f = seqpack_exp_f_baseline;
    seqpack_exp_shift_d = seqpack_exp_d_baseline;
    seqpack_transpose_f = seqpack_transpose_f_baseline;
    seqpack_transpose_d = seqpack_transpose_d_baseline;
    seqpack_sum_f = seqpack_sum_f_baseline, seqpack_sum_d = seqpack_sum_d_baseline;
    seqpack_dot_f = seqpack_dot_f_baseline, seqpack_dot_d = seqpack_dot_d_baseline;
    seqpack_max_f = seqpack_max_f_baseline, seqpack_max_d = seqpack_max_d_baseline;
#if SEQPACK_X86_PATHS
    if (path == 1) { seqpack_exp_shift_f = seqpack_exp_f_avx2; seqpack_exp_shift_d = seqpack_exp_d_avx2; }
    if (path == 2) { seqpack_exp_shift_f = seqpack_exp_f_avx512; seqpack_exp_shift_d = seqpack_exp_d_avx512; }
    if (path >= 1) {
        seqpack_transpose_f = seqpack_transpose_f_avx2, seqpack_transpose_d = seqpack_transpose_d_avx2;
        seqpack_sum_f = seqpack_sum_f_avx2, seqpack_sum_d = seqpack_sum_d_avx2;
        seqpack_dot_f = seqpack_dot_f_avx2, seqpack_dot_d = seqpack_dot_d_avx2;
        seqpack_max_f = seqpack_max_f_avx2, seqpack_max_d = seqpack_max_d_avx2;
    }
#endif
    return path;
}


#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif
