/* The OpenMP runtime's thread limit and team size (1 without OpenMP), and an atomic counter.
   Included by the Cython module through its cdef extern block. */
#ifndef SEQPACK_OPENMP_H
#define SEQPACK_OPENMP_H

#ifdef _OPENMP
#include <omp.h>
static inline int seqpack_omp_max_threads(void) { return omp_get_max_threads(); }
/* The threads of the enclosing parallel region (1 outside one). */
static inline int seqpack_omp_team_size(void) { return omp_get_num_threads(); }
#else
static inline int seqpack_omp_max_threads(void) { return 1; }
static inline int seqpack_omp_team_size(void) { return 1; }
#endif

/* Work sharing: add v to *p and return its value before, atomically (relaxed: the
   counters order no other memory). */
#if defined(__GNUC__) || defined(__clang__)
#define seqpack_fetch_add(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#elif defined(_MSC_VER)
#include <intrin.h>
#define seqpack_fetch_add(p, v) _InterlockedExchangeAdd64((volatile long long *)(p), (long long)(v))
#endif

#endif
