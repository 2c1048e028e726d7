"""Fixtures of the corpus I/O tests."""

import pytest


@pytest.fixture
def text(tmp_path):
    """A text file ``a.txt`` holding ``hello``: one short document for a reader or a pack."""
    path = tmp_path / "a.txt"
    path.write_text("hello")
    return path
