# Shared C types of the seqpack kernels (cimport only; no runtime module).
from libc.stdint cimport int32_t, int64_t, uint8_t

# Token IDs, positions, segments and per-query segment starts are stored as int32.
ctypedef int32_t cell_t
# Boolean batch fields are numpy bool arrays, viewed as uint8 by the kernels.
ctypedef uint8_t flag_t

# Kernels that make sense in both precisions are written once over this type.
ctypedef fused real:
    float
    double
