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
/* A pause of about 0.1 ms (1 ms on Windows): the calling thread's wait between looks at
   its other threads' progress and at pending signals once it has no work left. */
#if defined(_WIN32)
static inline void seqpack_pause(void) { Sleep(1); }
#else
static inline void seqpack_pause(void)
{
    struct timespec pause = {0, 100000};
    nanosleep(&pause, NULL);
}
#endif
/* Seconds between two looks at pending signals. */
#define SEQPACK_CHECK_SECONDS 0.02

#endif
