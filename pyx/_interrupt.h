/* The monotonic clock and stop flag of interruptible kernels (see _interrupt.pxd).
   Included by the Cython module through its cdef extern block. */
#ifndef SEQPACK_INTERRUPT_H
#define SEQPACK_INTERRUPT_H

#if defined(_WIN32)
#include <windows.h>
static double seqpack_monotonic_seconds(void) { return (double)GetTickCount64() / 1000.0; }
#else
#include <time.h>
static double seqpack_monotonic_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}
#endif
/* The stop flag is written by one thread and read by all: relaxed atomics keep it a
   well-defined race. */
#if defined(__GNUC__) || defined(__clang__)
#define seqpack_load_flag(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define seqpack_store_flag(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#else
#define seqpack_load_flag(p) (*(volatile int *)(p))
#define seqpack_store_flag(p, v) (*(volatile int *)(p) = (v))
#endif
/* Seconds between two looks at pending signals. */
#define SEQPACK_CHECK_SECONDS 0.02

#endif
