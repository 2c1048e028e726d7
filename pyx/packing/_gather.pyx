"""Gathering token ranges into one array, each range at a given place.

``gather_ranges`` copies ``source[begins[i]:ends[i]]`` to ``out[at[i]:]`` for every ``i``
(converting the token type), so examples scattered across a corpus become one
sequential run: a packed dataset writes its tokens in placement order this way. The
kernel trusts its arguments: ranges inside ``source`` and their targets inside ``out``
(``seqpack.packing.gather`` checks). Interruptible: Ctrl-C raises ``KeyboardInterrupt``
within ~20 ms, ``out`` then undefined.
"""

from libc.stdint cimport int32_t, int64_t, uint16_t
from libc.string cimport memcpy

from _interrupt cimport Interrupt, interrupt_finish, interrupt_start, interrupted

ctypedef fused source_t:
    uint16_t
    int32_t

ctypedef fused out_t:
    uint16_t
    int32_t

# Ranges between two looks at pending signals.
cdef enum:
    CHECK_EVERY = 1 << 12


def gather_ranges(
    const source_t[::1] source not None,      # tokens
    const int64_t[::1] begins not None,       # [n] range i is source[begins[i]:ends[i]]
    const int64_t[::1] ends not None,         # [n]
    out_t[::1] out not None,                  # the gathered tokens
    const int64_t[::1] at not None,           # [n] range i goes to out[at[i]:at[i] + ends[i] - begins[i]]
):
    """Copy every range of ``source`` to its place in ``out`` (one memcpy per range when
    the types agree, a converting loop otherwise)."""
    cdef Py_ssize_t i, j, length, target
    cdef Interrupt interrupt
    with nogil:
        interrupt_start(&interrupt)
        for i in range(begins.shape[0]):
            if (i & (CHECK_EVERY - 1)) == 0 and interrupted(&interrupt):
                break
            length = ends[i] - begins[i]
            if length <= 0:
                continue
            target = at[i]
            if source_t is out_t:
                memcpy(&out[target], &source[begins[i]], length * sizeof(out_t))
            else:
                for j in range(length):
                    out[target + j] = <out_t>source[begins[i] + j]
    interrupt_finish(&interrupt)
