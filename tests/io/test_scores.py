"""write_scores: a scores file published whole, never over another's without force."""

import pytest

import seqpack as sp
from seqpack.io import scores as module


def test_two_writers_without_force_cannot_both_publish(tmp_path, monkeypatch):
    """The check that ``out`` does not exist, then a rename, let two writers started at once
    both succeed, the second replacing the first's file (review)."""
    pyarrow = pytest.importorskip("pyarrow", reason="the corpus extra has it: pip install 'seqpack[corpus]'")
    out = tmp_path / "scores.parquet"
    checks = []
    check = module.check_scores_output

    def other_writer_publishes_after_the_last_check(path, force):
        check(path, force)
        checks.append(path)
        if len(checks) == 2:   # the check just before the rename: the other writer wins the race
            path.write_bytes(b"the other writer's scores")

    monkeypatch.setattr(module, "check_scores_output", other_writer_publishes_after_the_last_check)
    with pytest.raises(sp.InvalidInputError, match=f"{out} already exists \\(--force replaces it\\)"):
        module.write_scores(pyarrow.table({"nll_sum": [1.0]}), out, force=False)
    assert out.read_bytes() == b"the other writer's scores"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.parquet"]   # no partial sibling left
    checks.clear()
    monkeypatch.setattr(module, "check_scores_output", check)
    module.write_scores(pyarrow.table({"nll_sum": [1.0]}), out, force=True)
    assert pyarrow.parquet.read_table(out).column("nll_sum").to_pylist() == [1.0]
