"""What ``seqpack stats`` reports (seqpack.io.stats): on a dataset with supervision both the
real-target fraction (valid targets / cells) and the supervised-target fraction
(supervised targets / cells), each labelled; without supervision the report as it was."""

import json
import re

import seqpack as sp
from seqpack.cli import main
from seqpack.io import open_dataset, pack_corpus
from seqpack.io.stats import dataset_stats, stats_text

IDS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]
MASKS = [[0, 0, 1, 1], [1, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1]]
CAPACITY = 8


def packed(tmp_path, masks):
    rows = [{"input_ids": ids} if mask is None else {"input_ids": ids, "completion_mask": mask}
            for ids, mask in zip(IDS, masks)]
    source = tmp_path / "sft.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="corpus")
    pack_corpus([sp.io.reader_for(source)], tmp_path / "out", binding=binding, tokenizer=binding.tokenizer,
                config=sp.PackConfig(CAPACITY, 2))
    return tmp_path / "out"


def counted(out) -> tuple[int, int, int]:
    """Cells, valid targets and supervised targets, counted in the dataset's batches themselves."""
    batches = list(open_dataset(out))
    return (sum(batch.cell_count for batch in batches), sum(int(batch.valid_lengths.sum()) for batch in batches),
            sum(int(batch.loss_mask.sum()) for batch in batches))


def lines_of(text: str) -> dict:
    """The text's lines by label (a label and its value are parted by two spaces or more)."""
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text.splitlines())


def test_a_supervised_dataset_reports_both_fractions(tmp_path, capsys):
    out = packed(tmp_path, MASKS)
    cells, valid, supervised = counted(out)
    assert 0 < supervised < valid < cells  # some targets unsupervised, some cells padding
    stats = dataset_stats(open_dataset(out))
    assert stats["report"]["cells"] == cells and stats["counts"]["supervised_targets"] == supervised
    assert stats["report"]["real_target_fraction"] == valid / cells
    assert stats["report"]["supervised_target_fraction"] == supervised / cells
    lines = lines_of(stats_text(stats))
    assert lines["real-target fraction"] == f"{valid / cells:.4f} (valid targets / cells)"
    assert lines["supervised-target fraction"] == f"{supervised / cells:.4f} (supervised targets / cells)"
    assert lines["supervised targets"] == f"{supervised} ({supervised / valid:.4f} of the valid; 0 windows without " \
                                          f"one left out)"
    assert main(["stats", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert report["supervised_target_fraction"] == supervised / cells
    assert report["real_target_fraction"] == valid / cells
    assert main(["stats", str(out)]) == 0
    assert lines_of(capsys.readouterr().out) == lines


def test_without_supervision_the_report_reads_as_before(tmp_path, capsys):
    out = packed(tmp_path, [None] * len(IDS))
    stats = dataset_stats(open_dataset(out))
    assert "supervised_target_fraction" not in stats["report"] and "supervised_targets" not in stats["counts"]
    assert stats["report"] == open_dataset(out).report().as_dict()
    text = stats_text(stats)
    assert "supervised" not in text
    cells, valid, _ = counted(out)
    assert f"\nreal-target fraction  {valid / cells:.4f}\n" in text  # the label's column as it always was, no suffix
    assert main(["stats", str(out), "--json"]) == 0
    assert "supervised_target_fraction" not in json.loads(capsys.readouterr().out)["report"]


def test_a_fully_supervised_dataset_shows_equal_fractions(tmp_path):
    out = packed(tmp_path, [[1] * len(ids) for ids in IDS])
    cells, valid, supervised = counted(out)
    stats = dataset_stats(open_dataset(out))
    assert stats["report"]["supervised_target_fraction"] == stats["report"]["real_target_fraction"] == valid / cells
    assert supervised == valid
