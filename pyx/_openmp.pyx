"""The OpenMP runtime's thread limit, so that seqpack's default follows it.

``omp_get_max_threads()`` reflects ``OMP_NUM_THREADS`` and any later
``omp_set_num_threads`` (threadpoolctl's ``threadpool_limits`` calls it), and
``omp_get_thread_limit()`` reflects ``OMP_THREAD_LIMIT``, for the runtime the kernels
are linked with; 1 in a build without OpenMP.
"""

cdef extern from "_openmp.h":
    int seqpack_omp_max_threads() noexcept nogil
    int SEQPACK_OPENMP

#: Whether the kernels were compiled with OpenMP (setup.py builds them single-threaded
#: with a compiler that has none).
BUILT_WITH_OPENMP = bool(SEQPACK_OPENMP)


def max_threads():
    """The lesser of the OpenMP runtime's ``omp_get_max_threads()`` and
    ``omp_get_thread_limit()`` (1 without OpenMP)."""
    return seqpack_omp_max_threads()
