"""Scale-out on Ray (the ``ray`` extra): :func:`pack_corpus` packs a corpus across a
cluster, one Ray task per shard, into the same packed dataset, byte for byte, as
:func:`seqpack.io.pack_corpus` gives with the same arguments and shards;
:func:`run_on_ray` runs a :class:`~seqpack.io.PackJob` built once (as the command line
does). Ray itself is imported only when a function runs, with an error naming the extra
if it is missing.
"""

from .pipeline import pack_corpus, run_on_ray

__all__ = ["pack_corpus", "run_on_ray"]
