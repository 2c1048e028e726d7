"""seqpack: pad and pack variable-length causal-LM examples without joining their contexts.

Each section below re-exports the public names of one module.
"""

__version__ = "0.1.0"

# --- errors ---
from .errors import (
    BindingError,
    CapacityError,
    DecodeLimitError,
    InvalidInputError,
    MetadataBudgetError,
    SeqpackError,
    TokenizerError,
    VerificationError,
)

# --- placement ---
from .placement import Placement, lower_bound_rows, place, placement_bytes, real_target_fraction

# --- tokenizer ---
from .tokenizer import ByteTokenizer, DecodeLimits, TokenizerIdentity

# --- binding ---
from .binding import BatchBinding, Partition, SplitReceipt

# --- documents ---
from .documents import BatchDocument

# --- windows ---
from .windows import (
    BatchOrder,
    CausalWindow,
    CausalWindowConfig,
    MiniBatch,
    MiniBatchConfig,
    MiniBatchEpoch,
)

# --- examples ---
from .examples import SequenceExample

# --- batch ---
from .batch import (
    NO_SEGMENT,
    PAD_CELL,
    BatchLayout,
    LayoutCounts,
    Occurrence,
    VariableBatch,
    VariableBatchConfig,
    VariableBatchEpoch,
)

# --- packing ---
from .packing import (
    EfficiencyReport,
    PackConfig,
    PackedBatch,
    PackedBatchEpoch,
    PackingPlan,
    efficiency_report,
    pack_examples,
    plan_packing,
    stream_packed_batches,
)

# --- table ---
from .table import ExampleTable

# --- autograd ---
from .autograd import Tensor

# --- functional ---
from .functional import (
    causal_attention,
    causal_attention_with_lengths,
    causal_attention_with_ranges,
    range_softmax_backward,
    range_softmax_forward,
)

# --- loss ---
from .loss import MaskedLoss, constructed_logits, loss_probe, masked_loss

# --- decoder ---
from .decoder import Decoder, DecoderConfig, DecoderForward

# --- attention ---
from .attention import range_attention_backward, range_attention_forward, segment_spans
