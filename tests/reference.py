"""Plain-Python references: obviously correct, cell by cell, slow.

The tests check the kernels against these, and the benchmarks time them.
"""

from __future__ import annotations


def next_fit_placements(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """``(row, start)`` of each example: a new row whenever the current one lacks room."""
    placements = []
    row, used = -1, capacity
    for length in lengths:
        if length > capacity - used:
            row, used = row + 1, 0
        placements.append((row, used))
        used += length
    return placements


def packed_rows(sources: list[list[int]], capacity: int, rows_per_batch: int) -> list[dict]:
    """Every field of every packed call, built cell by cell from the examples' source tokens."""
    placements = next_fit_placements([len(s) - 1 for s in sources], capacity)
    row_count = placements[-1][0] + 1 if placements else 0
    in_call = [[] for _ in range(0, row_count, rows_per_batch)]  # each call's examples, in input order
    for ordinal, (source, (row, start)) in enumerate(zip(sources, placements)):
        in_call[row // rows_per_batch].append((ordinal, source, row, start))
    calls = []
    for first_row in range(0, row_count, rows_per_batch):
        rows = min(rows_per_batch, row_count - first_row)
        fields = {
            "inputs": [[-1] * capacity for _ in range(rows)],
            "targets": [[-1] * capacity for _ in range(rows)],
            "positions": [[0] * capacity for _ in range(rows)],
            "segments": [[-1] * capacity for _ in range(rows)],
            "segment_starts": [[0] * capacity for _ in range(rows)],
            "valid": [[False] * capacity for _ in range(rows)],
            "valid_lengths": [0] * rows,
            "occurrences": [],
        }
        for ordinal, source, row, start in in_call[first_row // rows_per_batch]:
            local = row - first_row
            for j in range(len(source) - 1):
                fields["inputs"][local][start + j] = source[j]
                fields["targets"][local][start + j] = source[j + 1]
                fields["positions"][local][start + j] = j
                fields["segments"][local][start + j] = ordinal
                fields["segment_starts"][local][start + j] = start
                fields["valid"][local][start + j] = True
            stop = start + len(source) - 1
            fields["valid_lengths"][local] = max(fields["valid_lengths"][local], stop)
            fields["occurrences"].append((ordinal, local, range(start, stop), ordinal))
        calls.append(fields)
    return calls
