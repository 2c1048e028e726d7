"""Set-up and fixtures shared by every test directory.

The directories follow the package's layers (data, layout, packing, io, nn, torch, hf, ray,
cli) and hold no ``__init__.py``: pytest imports each test module by its own name (so the
names are unique across the tree), and the modules beside this file (helpers.py,
reference.py, ...) are importable from every directory.
"""

import signal
import sys
from pathlib import Path

import pytest

import seqpack as sp

# A shell starts a background job with SIGINT ignored, and every process it starts inherits
# that: the tests that send SIGINT to a seqpack run expect a terminal user's Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class _ModulesOnly:
    """The import finder of this directory on ``sys.path``: its modules, never its
    subdirectories. A directory without ``__init__.py`` is a namespace package to Python,
    so without this ``import torch`` (or ``find_spec("ray")``) where PyTorch (or Ray) is
    not installed would find tests/torch (tests/ray) instead of failing, and the tests
    that skip without them would fail."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, fullname, target=None):
        spec = self._finder.find_spec(fullname, target)
        return None if spec is not None and spec.loader is None else spec  # no loader: a namespace portion

    def invalidate_caches(self):
        self._finder.invalidate_caches()


def _path_finder(entry):
    for hook in sys.path_hooks:
        try:
            return hook(entry)
        except ImportError:
            continue
    return None


def _import_only_modules_from_here():
    here = Path(__file__).resolve().parent
    for entry in sys.path:  # pytest put this directory there before importing this file
        if not entry or Path(entry).resolve() != here:
            continue
        finder = sys.path_importer_cache.get(entry) or _path_finder(entry)
        if finder is not None and not isinstance(finder, _ModulesOnly):
            sys.path_importer_cache[entry] = _ModulesOnly(finder)


_import_only_modules_from_here()


@pytest.fixture(scope="module")
def binding():
    """The chapters' binding (``BatchBinding.fixture()``): the fixture tokenizer and split receipt."""
    return sp.BatchBinding.fixture()
