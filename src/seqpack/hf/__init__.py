"""Hugging Face transformers integration: seqpack range attention inside HF models, batches
in transformers' keys and dtypes, a Trainer collator and Trainer's loss denominator.

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

__all__ = ["NAME", "PackingCollator", "flat", "num_items_in_batch", "register", "rows", "seqpack_attention",
           "seqpack_mask"]
