/* The OpenMP runtime's thread limit and team size (1 without OpenMP), and an atomic counter.
   Included by the Cython module through its cdef extern block. */
#ifndef SEQPACK_OPENMP_H
#define SEQPACK_OPENMP_H

#ifdef _OPENMP
#include <omp.h>
/* The team a parallel region may get: OMP_NUM_THREADS (or omp_set_num_threads), capped by
   OMP_THREAD_LIMIT. */
static inline int seqpack_omp_max_threads(void)
{
    int wanted = omp_get_max_threads(), limit = omp_get_thread_limit();
    return limit < wanted ? limit : wanted;
}
/* The threads of the enclosing parallel region (1 outside one). */
static inline int seqpack_omp_team_size(void) { return omp_get_num_threads(); }
#define SEQPACK_OPENMP 1
#else
static inline int seqpack_omp_max_threads(void) { return 1; }
static inline int seqpack_omp_team_size(void) { return 1; }
#define SEQPACK_OPENMP 0
#endif

/* Work sharing: add v to *p and return its value before, atomically (relaxed: the
   counters order no other memory). */
#if defined(__GNUC__) || defined(__clang__)
#define seqpack_fetch_add(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#elif defined(_MSC_VER)
#include <intrin.h>
#define seqpack_fetch_add(p, v) _InterlockedExchangeAdd64((volatile long long *)(p), (long long)(v))
#endif


/* A thread's floating-point mode (on x86 the MXCSR register: rounding, flush-to-zero,
   denormals-are-zero). A pool thread keeps the mode it started with, so a parallel region
   hands the caller's to each of its threads: every thread then rounds as the caller does
   (torch.set_flush_denormal, say, changes only the calling thread's). */
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <xmmintrin.h>
typedef struct { unsigned int csr; } seqpack_fpmode;
static inline seqpack_fpmode seqpack_get_fpmode(void) { seqpack_fpmode m; m.csr = _mm_getcsr(); return m; }
static inline void seqpack_set_fpmode(seqpack_fpmode m) { _mm_setcsr(m.csr); }
#else
#include <fenv.h>
typedef struct { fenv_t env; } seqpack_fpmode;
static inline seqpack_fpmode seqpack_get_fpmode(void) { seqpack_fpmode m; fegetenv(&m.env); return m; }
static inline void seqpack_set_fpmode(seqpack_fpmode m) { fesetenv(&m.env); }
#endif

#endif
