"""Hugging Face transformers integration: seqpack range attention inside HF models, batches
in transformers' keys and dtypes, a Trainer collator, Trainer's loss denominator, TRL's
token count, packed evaluation (per-example NLL sums and a token-weighted ``eval_loss``), and
packed preference pairs for TRL's ``DPOTrainer``.

Importable only with transformers and PyTorch (``pip install 'seqpack[hf]'``); ``import
seqpack`` never imports them. ``seqpack.hf.register()`` makes ``attn_implementation="seqpack"``
available to every model that dispatches through ``transformers.AttentionInterface``.
"""

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in an environment without the extra
    raise ImportError(
        f"seqpack.hf needs transformers and PyTorch ({error.name} is not installed): "
        "pip install 'seqpack[hf]'"
    ) from error

from .attention import NAME, register, seqpack_attention, seqpack_mask
from .collators import PackingCollator, flat, num_items_in_batch, rows
from .evaluation import Evaluation, TokenWeightedEvaluation, evaluate
from .preference import PreferenceCollator
from .trainers import PackedDPO, SFTTokenCount, token_count

__all__ = ["NAME", "Evaluation", "PackedDPO", "PackingCollator", "PreferenceCollator", "SFTTokenCount",
           "TokenWeightedEvaluation", "evaluate", "flat", "num_items_in_batch", "register", "rows",
           "seqpack_attention", "seqpack_mask", "token_count"]
