"""Directories written by ``datasets``' ``save_to_disk``. A ``Dataset`` (``state.json``
lists its Arrow stream files, ``dataset_info.json`` describes it) is read as one table:
its files in the order ``state.json`` lists them, its columns as :class:`ArrowBatches`
reads them, its rows counted from 0 across the files (as ``datasets`` counts them). A
``DatasetDict`` (``dataset_dict.json`` names its splits) is refused, naming them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ...errors import InvalidInputError
from .arrow import ArrowBatches, check_stream_end, import_pyarrow
from .base import Input, cannot_read, check_fields, input_path, not_a_file
from .records import RecordFields

#: The files that mark a saved ``Dataset`` (both) and a saved ``DatasetDict``.
DATASET_FILES = ("state.json", "dataset_info.json")
DATASET_DICT_FILE = "dataset_dict.json"


def is_saved_dataset(path: Path) -> bool:
    """Whether a directory was written by ``save_to_disk``: a ``Dataset`` (both
    :data:`DATASET_FILES`) or a ``DatasetDict`` (:data:`DATASET_DICT_FILE`)."""
    return all((path / name).is_file() for name in DATASET_FILES) or (path / DATASET_DICT_FILE).is_file()


def _json_file(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise cannot_read(path, error) from None
    except ValueError as error:
        raise InvalidInputError(f"{path}: not valid JSON: {error}") from None


def _splits_error(directory: Path) -> InvalidInputError:
    """The error for a saved ``DatasetDict``: its splits, and one split's directory to give."""
    listed = _json_file(directory / DATASET_DICT_FILE)
    splits = listed.get("splits") if isinstance(listed, dict) else None
    if not (isinstance(splits, list) and splits and all(isinstance(s, str) for s in splits)):
        return InvalidInputError(f"{directory}: a datasets.DatasetDict (it has {DATASET_DICT_FILE}): give one "
                                 f"split's directory")
    return InvalidInputError(f"{directory}: a datasets.DatasetDict of splits {', '.join(map(repr, splits))}: give "
                             f"one split's directory, such as {directory / splits[0]}")


def data_files(directory: Path) -> list[Path]:
    """A saved ``Dataset``'s Arrow files, in the order its ``state.json`` lists them
    (``_data_files``: ``{"filename": ...}`` entries, names within the directory)."""
    state_path = directory / "state.json"
    state = _json_file(state_path)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not (isinstance(entries, list) and entries
            and all(isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries)):
        raise InvalidInputError(f"{state_path}: no '_data_files' list of {{'filename': ...}} entries")
    files = []
    for entry in entries:
        name = entry["filename"]
        if Path(name).name != name or name in (".", ".."):
            raise InvalidInputError(f"{state_path}: data file {name!r} is not a file name within {directory}")
        files.append(directory / name)
        if not files[-1].is_file():
            raise not_a_file(files[-1], f"no such file (listed in {state_path})")
    return files


class SavedDataset(ArrowBatches):
    """A ``datasets.Dataset.save_to_disk`` directory, read as one table: its Arrow stream
    files in ``state.json``'s order, the columns by :class:`ArrowBatches`' rules, rows
    counted from 0 across the files; errors name ``DIRECTORY row N``. A
    ``DatasetDict``'s directory is an error naming its splits."""

    def __init__(self, path, *, text_field: str | None = None, ids_field: str | None = None):
        path = input_path(path)
        if path.is_file():
            raise InvalidInputError(f"{path}: not a directory")
        if not path.is_dir():
            raise not_a_file(path, "no such directory")
        if (path / DATASET_DICT_FILE).is_file():
            raise _splits_error(path)
        self.source, self.text_field, self.ids_field = path, text_field, ids_field
        self.inputs = [Input(str(path), "arrow", "row")]
        check_fields(str(path), text_field, ids_field)
        self.files = data_files(path)

    def _open(self) -> tuple[RecordFields, Iterator]:
        pa = import_pyarrow()
        check_stream_end(self.files[0])
        try:
            first = pa.ipc.open_stream(self.files[0])
        except (pa.ArrowInvalid, OSError) as error:
            raise InvalidInputError(f"{self.files[0]}: cannot read as an Arrow stream: {error}") from None
        return self._fields(first.schema), self._batches(first)

    def _batches(self, first) -> Iterator:
        """Every file's record batches, in order (a file opened when its turn comes; one
        whose columns differ from the first file's is an error)."""
        pa = import_pyarrow()
        names = first.schema.names
        for index, path in enumerate(self.files):
            if index:
                check_stream_end(path)
            reader = first if index == 0 else pa.ipc.open_stream(path)
            if reader.schema.names != names:
                raise InvalidInputError(f"{path}: columns {', '.join(reader.schema.names)}; {self.files[0]} has "
                                        f"{', '.join(names)}")
            yield from reader
