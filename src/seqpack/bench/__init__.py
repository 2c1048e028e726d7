"""The ``seqpack bench`` harness: every method on the same inputs in one process, ratios in one run."""
