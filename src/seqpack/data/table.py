"""Columnar examples: one flat token array, document offsets, optional per-example ranges.

An ``ExampleTable`` holds millions of examples without one Python object each.
Documents are validated in bulk by a kernel (framing, control IDs, vocabulary,
decode limits, content) and ranges by another (document, bounds, length).
Every error names the example, and packing a table gives exactly what packing
the equivalent ``SequenceExample`` list gives.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .._arguments import INT32_MAX, check_bool, check_choice, check_int, integer_array, shown
from .._read_only import ReadOnlyArrays
from .._threads import check_threads, kernel_threads
from ..errors import DecodeLimitError, InvalidInputError, SeqpackError
from . import _validate
from .binding import BatchBinding, Partition, check_expectations
from .documents import BatchDocument
from .examples import SequenceExample
from .supervision import as_supervision, target_counts
from .windows import refuse_long, window_ranges

LONG_DOCUMENTS = ("error", "cut")
# Token arrays at least this long are validated by every kernel thread.
PARALLEL_TOKENS = 1 << 20


def _int_array(name: str, values, dtype, ndim: int, copy: bool = True) -> np.ndarray:
    """Integer ``values`` as a C-contiguous array: a read-only copy the table owns, or
    (``copy=False``) possibly the caller's own array, to be copied later."""
    array = integer_array(name, values, dtype, ndim)
    if not copy:
        return array
    result = np.array(array, dtype=dtype, order="C", copy=True)
    result.flags.writeable = False
    return result


