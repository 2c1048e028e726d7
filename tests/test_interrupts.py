"""Ctrl-C stops every long kernel within 0.5 s (test family 18).

Each case runs in a fresh subprocess: it builds an input that keeps one kernel busy for
seconds, makes one small call first (so imports and lazy loading are over), says "ready",
calls the kernel and says "returned" if the call ever comes back. The test sends SIGINT
0.3 s into the call; the child reports the moment the KeyboardInterrupt reached Python
(``time.monotonic`` is one clock for both processes) and the source file of the innermost
frame it came from, which must be a kernel's ``.pyx``: the signal was seen inside the
kernel, not in Python code around it. A kernel that ignored the signal would run to its
end, print "returned" and only then be interrupted.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name != "posix", reason="POSIX signals")]

SETUP = {
    "attention forward": """
        import numpy as np, seqpack as sp
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((4, 8, 8192, 64)).astype(np.float32) for _ in range(3))
        lengths, starts = np.full(4, 8192), np.zeros((4, 8192), np.int64)
        call = lambda: sp.range_attention_forward(q, k, v, lengths, starts, threads=2)
        sp.range_attention_forward(q[:1, :1, :64], k[:1, :1, :64], v[:1, :1, :64], lengths[:1] * 0 + 64,
                                   starts[:1, :64])
    """,
    "attention backward": """
        import numpy as np, seqpack as sp
        rng = np.random.default_rng(0)
        q, k, v, out, dout = (rng.standard_normal((4, 8, 8192, 64)).astype(np.float32) for _ in range(5))
        lse = np.full((4, 8, 8192), 5.0, np.float32)
        lengths, starts = np.full(4, 8192), np.zeros((4, 8192), np.int64)
        call = lambda: sp.range_attention_backward(q, k, v, out, lse, dout, lengths, starts, threads=2)
        small = (x[:1, :1, :64] for x in (q, k, v, out, lse, dout))
        sp.range_attention_backward(*small, lengths[:1] * 0 + 64, starts[:1, :64])
    """,
    "attention, a long segment on the other thread": """
        # The calling thread's short item ends first; it must keep looking for signals while
        # the other thread runs the long one (it waited for it: review).
        import numpy as np, seqpack as sp
        q = np.random.default_rng(0).standard_normal((1, 1, 32064, 64)).astype(np.float32)
        lengths, starts = np.array([32064]), np.zeros((1, 32064), np.int64)
        starts[0, 32000:] = 32000
        call = lambda: [sp.range_attention_forward(q, q, q, lengths, starts, threads=2) for _ in range(4)]
        warm = q[:, :, :4096]  # two segments: both threads start, as in the call
        sp.range_attention_forward(warm, warm, warm, lengths * 0 + 4096, starts[:, :4096] * 0 + [[0] * 2048 + [2048] * 2048], threads=2)
    """,
    "next-fit": """
        import numpy as np, seqpack as sp
        lengths = np.full(60_000_000, 37, np.int64)
        call = lambda: sp.place(lengths, 2048, "next-fit")
        sp.place(lengths[:8], 2048, "next-fit")
    """,
    "first-fit-decreasing": """
        import numpy as np, seqpack as sp
        lengths = np.full(40_000_000, 37, np.int64); lengths[::3] = 200
        call = lambda: sp.place(lengths, 2048, "first-fit-decreasing")
        sp.place(lengths[:8], 2048, "first-fit-decreasing")
    """,
    "best-fit-decreasing": """
        import numpy as np, seqpack as sp
        lengths = np.full(40_000_000, 37, np.int64); lengths[::3] = 200
        call = lambda: sp.place(lengths, 2048, "best-fit-decreasing")
        sp.place(lengths[:8], 2048, "best-fit-decreasing")
    """,
    "longest first by digits": """
        import numpy as np, seqpack as sp
        lengths = np.random.default_rng(0).integers(1, 2**30, 20_000_000)  # a capacity past a counter per length
        call = lambda: sp.place(lengths, 2**30, "first-fit-decreasing")
        sp.place(lengths[:8], 2**30, "first-fit-decreasing")
    """,
    "stable order": """
        import numpy as np
        from seqpack.packing.placement import stable_order
        keys = np.random.default_rng(0).integers(0, 2**40, 30_000_000)  # a plan's (row, start) keys
        call = lambda: stable_order(keys, 2**40)
        stable_order(keys[:8], 2**40)
    """,
    "masked loss forward": """
        import numpy as np
        from seqpack.nn import _loss
        logits = np.ones((2048, 32768), np.float32)
        rows, gold = np.arange(2048, dtype=np.intp), np.zeros(2048, np.int32)
        normalizers, losses = np.empty((2048, 2)), np.empty(2048)
        call = lambda: [_loss.indexed_nll_forward(logits, rows, gold, normalizers, losses) for _ in range(40)]
    """,
    "masked loss backward": """
        import numpy as np
        from seqpack.nn import _loss
        logits = np.ones((2048, 32768), np.float32)
        rows, gold = np.arange(2048, dtype=np.intp), np.zeros(2048, np.int32)
        normalizers, dlogits = np.tile([1.0, 10.4], (2048, 1)), np.zeros_like(logits)
        call = lambda: [_loss.indexed_nll_backward(logits, rows, gold, normalizers, 1.0, dlogits) for _ in range(40)]
    """,
    "sequence log-probabilities backward": """
        import numpy as np
        from seqpack.nn import _loss
        logits = np.ones((2048, 32768), np.float32)
        rows, gold = np.arange(2048, dtype=np.intp), np.zeros(2048, np.int32)
        normalizers, dlogits = np.tile([1.0, 10.4], (2048, 1)), np.zeros_like(logits)
        offsets, weights = np.array([0, 1000, 1000, 2048], np.int64), np.ones(3)
        call = lambda: [_loss.occurrence_logprob_backward(logits, rows, gold, normalizers, offsets, weights, dlogits)
                        for _ in range(40)]
    """,
    "range softmax": """
        import numpy as np
        from seqpack.nn import _softmax
        scores = np.ones((4, 2048, 2048))
        lengths, starts = np.full(4, 2048, np.int64), np.zeros((4, 2048), np.int32)
        out = np.empty_like(scores)
        call = lambda: [_softmax.range_softmax_forward(scores, lengths, starts, out) for _ in range(40)]
    """,
    "epoch fill": """
        import numpy as np
        from seqpack.layout import _fill
        n = 40_000_000  # one-prediction examples, 16 to a row
        tokens = np.tile(np.array([0, 5, 1], np.int32), n)
        begins = np.arange(0, 3 * n, 3, dtype=np.int64)
        ends = begins + 2  # built here: inside the call, its 320 MB took longer than the wait for SIGINT
        rows, starts = np.arange(n, dtype=np.int64) // 16, np.arange(n, dtype=np.int64) % 16
        segments = np.arange(n, dtype=np.int32)
        cells, flags = np.empty((4, n // 16, 16), np.int32), np.empty((3, n // 16, 16), np.uint8)
        lengths = np.empty(n // 16, np.int64)
        every = np.zeros(0, np.uint8)  # every target supervised
        call = lambda: _fill.fill_rows(tokens, every, begins, ends, rows, starts, segments, cells, flags, lengths, 2)
        _fill.fill_rows(tokens, every, begins[:16], ends[:16], rows[:16], starts[:16], segments[:16], cells[:, :1],
                        flags[:, :1], lengths[:1], 2)
    """,
    "table validation": """
        import numpy as np, seqpack as sp
        n = 60_000_000  # documents [BOS, 5, EOS]
        tokens = np.tile(np.array([0, 5, 1], np.int32), n)
        offsets = np.arange(0, 3 * n + 1, 3, dtype=np.int64)
        from seqpack.data import _validate
        pieces, copy = np.ones(266, np.int64), np.empty_like(tokens)
        # One pass takes ~0.2 s on a fast core, less than the wait before SIGINT: repeat it.
        call = lambda: [_validate.first_bad_document(tokens, offsets, pieces, 266, 0, 1, np.zeros(0, np.uint8), 10, 10, copy, 2)
                        for _ in range(20)]
    """,
    "table validation, a run of long documents": """
        # The kernel looked at signals once per 4096 documents of a run, whatever their size: a
        # run of long documents went unlooked for seconds (review). 63 runs' worth of short
        # documents, then 125 of 2M tokens.
        import numpy as np
        from seqpack.data import _validate
        sizes = np.concatenate((np.full(63 * 125, 3), np.full(125, 2_000_000)))
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        tokens = np.full(offsets[-1], 5, np.int32)
        tokens[offsets[:-1]], tokens[offsets[1:] - 1] = 0, 1
        pieces, copy = np.ones(266, np.int64), np.empty_like(tokens)
        call = lambda: [_validate.first_bad_document(tokens, offsets, pieces, 266, 0, 1, np.zeros(0, np.uint8),
                                                     2_000_000, 2_000_000, copy, 2) for _ in range(4)]
    """,
}


def run_and_interrupt(setup: str) -> tuple[float, float, str]:
    """Seconds from SIGINT to the KeyboardInterrupt and to the child's exit; the file it came from."""
    # A process started in the background by a shell without job control inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: the child restores it.
    script = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    script += textwrap.dedent(setup) + textwrap.dedent("""
        import sys, time, traceback
        print("ready", flush=True)
        try:
            call()
            print("returned", flush=True)
        except KeyboardInterrupt:
            where = traceback.extract_tb(sys.exc_info()[2])[-1].filename
            print("interrupted", time.monotonic(), where, flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(0.3)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        child.wait(timeout=120)
        exited = time.monotonic() - sent
        out = child.stdout.read()
        assert "returned" not in out, "the call ran to its end: the signal was not seen inside the kernel"
        words = out.split()
        assert words[:1] == ["interrupted"], child.stderr.read()
        return float(words[1]) - sent, exited, words[2]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("kernel", list(SETUP))
def test_sigint_stops_the_kernel_within_half_a_second(kernel):
    raised, exited, where = run_and_interrupt(SETUP[kernel])
    print(f"{kernel}: KeyboardInterrupt {raised:.3f} s after SIGINT from {where}, exit after {exited:.3f} s")
    assert where.endswith(".pyx"), "the signal was seen outside the kernel"
    assert raised < 0.5
    assert exited < 5  # releasing gigabytes of input takes the rest
