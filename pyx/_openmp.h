/* The OpenMP runtime's thread limit (1 without OpenMP).
   Included by the Cython module through its cdef extern block. */
#ifndef SEQPACK_OPENMP_H
#define SEQPACK_OPENMP_H

#ifdef _OPENMP
#include <omp.h>
static int seqpack_omp_max_threads(void) { return omp_get_max_threads(); }
#else
static int seqpack_omp_max_threads(void) { return 1; }
#endif

#endif