class ExampleTable(ReadOnlyArrays):
    """Examples as arrays: document ``d`` is ``token_ids[offsets[d]:offsets[d + 1]]``.

    Every document must be valid under the binding and have content. Without
    ``ranges`` every document is one full-document example. With ``ranges``
    (``[n, 2]`` start/stop pairs inside their documents) example ``i`` is the range of
    document ``documents[i]`` (default: document ``i``). ``ids`` names the examples
    (default ``"#i"``). All examples share one partition and binding. ``supervised``
    (None: every target) says which tokens, as targets, count in the loss;
    ``target_counts`` holds each example's supervised targets (``lengths`` without it).
    """

    #: An example source (see ``seqpack.layout.ExampleSource``): ``gather`` hands over
    #: the table's own token array, and nothing is held per example beyond it.
    copies_tokens = False
    held_bytes_per_example = 0

    def __init__(self, tokens, doc_offsets, begins, ends, binding, partition, ids, index_base=0,
                 supervised=None, counts=None):
        # Internal: use from_arrays, which validates. ``index_base`` is the position of
        # this table's first example in the table it was cut from (for default names);
        # ``first_ordinal`` is the occurrence ordinal packing gives it (0 unless streamed).
        self.binding = binding
        self.partition = partition
        self._tokens = tokens
        self._doc_offsets = doc_offsets
        self._begins = begins
        self._ends = ends
        self._ids = ids
        self._index_base = index_base
        self.first_ordinal = 0
        lengths = ends - begins - 1
        lengths.flags.writeable = False
        self.lengths = lengths
        self.supervised = supervised
        self.target_counts = lengths if supervised is None else (
            counts if counts is not None else target_counts(supervised, begins, ends))

    @classmethod
    def from_arrays(
        cls,
        token_ids,
        offsets,
        binding: BatchBinding,
        *,
        partition: Partition = Partition.TRAIN,
        ranges=None,
        documents=None,
        ids: Sequence[str] | None = None,
        threads: int | None = None,
        supervised=None,
        as_given: bool = False,
    ) -> "ExampleTable":
        """Validate the documents and ranges in bulk and build the table (arrays are copied).

        Documents are framed ``[BOS, content..., EOS]`` under ``binding``, or with
        ``as_given`` any IDs of its vocabulary: fine-tuning records exactly as their
        tokenizer or chat template made them (EOS inside, no BOS), as TRL trains on them.

        ``supervised`` (None: all) is a bool array over ``token_ids``: ``supervised[j]``
        says whether token ``j``, as a target, counts in the loss (a document's first
        token is never a target). An example none of whose targets is supervised is an
        error naming it. ``threads`` (None: ``seqpack._threads.default_threads()``) split the validation of
        a large token array; the result never depends on it.
        """
        check_expectations(partition, binding)
        threads = check_threads(threads)
        # The validation kernel copies the tokens into the table as it scans them.
        supplied = _int_array("token_ids", token_ids, np.int32, 1, copy=False)
        tokens = np.empty_like(supplied)
        doc_offsets = _int_array("offsets", offsets, np.int64, 1)
        _check_offsets(doc_offsets, tokens.shape[0])
        doc_count = doc_offsets.shape[0] - 1
        if ranges is None:
            if documents is not None:
                raise InvalidInputError("documents selects ranges; give ranges too")
            begins, ends = doc_offsets[:-1].copy(), doc_offsets[1:].copy()
            example_docs = np.arange(doc_count, dtype=np.int64)
        else:
            spans = _int_array("ranges", ranges, np.int64, 2)
            if spans.shape[1:] != (2,):
                raise InvalidInputError(f"ranges must have shape [n, 2], got {spans.shape}")
            if documents is None:
                if spans.shape[0] != doc_count:
                    raise InvalidInputError(
                        f"{spans.shape[0]} ranges for {doc_count} documents: give documents= to map them"
                    )
                example_docs = np.arange(doc_count, dtype=np.int64)
            else:
                example_docs = _int_array("documents", documents, np.int64, 1)
                if example_docs.shape[0] != spans.shape[0]:
                    raise InvalidInputError(
                        f"documents has {example_docs.shape[0]} entries for {spans.shape[0]} ranges"
                    )
            if ids is not None:
                ids = _check_ids(ids, spans.shape[0])
            begins, ends = _check_ranges(spans, example_docs, doc_offsets, ids)
        if ids is not None and ranges is None:
            ids = _check_ids(ids, begins.shape[0])
        if begins.shape[0] == 0:
            raise InvalidInputError("an example table needs at least one example")
        supervised = as_supervision(supervised, tokens.shape[0], "supervised")
        table = cls(tokens, doc_offsets, begins, ends, binding, partition, ids, supervised=supervised)
        table._check_documents(example_docs, supplied, threads, check_bool("as_given", as_given))
        unsupervised = np.flatnonzero(table.target_counts == 0)
        if unsupervised.size:
            index = int(unsupervised[0])
            raise InvalidInputError(f"example {table.example_id(index)!r} (index {index}): none of its "
                                    f"{int(table.lengths[index])} targets is supervised")
        tokens.flags.writeable = False
        return table

    @classmethod
    def from_texts(
        cls,
        texts: Sequence[str | bytes],
        binding: BatchBinding,
        *,
        capacity: int,
        long: str = "error",
        partition: Partition = Partition.TRAIN,
        ids: Sequence[str] | None = None,
    ) -> "ExampleTable":
        """Tokenize raw texts with the binding's tokenizer into a table of whole documents.

        Each text becomes one framed document ``[BOS, content..., EOS]``. A document
        with more than ``capacity`` predictions (``capacity + 1`` tokens) is an error
        naming it (``long="error"``, the default), or (``long="cut"``) is cut into the
        overlapping ranges of :func:`~seqpack.data.window_ranges`, so that every
        prediction appears exactly once and no range adds BOS or EOS; nothing is ever
        truncated. ``ids`` names the texts (default ``"#i"``, ``i`` the text's index); the
        examples of a cut text are named ``"name[start:stop]"``, its token range.
        """
        capacity = check_int("capacity", capacity, maximum=INT32_MAX)
        check_choice("long", long, LONG_DOCUMENTS)
        check_expectations(partition, binding)
        if binding.tokenizer is None:
            raise InvalidInputError("from_texts needs a binding with a tokenizer to encode the texts")
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Iterable):
            raise InvalidInputError(f"texts must be a sequence of str or bytes, not "
                                    f"{'a single text' if isinstance(texts, (str, bytes)) else type(texts).__name__}")
        texts = list(texts)
        names = None if ids is None else _check_ids(ids, len(texts))
        _check_text_bytes(texts, binding.limits.max_bytes, names)
        documents = []
        for index, text in enumerate(texts):
            try:
                documents.append(binding.tokenizer.encode_document(text))
            except SeqpackError as error:
                name = names[index] if names is not None else f"#{index}"
                raise error.within(f"text {name!r} (index {index})") from None
        if not documents:
            raise InvalidInputError("an example table needs at least one example")
        lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        tokens = np.concatenate(documents)
        if long == "error":
            def text(index: int) -> str:
                name = names[index] if names is not None else f"#{index}"
                return f"text {name!r} (index {index})"

            refuse_long(lengths - 1, capacity, text, hint=" (long='cut' cuts it into overlapping windows)")
            return cls.from_arrays(tokens, offsets, binding, partition=partition, ids=names)
        which, ranges = window_ranges(lengths, capacity)
        names = names if names is not None else [f"#{index}" for index in range(len(texts))]
        whole = lengths.tolist()
        cut_ids = [names[d] if (a, b) == (0, whole[d]) else f"{names[d]}[{a}:{b}]"
                   for d, (a, b) in zip(which.tolist(), ranges.tolist())]
        return cls.from_arrays(tokens, offsets, binding, partition=partition, ranges=ranges,
                               documents=which, ids=cut_ids)

    def _check_documents(self, example_docs: np.ndarray, supplied: np.ndarray, threads: int | None,
                         as_given: bool) -> None:
        """Validate every document of ``supplied`` in bulk while copying it into the table;
        raise naming the first example that uses a bad document."""
        binding = self.binding
        if binding.tokenizer is not None:
            pieces = binding.tokenizer.piece_lengths
        else:  # a tokenizer seqpack does not decode: no bytes to count, nothing sized by V
            pieces = np.empty(0, dtype=np.int64)
        threads = kernel_threads(threads) if supplied.shape[0] >= PARALLEL_TOKENS else 1
        given = np.full(self.document_count if as_given else 0, 1, dtype=np.uint8)
        document, fault = _validate.first_bad_document(
            supplied, self._doc_offsets, pieces, binding.vocabulary_size, binding.kernel_bos, binding.eos_id,
            given, binding.limits.max_tokens, binding.limits.max_bytes, self._tokens, threads,
        )
        if document < 0:
            return
        users = np.flatnonzero(example_docs == document)
        name = f"example {self.example_id(int(users[0]))!r} (index {users[0]}), " if users.size else ""
        tokens = supplied[self._doc_offsets[document] : self._doc_offsets[document + 1]]
        if fault == _validate.DocumentFault.EMPTY_CONTENT:
            what = f"{len(tokens)} token{'s' if len(tokens) != 1 else ''}" if as_given else "empty content"
            raise InvalidInputError(f"{name}document {document} has {what} and supplies no example")
        try:
            binding.validate_document(tokens, as_given=as_given)
        except SeqpackError as error:
            raise error.within(f"{name}document {document}")
        raise AssertionError(f"document {document} failed the bulk check but passed the per-document one")

    def __len__(self) -> int:
        return self._begins.shape[0]

    @property
    def document_count(self) -> int:
        return self._doc_offsets.shape[0] - 1

    def _index(self, ordinal) -> int:
        """The row of example ``ordinal`` (``first_ordinal`` up to ``first_ordinal + len``)."""
        if isinstance(ordinal, (bool, np.bool_)) or not isinstance(ordinal, (int, np.integer)):
            raise InvalidInputError(f"an example ordinal must be an int, not {type(ordinal).__name__}")
        index = int(ordinal) - self.first_ordinal
        if not 0 <= index < len(self):
            raise InvalidInputError(
                f"example {shown(int(ordinal))} is outside this table's examples "
                f"[{self.first_ordinal}, {self.first_ordinal + len(self)})"
            )
        return index

    def example_id(self, ordinal: int) -> str:
        """The name of example ``ordinal`` (its id, or ``"#i"``)."""
        index = self._index(ordinal)
        return self._ids[index] if self._ids is not None else f"#{self._index_base + index}"

    def example(self, ordinal: int) -> SequenceExample:
        """Example ``ordinal`` as a SequenceExample over a copy of its document."""
        index = self._index(ordinal)
        document = int(np.searchsorted(self._doc_offsets, self._begins[index], side="right")) - 1
        start = int(self._doc_offsets[document])
        doc = BatchDocument(f"document {document}", self._tokens[start : self._doc_offsets[document + 1]],
                            self.partition)
        source_range = (int(self._begins[index]) - start, int(self._ends[index]) - start)
        supervised = None if self.supervised is None else self.supervised[start : self._doc_offsets[document + 1]]
        return SequenceExample(self.example_id(ordinal), doc, range(*source_range), self.binding, supervised)

    def gather(self, ordinals: np.ndarray):
        """The whole token array and its supervision, with the begins and ends of
        ``ordinals``' source tokens."""
        index = np.asarray(ordinals) - self.first_ordinal
        return self._tokens, self.supervised, self._begins[index], self._ends[index]

    def chunk(self, start: int, stop: int) -> "ExampleTable":
        """Examples ``[start, stop)`` as a table sharing this one's arrays (and example names)."""
        bounds = slice(check_int("start", start, -(1 << 63)), check_int("stop", stop, -(1 << 63)))
        start, stop, _ = bounds.indices(len(self))
        ids = None if self._ids is None else self._ids[start:stop]
        return ExampleTable(self._tokens, self._doc_offsets, self._begins[start:stop], self._ends[start:stop],
                            self.binding, self.partition, ids, self._index_base + start, self.supervised,
                            self.target_counts[start:stop])


