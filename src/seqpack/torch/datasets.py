"""``torch.utils.data`` datasets whose items are whole batches (dicts of tensors).

Use them with ``DataLoader(dataset, batch_size=None)``: each item already is a batch,
the dict :func:`~seqpack.torch.tensors` makes, which ``seqpack.hf.rows`` and
``seqpack.hf.flat`` take as it is.

``IterableBatchDataset`` is the training stream. Each epoch it shuffles the batches
deterministically from ``(seed, epoch)``, deals them to the ranks one step at a time
(every rank gets one batch per step; the step's batch with the most eligible targets goes
to the rank with the fewest so far, so ranks stay balanced by target count, or by pair
count for preference pairs, the denominator of a DPO mean), and lets
``DataLoader`` workers take the rank's batches in turn (worker ``w`` of ``W`` takes every
``W``-th), so a loader yields the rank's batches in order for any worker count. Its
``state_dict()`` / ``load_state_dict()`` resume exactly mid-epoch, with a plain
``DataLoader`` or with torchdata's ``StatefulDataLoader``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .._arguments import INT64_MAX, batch_index, check_bool, check_int
from ..errors import InvalidInputError
from ..packing.batches import PackedBatches
from ..packing.epoch import Epoch
from .tensors import tensors


class _Batches:
    """The batches of a plan or an opened dataset (built on demand) or of an epoch, with
    what ranks are balanced by: each batch's preference pairs when the source holds pairs,
    else its target count."""

    def __init__(self, source):
        if isinstance(source, PackedBatches):
            self.get = source.batch
            self.weights = source.batch_pairs() if source.pairs else source.batch_targets()
        elif isinstance(source, Epoch):
            self.get = source.batches.__getitem__
            self.weights = np.array([len(batch.occurrence_records) // 2 if source.pairs else batch.target_count
                                     for batch in source.batches], dtype=np.int64)
        else:
            raise InvalidInputError(
                "expected a PackingPlan, a dataset from seqpack.open_dataset or an epoch "
                f"(seqpack.pack / seqpack.pad), not {type(source).__name__}"
            )

    def __len__(self) -> int:
        return len(self.weights)


class BatchDataset(Dataset):
    """Map-style: item ``i`` is batch ``i`` of a plan, an opened dataset or an epoch as
    :func:`~seqpack.torch.tensors`."""

    def __init__(self, plan_or_epoch):
        self._batches = _Batches(plan_or_epoch)

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index) -> dict[str, torch.Tensor]:
        return tensors(self._batches.get(batch_index(index, len(self), "this dataset")))


def deal_to_ranks(weights: np.ndarray, order: np.ndarray, world_size: int) -> np.ndarray:
    """``[world_size, steps]`` batch numbers: ``order`` dealt one step (``world_size`` batches) at a time.

    ``weights[b]`` is what batch ``b`` brings a rank: its targets (a token-weighted loss),
    or its preference pairs (a DPO loss is a mean over pairs). Within a step the batch
    with the most weight goes to the rank with the least so far (ties: earlier in
    ``order``, lower rank), so every rank's total stays within one batch's weight of the
    others'. The last ``len(order) % world_size`` batches of ``order`` are left out:
    every rank must run the same number of steps.
    """
    steps = len(order) // world_size
    groups = order[: steps * world_size].reshape(steps, world_size)
    if world_size == 1:
        return groups.T.copy()
    groups = np.take_along_axis(groups, np.argsort(-weights[groups], axis=1, kind="stable"), axis=1)
    dealt = np.empty((world_size, steps), dtype=np.int64)
    totals = np.zeros(world_size, dtype=np.int64)
    for step, group in enumerate(groups):
        ranks = np.argsort(totals, kind="stable")
        dealt[ranks, step] = group
        totals[ranks] += weights[group]
    return dealt


class IterableBatchDataset(IterableDataset):
    """This rank's batches of one epoch of ``plan``, in a deterministic per-epoch order.

    ``plan`` is a plan (``seqpack.plan``), a packed dataset on disk
    (``seqpack.open_dataset``) or an epoch.

    ``shuffle`` (default True) permutes the batches with ``numpy.random.default_rng((seed,
    epoch))``; without it they come in plan order. ``rank`` and ``world_size`` default to
    ``torch.distributed``'s when it is initialized, else 0 and 1. Each rank gets
    ``len(plan) // world_size`` batches per epoch (``len(self)``); with several ranks the
    epoch's last ``len(plan) % world_size`` batches in its order are not used that epoch.
    Ranks are balanced by target count, or, for a plan of preference pairs
    (``pairs=True``), by pair count: each rank's DPO loss is a mean over its pairs, and
    dealing by pairs gives every rank a fair share of them.

    Epochs: ``set_epoch(e)`` before each epoch, as with ``DistributedSampler``; a pass
    without it repeats the current epoch. Resuming: ``state_dict()`` records the epoch and
    how many of this rank's batches were consumed (by this object's own iterator: no
    workers, or inside a worker as ``StatefulDataLoader`` asks; with a plain
    ``DataLoader`` and workers give ``consumed=``, the batches of the epoch the trainer
    took). ``load_state_dict()`` makes the next pass over that epoch start with the next
    batch; ``set_epoch`` to another epoch drops it, before the load as after it when the
    state ends its epoch (``StatefulDataLoader`` loads the state only when the next pass
    starts, after the trainer's ``set_epoch`` for the next epoch). With a plain ``DataLoader`` and
    workers the passes run in copies of this object, so the loaded state stays here and
    every pass over that epoch resumes until ``set_epoch`` moves on. Persistent workers
    (``persistent_workers=True``) keep their copies between epochs; what ``set_epoch`` and
    ``load_state_dict`` do in the main process reaches them through shared memory, so
    their next pass runs what a fresh copy would.
    """

    def __init__(self, plan, *, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None):
        self._batches = _Batches(plan)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed, 0)
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        if len(self._batches) < self.world_size:
            raise InvalidInputError(
                f"the plan has {len(self._batches)} batches for {self.world_size} ranks: every rank needs one"
            )
        self.epoch = 0
        self._position = 0  # this object's next batch, relative to its worker (see __iter__)
        self._resume = None  # (epoch, position) a loaded state starts from
        self._chosen = None  # the epoch set_epoch named since the last pass began
        # The main process's epoch and loaded state (epoch, position, 1) or (0, 0, 0), in
        # shared memory: a persistent DataLoader worker's copy takes them before each later
        # pass (its own attributes are those of the first pass).
        self._shared = torch.zeros(4, dtype=torch.int64).share_memory_()
        self._passes = 0  # passes this copy has begun
        self._loaded_here = False  # a worker's copy was handed a state for its next pass

    def __len__(self) -> int:
        return len(self._batches) // self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next (from its start, unless a loaded state resumes it)."""
        epoch = check_int("epoch", epoch, 0, INT64_MAX)
        self._chosen = epoch
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None
        self.epoch = epoch
        if self._resume is None:   # the same epoch too: a pass made or left before starts over
            self._position = 0
        self._share()

    def _share(self) -> None:
        """Publish the epoch and the loaded state to persistent workers (main process only:
        a worker's own state is its own)."""
        if get_worker_info() is None:
            resume = (*self._resume, 1) if self._resume is not None else (0, 0, 0)
            self._shared.copy_(torch.tensor((self.epoch, *resume), dtype=torch.int64))

    def rank_batches(self, epoch: int) -> np.ndarray:
        """This rank's batch numbers of ``epoch``, in order."""
        epoch = check_int("epoch", epoch, 0, INT64_MAX)
        count = len(self._batches)
        order = (np.random.default_rng((self.seed, epoch)).permutation(count) if self.shuffle
                 else np.arange(count, dtype=np.int64))
        return deal_to_ranks(self._batches.weights, order, self.world_size)[self.rank]

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        self._chosen = None
        if info is not None and self._passes and not self._loaded_here:  # a persistent worker's copy
            epoch, resume_epoch, position, resumes = self._shared.tolist()
            self.epoch, self._resume = epoch, (resume_epoch, position) if resumes else None
        self._passes += 1
        self._loaded_here = False
        if self._resume is not None:
            self.epoch, start = self._resume
            self._resume = None
            self._share()
        else:
            start = 0
        self._position = start
        # The pass is set up here, not in the generator: StatefulDataLoader saves a
        # worker's state right after iter(), before its first batch.
        return self._pass(self.rank_batches(self.epoch), start, worker, workers)

    def _pass(self, numbers: np.ndarray, start: int, worker: int, workers: int):
        # Worker w yields positions start + w, start + w + W, ...; after each, its state is
        # the base of its next one (at most the epoch's end), so a state saved in a worker
        # resumes that worker.
        for position in range(start + worker, len(numbers), workers):
            self._position = min(position - worker + workers, len(numbers))
            yield tensors(self._batches.get(int(numbers[position])))

    def _settings(self) -> dict:
        return {"seed": self.seed, "shuffle": self.shuffle, "rank": self.rank, "world_size": self.world_size,
                "batches": len(self._batches)}

    def state_dict(self, consumed: int | None = None) -> dict:
        """The position to resume from: ``{"epoch", "position"}`` plus the settings it needs."""
        position = self._position if consumed is None else check_int("consumed", consumed, 0, len(self))
        return {"epoch": self.epoch, "position": position, **self._settings()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state``: the next pass over its epoch starts at its position (at
        most ``len(self)``: the epoch's end)."""
        if not isinstance(state, dict) or not {"epoch", "position"} <= state.keys():
            raise InvalidInputError("the state must be a dict from state_dict(), with an epoch and a position")
        for name, ours in self._settings().items():
            if state.get(name) != ours:
                raise InvalidInputError(f"the state was saved with {name} {state.get(name)!r}; this dataset has {ours!r}")
        epoch = check_int("epoch", state["epoch"], 0, INT64_MAX)
        position = check_int("position", state["position"], 0, len(self))
        if position == len(self) and self._chosen is not None and self._chosen != epoch:
            return  # its epoch is over and set_epoch already moved on: nothing to resume
        self.epoch, self._position, self._resume = epoch, position, (epoch, position)
        self._loaded_here = get_worker_info() is not None
        self._share()


def _rank_and_size(rank, world_size) -> tuple[int, int]:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        rank = distributed.get_rank() if rank is None else rank
        world_size = distributed.get_world_size() if world_size is None else world_size
    elif (rank is None) != (world_size is None):
        raise InvalidInputError("give both rank and world_size, or neither (torch.distributed is not initialized)")
    elif rank is None:
        rank, world_size = 0, 1
    world_size = check_int("world_size", world_size, 1)
    rank = check_int("rank", rank, 0, world_size - 1)
    return rank, world_size
