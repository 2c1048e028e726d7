"""The OpenMP runtime's thread limit, so that seqpack's default follows it.

``omp_get_max_threads()`` reflects ``OMP_NUM_THREADS`` and any later
``omp_set_num_threads`` (threadpoolctl's ``threadpool_limits`` calls it), for the
runtime the kernels are linked with; 1 in a build without OpenMP.
"""

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int seqpack_omp_max_threads(void) { return omp_get_max_threads(); }
    #else
    static int seqpack_omp_max_threads(void) { return 1; }
    #endif
    """
    int seqpack_omp_max_threads() noexcept nogil


def max_threads():
    """The OpenMP runtime's ``omp_get_max_threads()`` (1 without OpenMP)."""
    return seqpack_omp_max_threads()
