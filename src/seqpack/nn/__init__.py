"""The model layer: a micrograd-sized autograd tape, its ops, range attention, the loss and
per-occurrence log-probabilities, a decoder.

The numpy kernels' APIs (``range_attention_forward``/``backward``,
``range_softmax_forward``/``backward``) work on plain arrays; the tape ops and the
reference :class:`Decoder` run separate, padded and packed execution with one model.
"""

from .attention import (
    causal_attention,
    causal_attention_with_lengths,
    causal_attention_with_ranges,
    fused_range_attention,
    range_attention_backward,
    range_attention_forward,
    segment_spans,
)
from .autograd import Tensor
from .decoder import Decoder, DecoderConfig, DecoderForward
from .loss import MaskedLoss, masked_loss, masked_nll
from .sequences import OccurrenceLogprobs, sequence_logprobs
from .softmax import range_softmax, range_softmax_backward, range_softmax_forward

__all__ = [
    "Decoder", "DecoderConfig", "DecoderForward", "MaskedLoss", "OccurrenceLogprobs", "Tensor", "causal_attention",
    "causal_attention_with_lengths", "causal_attention_with_ranges", "fused_range_attention", "masked_loss",
    "masked_nll", "range_attention_backward", "range_attention_forward", "range_softmax",
    "range_softmax_backward", "range_softmax_forward", "segment_spans", "sequence_logprobs",
]
