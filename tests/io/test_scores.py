"""write_scores: a scores file published whole, never over another's without force."""

import pytest

import seqpack as sp
from seqpack.io import scores as module


def test_two_writers_without_force_cannot_both_publish(tmp_path, monkeypatch):
    """The check that ``out`` does not exist, then a rename, let two writers started at once
    both succeed, the second replacing the first's file (review)."""
    pyarrow = pytest.importorskip("pyarrow", reason="the corpus extra has it: pip install 'seqpack[corpus]'")
    import pyarrow.parquet

    out = tmp_path / "scores.parquet"
    checks = []
    check = module.check_scores_output

    def other_writer_publishes_after_the_last_check(path, force):
        check(path, force)
        checks.append(path)
        if len(checks) == 2:   # the check just before the rename: the other writer wins the race
            pyarrow.parquet.write_table(pyarrow.table({"nll_sum": [7.0]}), path)   # the other writer's scores

    monkeypatch.setattr(module, "check_scores_output", other_writer_publishes_after_the_last_check)
    with pytest.raises(sp.InvalidInputError, match=f"{out} already exists \\(--force replaces it\\)"):
        module.write_scores(pyarrow.table({"nll_sum": [1.0]}), out, force=False)
    assert pyarrow.parquet.read_table(out).column("nll_sum").to_pylist() == [7.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.parquet"]   # no partial sibling left
    checks.clear()
    monkeypatch.setattr(module, "check_scores_output", check)
    module.write_scores(pyarrow.table({"nll_sum": [1.0]}), out, force=True)
    assert pyarrow.parquet.read_table(out).column("nll_sum").to_pylist() == [1.0]


def test_force_replaces_only_a_parquet_file(tmp_path):
    """--force replaced whatever --out named: a model's config.json, say (review)."""
    pyarrow = pytest.importorskip("pyarrow", reason="the corpus extra has it: pip install 'seqpack[corpus]'")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(sp.InvalidInputError, match="config.json is not a Parquet file; --force replaces only a "
                                                   "scores file"):
        module.write_scores(pyarrow.table({"nll_sum": [1.0]}), tmp_path / "config.json", force=True)
    assert (tmp_path / "config.json").read_text() == '{"model_type": "llama"}'
    module.write_scores(pyarrow.table({"nll_sum": [1.0]}), tmp_path / "scores.parquet", force=False)
    module.write_scores(pyarrow.table({"nll_sum": [2.0]}), tmp_path / "scores.parquet", force=True)
    assert pyarrow.parquet.read_table(tmp_path / "scores.parquet").column("nll_sum").to_pylist() == [2.0]


@pytest.mark.parametrize("number", ["EPERM", "ENOSYS", "EXDEV"])
def test_a_file_system_without_hard_links_publishes_all_the_same(tmp_path, monkeypatch, number):
    """FUSE file systems without link(2) answer ENOSYS: the scores were thrown away (review)."""
    import errno
    import os

    pyarrow = pytest.importorskip("pyarrow", reason="the corpus extra has it: pip install 'seqpack[corpus]'")

    def no_links(source, target):
        raise OSError(getattr(errno, number), os.strerror(getattr(errno, number)))

    monkeypatch.setattr(module.os, "link", no_links)
    module.write_scores(pyarrow.table({"nll_sum": [1.0]}), tmp_path / "scores.parquet", force=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.parquet"]