def _check_offsets(offsets: np.ndarray, token_count: int) -> None:
    if offsets.shape[0] < 2:
        raise InvalidInputError("offsets needs at least two entries (one document)")
    if offsets[0] != 0 or offsets[-1] != token_count:
        raise InvalidInputError(
            f"offsets must start at 0 and end at the token count {token_count}; "
            f"got {offsets[0]} and {offsets[-1]}"
        )
    step = np.diff(offsets)
    if (step < 0).any():
        document = int(np.argmax(step < 0))
        raise InvalidInputError(f"offsets decrease at document {document}")


def _check_ranges(spans, example_docs, doc_offsets, ids):
    """Absolute token bounds of every range, checked in bulk; raise naming the first bad example."""
    begins = np.empty(spans.shape[0], dtype=np.int64)
    ends = np.empty(spans.shape[0], dtype=np.int64)
    index, fault = _validate.first_bad_range(spans, example_docs, doc_offsets, begins, ends)
    if index < 0:
        return begins, ends
    Fault = _validate.RangeFault
    start, stop, document = spans[index, 0], spans[index, 1], example_docs[index]
    if fault == Fault.DOCUMENT_INDEX:
        why = f"document {document} is outside [0, {doc_offsets.shape[0] - 1})"
    elif fault == Fault.NEGATIVE_BOUND:
        why = f"source range [{start}, {stop}) has a negative bound"
    elif fault == Fault.OUTSIDE_DOCUMENT:
        length = doc_offsets[document + 1] - doc_offsets[document]
        why = f"source range [{start}, {stop}) must lie inside its document of {length} tokens"
    else:
        why = f"source range [{start}, {stop}) has {stop - start} tokens; a prediction needs at least 2"
    name = ids[index] if ids is not None else f"#{index}"
    raise InvalidInputError(f"example {name!r} (index {index}): {why}")


