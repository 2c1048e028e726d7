"""Hugging Face transformers integration: seqpack range attention inside HF models, batches
in transformers' keys and dtypes, a Trainer collator, Trainer's loss denominator and TRL's
token count.

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
from .trainers import SFTTokenCount, token_count

__all__ = ["NAME", "PackingCollator", "SFTTokenCount", "flat", "num_items_in_batch", "register", "rows",
           "seqpack_attention", "seqpack_mask", "token_count"]
