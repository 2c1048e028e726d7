"""Helpers shared by the tests: finite differences and the layouts they probe."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np


def numerical_gradient(objective: Callable[[], float], array: np.ndarray, step: float = 1e-6) -> np.ndarray:
    """Central differences ``(f(x + h) - f(x - h)) / 2h`` of ``objective()`` in each entry of ``array``.

    ``array`` (C-contiguous, so that its flat view aliases it) is perturbed in place, one
    entry at a time, and restored exactly.
    """
    if not array.flags.c_contiguous:
        raise AssertionError("numerical_gradient needs a C-contiguous array")
    gradient = np.zeros(array.shape)
    flat = array.reshape(-1)
    for index in range(flat.size):
        saved = flat[index]
        flat[index] = saved + step
        upper = objective()
        flat[index] = saved - step
        lower = objective()
        flat[index] = saved
        gradient.reshape(-1)[index] = (upper - lower) / (2 * step)
    return gradient


def write_jsonl(path, texts):
    """A JSONL file of ``{"text": ...}`` lines at ``path``; returns the path."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def reseal(directory, manifest: dict) -> None:
    """Write ``manifest`` (edited on purpose) into the dataset at ``directory``, sealed
    again, so that a test reaches the checks behind the seal."""
    from pathlib import Path

    from seqpack.io import format as fmt

    (Path(directory) / fmt.MANIFEST).write_text(json.dumps(fmt.seal(manifest)))


def train_bpe(directory, lines, vocab_size: int = 320,
              specials=("<unk>", "<|bos|>", "<|eos|>", "<|pad|>")):
    """A byte-level BPE trained on ``lines``, saved as ``directory/tokenizer.json``; returns the path."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    corpus = directory / "bpe-train.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    tokenizer = Tokenizer(models.BPE(unk_token=specials[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(corpus)], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def run_on_gloo_ranks(check: Callable[[int, int], None], world_size: int = 2) -> None:
    """``check(rank, world_size)`` in ``world_size`` spawned processes joined by a ``gloo``
    group on loopback; an assertion that fails in any rank fails the caller with its traceback.

    ``check`` must be a module-level function (it is pickled by name)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_gloo_rank, args=(world_size, port, check), nprocs=world_size, join=True)


def _gloo_rank(rank: int, world_size: int, port: int, check: Callable[[int, int], None]) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        check(rank, world_size)
        dist.barrier()  # no rank tears gloo down while its peer still talks to it
    finally:
        dist.destroy_process_group()
    # End as a forked multiprocessing child ends, without the interpreter's teardown: a gloo
    # worker thread may still hold a finished collective's tensors, and dropping them takes
    # the GIL, which finalization refuses by ending the thread inside C++ (std::terminate,
    # SIGABRT: about once in a hundred runs under load with torch 2.13, seen in a core dump).
    os._exit(0)