def _check_text_bytes(texts: list, limit: int, names) -> None:
    """Refuse a text of more than ``limit`` bytes (a document decodes to its text's bytes)
    before anything is encoded: the binding would refuse its document anyway, after
    holding all of it. A text's characters bound its UTF-8 bytes from below, four times
    them from above; only a text between the bounds is measured."""
    for index, text in enumerate(texts):
        if isinstance(text, (bytes, bytearray, memoryview)):
            size = memoryview(text).nbytes
        elif isinstance(text, str):
            size = len(text) if len(text) > limit or 4 * len(text) <= limit \
                else len(text.encode("utf-8", "surrogatepass"))
        else:
            continue  # (the tokenizer names it)
        if size > limit:
            name = names[index] if names is not None else f"#{index}"
            raise DecodeLimitError(f"text {name!r} (index {index}) holds more than {limit} bytes, the binding's "
                                   f"decode limit: refused before it is encoded")


def _check_ids(ids, count: int) -> tuple[str, ...]:
    """``ids`` as a tuple of ``count`` non-empty strings, in order."""
    if isinstance(ids, (str, bytes)):  # a single name would become one id per character
        raise InvalidInputError(f"ids must be a sequence of names, not a single {type(ids).__name__}")
    if isinstance(ids, (set, frozenset, dict)) or not isinstance(ids, Iterable):  # no order, or no items
        raise InvalidInputError(
            f"ids must be an ordered sequence of names (a list, a tuple, an array), not a {type(ids).__name__}"
        )
    ids = tuple(ids)
    if len(ids) != count:
        raise InvalidInputError(f"{len(ids)} ids for {count} examples")
    for index, name in enumerate(ids):
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"example id at index {index} must be a non-empty string, not {name!r}")
    return tuple(map(str, ids))  # numpy strings as Python ones
