"""Scale-out on Ray (the ``ray`` extra): :func:`pack_corpus` packs a corpus across a
cluster, one Ray task per shard, into the same packed dataset, byte for byte, as
:func:`seqpack.io.shards.pack_sharded` gives serially with the same shards. Ray itself
is imported only when a function runs, with an error naming the extra if it is missing.
"""

from .pipeline import pack_corpus

__all__ = ["pack_corpus"]
